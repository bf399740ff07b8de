//! One GPU: its context, the stream every kernel runs on, and the kernel modules, compiled by
//! NVRTC for the GPU's own architecture when the device is opened.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, LaunchConfig, SyncOnDrop, ValidAsZeroBits,
};

use super::matmul::Blas;
use super::{Arch, Error, PROGRAMS, compile_all};
use crate::Float;

/// A storage dtype the kernels take: `f32`, `half::f16`, `half::bf16`.
pub trait DeviceFloat: Float + DeviceRepr + ValidAsZeroBits {}
impl<X: Float + DeviceRepr + ValidAsZeroBits> DeviceFloat for X {}

/// An opened GPU with every kernel program loaded and cuBLASLt ready.
pub struct Gpu {
    stream: Arc<CudaStream>,
    modules: HashMap<&'static str, Arc<CudaModule>>,
    blas: Blas,
    opening: OpeningMemory,
}

/// Device memory in use (`cuMemGetInfo`: total less free, every process's) at each stage of
/// [`Gpu::new`], from which the memory model's CUDA overhead is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpeningMemory {
    pub total: usize,
    /// Once the context exists.
    pub after_context: usize,
    /// Once every NVRTC program is loaded as a module.
    pub after_modules: usize,
    /// Once cuBLASLt's handle, workspace and staging buffer exist.
    pub after_blas: usize,
}

impl Gpu {
    /// Open GPU `ordinal`, compile every program as a cubin for its architecture (no JIT; kept
    /// in the process and on disk, so only the first opening compiles: [`compile_all`]) and
    /// allocate cuBLASLt's buffers ([`super::matmul::resident_bytes`]). A machine without the
    /// driver gets [`Error::NoDriver`]: cudarc would panic.
    pub fn new(ordinal: usize) -> Result<Self, Error> {
        // SAFETY: only tries to dlopen libcuda's candidate names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::NoDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        let (_, total) = ctx.mem_get_info()?;
        let used = || -> Result<usize, Error> { Ok(total - ctx.mem_get_info()?.0) };
        let after_context = used()?;
        let (major, minor) = ctx.compute_capability()?;
        let target = Arch::Cubin {
            sm: (major * 10 + minor) as u32,
        };
        let mut modules = HashMap::new();
        for (program, image) in PROGRAMS.iter().zip(compile_all(target)?) {
            modules.insert(program.name, ctx.load_module(image.into())?);
        }
        let after_modules = used()?;
        let stream = ctx.default_stream();
        let blas = Blas::new(&stream)?;
        stream.synchronize()?;
        let opening = OpeningMemory {
            total,
            after_context,
            after_modules,
            after_blas: used()?,
        };
        Ok(Self {
            blas,
            stream,
            modules,
            opening,
        })
    }

    /// What the driver reported in use while this device opened.
    pub fn opening_memory(&self) -> OpeningMemory {
        self.opening
    }

    /// The stream every kernel of this device runs on, in call order.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Copy a host slice to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, Error> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copy a device buffer or view back (waits for the stream).
    pub fn download<T: DeviceRepr>(&self, dev: &impl DevicePtr<T>) -> Result<Vec<T>, Error> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    /// A zeroed device buffer of `n` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, Error> {
        Ok(self.stream.alloc_zeros(n)?)
    }

    pub(crate) fn blas(&self) -> &Blas {
        &self.blas
    }

    /// Kernel `name` of `program`.
    pub(crate) fn function(&self, program: &str, name: &str) -> Result<CudaFunction, Error> {
        let module = self
            .modules
            .get(program)
            .unwrap_or_else(|| panic!("{program} is not in PROGRAMS"));
        Ok(module.load_function(name)?)
    }
}

/// Threads per block of the elementwise and row kernels.
pub const THREADS: u32 = 256;

/// A grid-stride launch over `n` elements: enough blocks to fill the GPU, no more.
pub fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_536) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `THREADS` per row (grid x) and per `y` (grid y). Sizes past `u32` saturate,
/// so that [`check_launch`] refuses them rather than a wrapped grid running.
pub fn rows(x: usize, y: usize) -> LaunchConfig {
    let dim = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    LaunchConfig {
        grid_dim: (dim(x), dim(y), 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The limits of a launch on every GPU the back end runs on (compute capability ≥ 7.0). The
/// memory model copies `.1`, the most attention heads a launch takes (`scheduler::
/// kernel_figures`; `tests/figures.rs` holds the two equal).
pub const MAX_GRID: (u32, u32, u32) = (i32::MAX as u32, 65_535, 65_535);
pub const MAX_THREADS: u32 = 1024;
/// Shared memory a block may have without opting in (static + dynamic).
pub const MAX_SHARED: usize = 48 << 10;

/// Whether `cfg` is a launch kernel `kernel` can run: grid and block within the limits,
/// `static_shared` (the kernel's own `__shared__` bytes) plus the dynamic shared memory
/// within 48 KiB, and at most `max_threads` (the kernel's limit given its registers) threads.
/// [`Error::Launch`] names the kernel and what is over, instead of the driver's launch failure.
pub fn check_launch(
    kernel: &str,
    cfg: &LaunchConfig,
    static_shared: usize,
    max_threads: u32,
) -> Result<(), Error> {
    let (g, b) = (cfg.grid_dim, cfg.block_dim);
    let threads = b.0 as u64 * b.1 as u64 * b.2 as u64;
    let shared = static_shared + cfg.shared_mem_bytes as usize;
    let reason = if threads == 0 || g.0 == 0 || g.1 == 0 || g.2 == 0 {
        format!("an empty launch: grid {g:?}, block {b:?}")
    } else if g.0 > MAX_GRID.0 || g.1 > MAX_GRID.1 || g.2 > MAX_GRID.2 {
        format!("grid {g:?} is over the limits (2^31-1, 65535, 65535)")
    } else if threads > max_threads.min(MAX_THREADS) as u64 || b.2 > 64 {
        format!(
            "block {b:?} has {threads} threads; this kernel takes at most {}",
            max_threads.min(MAX_THREADS)
        )
    } else if shared > MAX_SHARED {
        format!("{shared} bytes of shared memory per block, over {MAX_SHARED}")
    } else {
        return Ok(());
    };
    Err(Error::Launch {
        kernel: kernel.into(),
        reason,
    })
}

/// The raw pointer of an optional output (null for `None`, which the kernel skips), and the
/// guard that records the write once dropped after the launch.
pub(crate) fn optional_ptr<'a, T>(
    out: &'a mut Option<&mut CudaViewMut<'_, T>>,
    stream: &'a CudaStream,
) -> (u64, Option<SyncOnDrop<'a>>) {
    match out {
        Some(s) => {
            let (p, sync) = s.device_ptr_mut(stream);
            (p, Some(sync))
        }
        None => (0, None),
    }
}

/// The raw pointer of an optional input (null for `None`) and its read guard.
pub(crate) fn input_ptr<'a, T, P: DevicePtr<T>>(
    input: Option<&'a P>,
    stream: &'a CudaStream,
) -> (u64, Option<SyncOnDrop<'a>>) {
    match input {
        Some(s) => {
            let (p, sync) = s.device_ptr(stream);
            (p, Some(sync))
        }
        None => (0, None),
    }
}

/// `launch!(dev, "file.cu", name, cfg; args…)`: launch kernel `name` of a program on the
/// device's stream, after [`check_launch`] against the kernel's own limits (its static shared
/// memory and the threads its registers allow). Arguments must be places (`&n`, `out`), not
/// temporaries: the launch holds pointers to them.
macro_rules! launch {
    ($dev:expr, $program:literal, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let name: &str = &$name;
        let f = $dev.function($program, name)?;
        let cfg: cudarc::driver::LaunchConfig = $cfg;
        $crate::cuda::check_launch(
            name,
            &cfg,
            f.shared_size_bytes()? as usize,
            f.max_threads_per_block()? as u32,
        )?;
        let mut b = $dev.stream().launch_builder(&f);
        $( cudarc::driver::PushKernelArg::arg(&mut b, $arg); )*
        // SAFETY: callers push the arguments of the kernel's C signature in order, of the
        // matching types (`long` = i64, `int` = i32), after checking the buffer lengths.
        unsafe { b.launch(cfg) }?;
    }};
}
pub(crate) use launch;
