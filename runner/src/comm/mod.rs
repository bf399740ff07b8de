//! Collectives between the data-parallel ranks of a job: ring algorithms over a transport that
//! exchanges bytes with the ring's neighbours — threads of one process (`local`) or processes
//! over TCP (`tcp`) — and, for ranks on GPUs, NCCL on the device buffers themselves (`nccl`,
//! feature `cuda`), joined through the ring, which keeps the few host collectives.
//!
//! A buffer of `len` elements travels as N chunks of ⌈len/N⌉ (units are padded so theirs are
//! exact; a short chunk travels padded with zeros). Reduce-scatter and all-gather send N−1
//! chunks per rank, all-reduce (reduce-scatter then all-gather) twice that: the memory model's
//! numbers. Each chunk is summed in one fixed order around the ring, so every collective is
//! deterministic and every stage reduces the same gradients to the same bits.

mod local;
#[cfg(feature = "cuda")]
mod nccl;
mod tcp;

pub use local::local_ring;
pub use tcp::{TcpConfig, tcp_ring, tcp_ring_with_master};
/// The collectives, named as the agent protocol names them.
pub use wire::Op;

use std::collections::BTreeMap;
use std::ops::Range;

use half::{bf16, f16};

use crate::Error;
use crate::accounting::Buffer;
use crate::device::{Cpu, Device, Elem};
use crate::step_timers;

/// Moves bytes between a rank and its ring neighbours.
pub trait Transport: Send {
    /// Sends the concatenation of `out` to the next rank while receiving exactly `inp.len()`
    /// bytes from the previous one.
    fn exchange(&mut self, out: &[&[u8]], inp: &mut [u8]) -> Result<(), Error>;
}

/// An element type collectives can carry and sum.
pub trait Summable: bytemuck::Pod + Send + Sync + kernels::cuda::nccl::NcclType {
    /// `acc += x` element-wise (16-bit floats are summed in f32 and rounded once).
    fn add(acc: &mut [Self], x: &[Self]);
}

macro_rules! plain_add {
    ($($t:ty),*) => {$(
        impl Summable for $t {
            fn add(acc: &mut [Self], x: &[Self]) {
                acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
            }
        }
    )*};
}
plain_add!(f32, f64);

macro_rules! widened_add {
    ($($t:ty),*) => {$(
        impl Summable for $t {
            fn add(acc: &mut [Self], x: &[Self]) {
                acc.iter_mut().zip(x).for_each(|(a, b)| *a = <$t>::from_f32(a.to_f32() + b.to_f32()));
            }
        }
    )*};
}
widened_add!(f16, bf16);

impl Summable for u8 {
    fn add(acc: &mut [Self], x: &[Self]) {
        acc.iter_mut()
            .zip(x)
            .for_each(|(a, b)| *a = a.wrapping_add(*b));
    }
}

/// How a device's buffers take part in collectives. By default they go through the host ring;
/// a device with collectives of its own (NCCL on a GPU) runs them on its buffers where they lie,
/// once its ranks have joined them.
pub trait DeviceCollectives: Device {
    /// `comm`'s collective `c` on `v`.
    fn collective<T: Elem + Summable>(
        &self,
        comm: &mut Communicator,
        c: Collective,
        v: Self::ViewMut<'_, T>,
    ) -> Result<(), Error> {
        let run = || self.on_host(v, |b| comm.run(c, b));
        step_timers::time(|| step_timers::Group::Collectives, run)?
    }

    /// Joins `comm`'s ranks in the device's own collectives, for a communicator that asked for
    /// them ([`Communicator::request_nccl`]).
    fn join_collectives(&self, comm: &mut Communicator) -> Result<(), Error> {
        let _ = comm;
        Err(Error::Device(
            "the nccl back end needs ranks on CUDA devices".into(),
        ))
    }
}

impl DeviceCollectives for Cpu {}

/// A collective on a data buffer, as the engine runs them on device memory
/// ([`DeviceCollectives::collective`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Collective {
    pub fn op(self) -> Op {
        match self {
            Collective::AllReduce => Op::AllReduce,
            Collective::ReduceScatter => Op::ReduceScatter,
            Collective::AllGather => Op::AllGather,
        }
    }

    /// Ring passes over the buffer: a reduce-scatter and an all-gather make one each.
    fn passes(self) -> u64 {
        match self {
            Collective::AllReduce => 2,
            Collective::ReduceScatter | Collective::AllGather => 1,
        }
    }
}

/// Zeros that pad a short chunk on the wire (a chunk is short by fewer than N elements).
static ZEROS: [u8; 1 << 16] = [0; 1 << 16];

/// This rank's handle on its job's collectives.
pub struct Communicator {
    rank: usize,
    world_size: usize,
    transport: Option<Box<dyn Transport>>,
    /// Where a chunk is received: sized by the memory model, charged to `buffers`.
    scratch: Option<Buffer<u64>>,
    sent: BTreeMap<Op, u64>,
    received: BTreeMap<Op, u64>,
    /// Device collectives are to run on NCCL ([`Communicator::request_nccl`]).
    nccl_requested: bool,
    #[cfg(feature = "cuda")]
    nccl: Option<kernels::cuda::nccl::Nccl>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Communicator {{ rank: {}, world_size: {} }}",
            self.rank, self.world_size
        )
    }
}

impl Communicator {
    /// The communicator of a single-rank job: every collective leaves its buffer as it is.
    pub fn solo() -> Communicator {
        Communicator::new(0, 1, None)
    }

    fn new(rank: usize, world_size: usize, transport: Option<Box<dyn Transport>>) -> Communicator {
        Communicator {
            rank,
            world_size,
            transport,
            scratch: None,
            sent: BTreeMap::new(),
            received: BTreeMap::new(),
            nccl_requested: false,
            #[cfg(feature = "cuda")]
            nccl: None,
        }
    }

    /// Asks for the `nccl` back end: the engine of a rank on a GPU joins an NCCL communicator
    /// through this one's ring when it starts, and runs its device collectives there.
    pub fn request_nccl(&mut self) {
        self.nccl_requested = true;
    }

    pub fn nccl_requested(&self) -> bool {
        self.nccl_requested
    }

    /// `c` on host memory, through the ring.
    pub fn run<T: Summable>(&mut self, c: Collective, buf: &mut [T]) -> Result<(), Error> {
        match c {
            Collective::AllReduce => self.all_reduce(buf),
            Collective::ReduceScatter => self.reduce_scatter(buf),
            Collective::AllGather => self.all_gather(buf),
        }
    }

    /// Counts `c` on a `len`-element buffer of `T` as the ring would send and receive it (N−1
    /// chunks of ⌈len/N⌉ per pass), for a back end that moved the bytes itself: every back end
    /// reports the memory model's numbers.
    pub fn count<T>(&mut self, c: Collective, len: usize) {
        let n = self.world_size as u64;
        let bytes = c.passes() * (n - 1) * (len.div_ceil(self.world_size) * size_of::<T>()) as u64;
        *self.sent.entry(c.op()).or_default() += bytes;
        *self.received.entry(c.op()).or_default() += bytes;
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Gives the communicator its receive buffer (bytes, a multiple of 8).
    pub fn set_scratch(&mut self, scratch: Buffer<u64>) {
        self.scratch = Some(scratch);
    }

    /// Bytes this rank has sent, by collective.
    pub fn sent_bytes(&self) -> &BTreeMap<Op, u64> {
        &self.sent
    }

    /// Bytes this rank has received, by collective (equal to those sent: every ring step
    /// moves one chunk each way).
    pub fn received_bytes(&self) -> &BTreeMap<Op, u64> {
        &self.received
    }

    /// Every rank's `buf` becomes the element-wise sum over ranks.
    pub fn all_reduce<T: Summable>(&mut self, buf: &mut [T]) -> Result<(), Error> {
        self.reduce_scatter_as(buf, Op::AllReduce)?;
        self.all_gather_as(buf, Op::AllReduce)
    }

    /// Chunk `rank` of `buf` becomes the sum over ranks (other chunks hold partial sums).
    pub fn reduce_scatter<T: Summable>(&mut self, buf: &mut [T]) -> Result<(), Error> {
        self.reduce_scatter_as(buf, Op::ReduceScatter)
    }

    /// Every rank's `buf` becomes the concatenation of every rank's own chunk of it.
    pub fn all_gather<T: Summable>(&mut self, buf: &mut [T]) -> Result<(), Error> {
        self.all_gather_as(buf, Op::AllGather)
    }

    /// Every rank's `buf` becomes `root`'s: the others contribute zeros to an all-reduce.
    pub fn broadcast<T: Summable>(&mut self, buf: &mut [T], root: usize) -> Result<(), Error> {
        if self.rank != root {
            buf.fill(T::zeroed());
        }
        self.reduce_scatter_as(buf, Op::Broadcast)?;
        self.all_gather_as(buf, Op::Broadcast)
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<(), Error> {
        let mut token = vec![0u8; self.world_size];
        self.all_gather_as(&mut token, Op::Barrier)
    }

    /// Element range of chunk `i` of a `len`-element buffer.
    fn chunk(&self, len: usize, i: usize) -> Range<usize> {
        let s = len.div_ceil(self.world_size);
        (i * s).min(len)..((i + 1) * s).min(len)
    }

    /// Sends chunk `send` of `buf` and returns the received chunk's bytes (in the scratch).
    fn step<T: Summable>(&mut self, buf: &[T], send: usize, op: Op) -> Result<&[u8], Error> {
        let wire = buf.len().div_ceil(self.world_size) * size_of::<T>();
        let out: &[u8] = bytemuck::cast_slice(&buf[self.chunk(buf.len(), send)]);
        let pad = &ZEROS[..wire - out.len()];
        let scratch = self
            .scratch
            .as_deref_mut()
            .ok_or_else(|| Error::Untrainable {
                reason: "a multi-rank collective ran before its scratch was set".into(),
            })?;
        let inp = bytemuck::cast_slice_mut::<u64, u8>(scratch);
        if inp.len() < wire {
            return Err(Error::Untrainable {
                reason: format!(
                    "a {wire}-byte chunk exceeds the {}-byte ring buffer",
                    inp.len()
                ),
            });
        }
        let transport = self
            .transport
            .as_mut()
            .expect("multi-rank communicators have a transport");
        transport.exchange(&[out, pad], &mut inp[..wire])?;
        *self.sent.entry(op).or_default() += wire as u64;
        *self.received.entry(op).or_default() += wire as u64;
        Ok(&inp[..wire])
    }

    fn reduce_scatter_as<T: Summable>(&mut self, buf: &mut [T], op: Op) -> Result<(), Error> {
        let (n, r) = (self.world_size, self.rank);
        for k in 0..n.saturating_sub(1) {
            let (send, recv) = ((r + 2 * n - k - 1) % n, (r + 2 * n - k - 2) % n);
            let dst = self.chunk(buf.len(), recv);
            let got = self.step(buf, send, op)?;
            // The scratch is u64-aligned, so the chunk can be read in place as `T`s.
            let got: &[T] = bytemuck::cast_slice(&got[..dst.len() * size_of::<T>()]);
            T::add(&mut buf[dst], got);
        }
        Ok(())
    }

    fn all_gather_as<T: Summable>(&mut self, buf: &mut [T], op: Op) -> Result<(), Error> {
        let (n, r) = (self.world_size, self.rank);
        for k in 0..n.saturating_sub(1) {
            let (send, recv) = ((r + n - k) % n, (r + 2 * n - k - 1) % n);
            let dst = self.chunk(buf.len(), recv);
            let got = self.step(buf, send, op)?;
            let bytes = dst.len() * size_of::<T>();
            bytemuck::cast_slice_mut::<T, u8>(&mut buf[dst]).copy_from_slice(&got[..bytes]);
        }
        Ok(())
    }
}
