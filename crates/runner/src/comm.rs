//! Collectives between the data-parallel ranks of a job. One rank needs none: every collective
//! over a world of one leaves its buffer as it is. Multi-rank back ends (ring algorithms over
//! threads or TCP) arrive with the ZeRO issue.

use crate::Error;

/// This rank's handle on its job's collectives.
#[derive(Debug)]
pub struct Communicator {
    rank: usize,
    world_size: usize,
}

impl Communicator {
    /// The communicator of a single-rank job.
    pub fn solo() -> Communicator {
        Communicator {
            rank: 0,
            world_size: 1,
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Every rank's `buf` becomes the element-wise sum over ranks.
    pub fn all_reduce<T: Copy>(&mut self, buf: &mut [T]) -> Result<(), Error> {
        self.single(buf)
    }

    /// Chunk `rank` of `buf` (of `world_size` equal chunks) becomes the sum over ranks.
    pub fn reduce_scatter<T: Copy>(&mut self, buf: &mut [T]) -> Result<(), Error> {
        self.single(buf)
    }

    /// Every rank's `buf` becomes the concatenation of every rank's chunk of it.
    pub fn all_gather<T: Copy>(&mut self, buf: &mut [T]) -> Result<(), Error> {
        self.single(buf)
    }

    fn single<T>(&self, _buf: &mut [T]) -> Result<(), Error> {
        assert_eq!(
            self.world_size, 1,
            "multi-rank collectives are not built yet"
        );
        Ok(())
    }
}
