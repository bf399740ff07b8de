//! NCCL collectives on device buffers (cudarc's `nccl` bindings, loaded at run time), in place
//! and on a stream of their own. cudarc orders that stream against the device's by the events
//! it records on every buffer, so a collective waits for the kernels that wrote its buffer, and
//! kernels that use the result wait for the collective, while other work goes on beside it.
//!
//! Rank 0 makes the communicator's unique id ([`unique_id`]); the caller hands it to the other
//! ranks through the job's own rendezvous, and every rank then [`Nccl::join`]s.

use std::ffi::{c_char, c_void};
use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaViewMut, DevicePtrMut};
use cudarc::nccl::{result, sys};

pub use cudarc::nccl::NcclType;

use super::{Error, Gpu};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

fn loaded() -> Result<(), Error> {
    // SAFETY: only tries to dlopen libnccl's candidate names.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::NoNccl)
    }
}

fn check(r: Result<result::NcclStatus, result::NcclError>, what: &str) -> Result<(), Error> {
    r.map(drop)
        .map_err(|e| Error::Nccl(format!("{what}: {:?}", e.0)))
}

/// A new communicator's unique id (rank 0 makes it; every rank joins with it).
pub fn unique_id() -> Result<[u8; ID_BYTES], Error> {
    loaded()?;
    let id =
        result::get_uniqueid().map_err(|e| Error::Nccl(format!("ncclGetUniqueId: {:?}", e.0)))?;
    Ok(id.internal.map(|c| c as u8))
}

/// One rank's NCCL communicator, with the stream its collectives run on.
pub struct Nccl {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
}

// SAFETY: a communicator may be used from any thread, one call at a time (`&mut self` or the
// owner's exclusive use); NCCL forbids only concurrent calls on one communicator.
unsafe impl Send for Nccl {}

impl Nccl {
    /// Joins `device`'s GPU to the communicator `id` names as rank `rank` of `world_size`, on a
    /// new stream. Blocks until every rank has joined (NCCL refuses two ranks on one GPU).
    pub fn join(
        device: &Gpu,
        rank: usize,
        world_size: usize,
        id: &[u8; ID_BYTES],
    ) -> Result<Nccl, Error> {
        loaded()?;
        let ctx = device.stream().context();
        let stream = ctx.new_stream()?;
        // ncclCommInitRank binds the communicator to the thread's current device.
        ctx.bind_to_thread()?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut comm = MaybeUninit::uninit();
        let (n, r) = (world_size as i32, rank as i32);
        // SAFETY: `comm` is written by NCCL before it is read.
        check(
            unsafe { result::comm_init_rank(comm.as_mut_ptr(), n, id, r) },
            "ncclCommInitRank",
        )?;
        Ok(Nccl {
            // SAFETY: initialised by the successful call above.
            comm: unsafe { comm.assume_init() },
            stream,
            rank,
            world_size,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Every rank's `buf` becomes the element-wise sum over ranks.
    pub fn all_reduce<T: NcclType>(&mut self, buf: &mut CudaViewMut<'_, T>) -> Result<(), Error> {
        let len = buf.len();
        let (ptr, _written) = buf.device_ptr_mut(&self.stream);
        // SAFETY: in place over the whole view, `len` elements of `T`.
        check(
            unsafe {
                result::all_reduce(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    len,
                    T::as_nccl_type(),
                    sys::ncclRedOp_t::ncclSum,
                    self.comm,
                    self.stream.cu_stream() as _,
                )
            },
            "ncclAllReduce",
        )
    }

    /// Chunk `rank` of `buf` (of `len / world_size` elements) becomes the sum over ranks; the
    /// other chunks are left as they were.
    pub fn reduce_scatter<T: NcclType>(
        &mut self,
        buf: &mut CudaViewMut<'_, T>,
    ) -> Result<(), Error> {
        let chunk = self.chunk(buf.len())?;
        let offset = (self.rank * chunk * size_of::<T>()) as u64;
        let (ptr, _written) = buf.device_ptr_mut(&self.stream);
        // SAFETY: NCCL's in-place form: the receive buffer is the send buffer's chunk `rank`.
        check(
            unsafe {
                result::reduce_scatter(
                    ptr as *const c_void,
                    (ptr + offset) as *mut c_void,
                    chunk,
                    T::as_nccl_type(),
                    sys::ncclRedOp_t::ncclSum,
                    self.comm,
                    self.stream.cu_stream() as _,
                )
            },
            "ncclReduceScatter",
        )
    }

    /// Every rank's `buf` becomes the concatenation of every rank's chunk `rank` of it.
    pub fn all_gather<T: NcclType>(&mut self, buf: &mut CudaViewMut<'_, T>) -> Result<(), Error> {
        let chunk = self.chunk(buf.len())?;
        let offset = (self.rank * chunk * size_of::<T>()) as u64;
        let (ptr, _written) = buf.device_ptr_mut(&self.stream);
        // SAFETY: NCCL's in-place form: the send buffer is the receive buffer's chunk `rank`.
        check(
            unsafe {
                result::all_gather(
                    (ptr + offset) as *const c_void,
                    ptr as *mut c_void,
                    chunk,
                    T::as_nccl_type(),
                    self.comm,
                    self.stream.cu_stream() as _,
                )
            },
            "ncclAllGather",
        )
    }

    /// Elements per rank of a `len`-element buffer, which must split evenly (units are padded
    /// to a multiple of the world size).
    fn chunk(&self, len: usize) -> Result<usize, Error> {
        if !len.is_multiple_of(self.world_size) {
            return Err(Error::Nccl(format!(
                "a {len}-element buffer does not split into {} equal chunks",
                self.world_size
            )));
        }
        Ok(len / self.world_size)
    }

    /// Waits until every collective queued so far has finished.
    pub fn synchronize(&self) -> Result<(), Error> {
        Ok(self.stream.synchronize()?)
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // Queued collectives finish first; a rank that failed mid-collective has its peers'
        // operations aborted rather than waited for.
        let _ = self.stream.synchronize();
        // SAFETY: the communicator is not used after this.
        let _ = unsafe { result::comm_abort(self.comm) };
    }
}
