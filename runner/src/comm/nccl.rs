//! The `nccl` back end (feature `cuda`): a rank on a GPU joins an NCCL communicator of its job's
//! ranks through the ring it already has, so the job's own rendezvous (threads of one process,
//! or TCP through `--master` or the server's assignment) is the only one.

use kernels::cuda::CudaViewMut;
use kernels::cuda::nccl::{ID_BYTES, Nccl, unique_id};

use super::{Collective, Communicator, DeviceCollectives, Summable};
use crate::Error;
use crate::device::{Cuda, Device, Elem};

impl DeviceCollectives for Cuda {
    fn collective<T: Elem + Summable>(
        &self,
        comm: &mut Communicator,
        c: Collective,
        mut v: CudaViewMut<'_, T>,
    ) -> Result<(), Error> {
        let Some(nccl) = comm.nccl.as_mut() else {
            return self.on_host(v, |b| comm.run(c, b))?;
        };
        let len = v.len();
        match c {
            Collective::AllReduce => nccl.all_reduce(&mut v)?,
            Collective::ReduceScatter => nccl.reduce_scatter(&mut v)?,
            Collective::AllGather => nccl.all_gather(&mut v)?,
        }
        comm.count::<T>(c, len);
        Ok(())
    }

    fn join_collectives(&self, comm: &mut Communicator) -> Result<(), Error> {
        comm.join_nccl(self.gpu())
    }
}

impl Communicator {
    /// Joins an NCCL communicator of the same ranks on `device`'s GPU: rank 0 makes its unique
    /// id and broadcasts it over this communicator's ring, then every rank joins. Device
    /// collectives run there from then on; host ones (the loss and norm the ranks agree on,
    /// barriers, the export's gathers) stay on the ring.
    fn join_nccl(&mut self, device: &kernels::cuda::Gpu) -> Result<(), Error> {
        let mut id = [0u8; ID_BYTES];
        if self.rank == 0 {
            id = unique_id()?;
        }
        // Setting up is not a step's traffic: the counts stay the memory model's.
        let counted = (self.sent.clone(), self.received.clone());
        self.broadcast(&mut id, 0)?;
        (self.sent, self.received) = counted;
        self.nccl = Some(Nccl::join(device, self.rank, self.world_size, &id)?);
        Ok(())
    }
}
