//! Dense layers on cuBLASLt, with the shapes and semantics of [`crate::matmul`]: forward
//! `out (M, N) = inp (M, K) · W + bias`, backward `dinp = dout · Wᵀ` (overwritten or added
//! to), `dweight += inpᵀ · dout` and `dbias +=` column sums of `dout`.
//!
//! cuBLASLt is column-major, and a row-major `(R, C)` matrix is its column-major transpose, so
//! every product is handed over transposed (`outᵀ = op(W)ᵀ · inpᵀ`) and nothing is copied.
//! Every product uses `CUBLAS_COMPUTE_32F`: f32 stays f32 (never TF32), so it agrees with the
//! CPU to f32 rounding; bf16/f16 products are exact in the f32 accumulator, rounded once on
//! store, and `dweight +=` adds the old value in f32 before that one rounding, as the CPU does.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

use super::device::launch;
use super::layers::ColumnSums;
use super::{DeviceFloat, Error, Gpu};
use crate::Float;
pub use crate::matmul::{DinpMode, Layout};

/// cuBLASLt's scratch, one per device: NVIDIA's recommendation for Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// cuBLASLt multiplies A and B of one dtype, so an f32 `dout` (dlogits) meets 16-bit weights
/// only after a cast to their dtype, in row blocks of at most this many bytes, one per device.
pub const STAGING_BYTES: usize = 32 << 20;

/// The cuBLASLt handle of a device and the buffers its products use.
pub(crate) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    staging: Mutex<CudaSlice<u8>>,
}

// SAFETY: cuBLASLt handles may be used from any thread; every product is queued on the one
// stream of the device, which orders the uses of the workspace and the staging buffer.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Blas {
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Self, Error> {
        // SAFETY: only tries to dlopen libcublasLt's candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoCublasLt);
        }
        stream.context().bind_to_thread()?;
        Ok(Self {
            handle: lt::create_handle()?,
            workspace: stream.alloc_zeros(WORKSPACE_BYTES)?,
            staging: Mutex::new(stream.alloc_zeros(STAGING_BYTES)?),
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle came from create_handle and is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// Device memory the GEMMs hold for the life of a device (workspace and staging), for the
/// memory model, which copies it (`scheduler::kernel_figures`; `tests/figures.rs` holds the
/// two equal).
pub const fn resident_bytes() -> usize {
    WORKSPACE_BYTES + STAGING_BYTES
}

/// Forward: `out (M, N) = inp (M, K) · W + bias`, `weight` `(K, N)` for [`Layout::KN`] or
/// `(N, K)` for [`Layout::NK`]. `out` is `X` or `f32` (logits); the bias, added by cuBLASLt's
/// epilogue in f32 before the one rounding, has the dtype of `out`.
pub fn matmul_forward<X: DeviceFloat, Y: DeviceFloat>(
    dev: &Gpu,
    out: &mut CudaViewMut<'_, Y>,
    inp: &CudaView<'_, X>,
    weight: &CudaView<'_, X>,
    bias: Option<&CudaView<'_, Y>>,
    layout: Layout,
    (m, k, n): (usize, usize, usize),
) -> Result<(), Error> {
    assert_eq!(out.len(), m * n, "out must be (M, N)");
    assert_eq!(inp.len(), m * k, "inp must be (M, K)");
    assert_eq!(weight.len(), k * n, "weight must hold K·N elements");
    assert!(
        Y::NAME == X::NAME || Y::NAME == "f32",
        "out must be X or f32"
    );
    assert!(m > 0 && k > 0 && n > 0, "cuBLASLt needs non-empty matrices");
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "bias must be (N)");
    }
    let s = dev.stream();
    let (o, _o) = out.device_ptr_mut(s);
    let (x, _x) = inp.device_ptr(s);
    let (w, _w) = weight.device_ptr(s);
    let bias = bias.map(|b| b.device_ptr(s));
    // outᵀ (N, M) = Wᵀ (N, K) · inpᵀ (K, M).
    let w = match layout {
        Layout::KN => Mat::new::<X>(w, n, k),
        Layout::NK => Mat::new::<X>(w, k, n).t(),
    };
    dev.blas().product(
        s,
        Mat::new::<Y>(o, n, m),
        w,
        Mat::new::<X>(x, k, m),
        Accumulate::No,
        bias.as_ref().map(|b| b.0),
    )
}

/// Backward of [`matmul_forward`]: `dinp (M, K) = dout · Wᵀ` (overwritten, or added to with
/// [`DinpMode::Accumulate`]: cuBLASLt's `beta = 1`), `dweight += inpᵀ · dout` in the layout of
/// `weight`, `dbias (N) +=` column sums of `dout` (in f32, rounded once;
/// see `matmul.cu`). `dout (M, N)` is `X` or `f32` (dlogits): an f32 `dout` with 16-bit
/// weights is rounded to their dtype, row block by row block, before its products.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<X: DeviceFloat, G: DeviceFloat>(
    dev: &Gpu,
    dinp: &mut CudaViewMut<'_, X>,
    dweight: &mut CudaViewMut<'_, X>,
    dbias: Option<&mut CudaViewMut<'_, X>>,
    dout: &CudaView<'_, G>,
    inp: &CudaView<'_, X>,
    weight: &CudaView<'_, X>,
    layout: Layout,
    mkn: (usize, usize, usize),
    dinp_mode: DinpMode,
) -> Result<(), Error> {
    let input = Some((dinp, weight, dinp_mode));
    backward(dev, input, Some((dweight, inp)), dbias, dout, layout, mkn)
}

/// [`matmul_backward`] through a frozen weight (LoRA's base): `dinp` only.
pub fn matmul_backward_input<X: DeviceFloat, G: DeviceFloat>(
    dev: &Gpu,
    dinp: &mut CudaViewMut<'_, X>,
    dout: &CudaView<'_, G>,
    weight: &CudaView<'_, X>,
    layout: Layout,
    mkn: (usize, usize, usize),
    dinp_mode: DinpMode,
) -> Result<(), Error> {
    let input = Some((dinp, weight, dinp_mode));
    backward(dev, input, None, None, dout, layout, mkn)
}

/// [`matmul_backward`]'s weight gradient only (LoRA's A under dropout).
pub fn matmul_backward_weight<X: DeviceFloat, G: DeviceFloat>(
    dev: &Gpu,
    dweight: &mut CudaViewMut<'_, X>,
    dout: &CudaView<'_, G>,
    inp: &CudaView<'_, X>,
    layout: Layout,
    mkn: (usize, usize, usize),
) -> Result<(), Error> {
    backward(dev, None, Some((dweight, inp)), None, dout, layout, mkn)
}

/// The input's gradient through a weight (`dinp`, the weight, set or added to) and a trained
/// weight's gradient (with its input) from `dout`, each where asked for.
type InputGrad<'a, 'b, 'c, X> = (&'a mut CudaViewMut<'b, X>, &'a CudaView<'c, X>, DinpMode);
type WeightGrad<'a, 'b, 'c, X> = (&'a mut CudaViewMut<'b, X>, &'a CudaView<'c, X>);

/// [`matmul_backward`]'s products, each where asked for.
fn backward<X: DeviceFloat, G: DeviceFloat>(
    dev: &Gpu,
    input: Option<InputGrad<'_, '_, '_, X>>,
    trained: Option<WeightGrad<'_, '_, '_, X>>,
    dbias: Option<&mut CudaViewMut<'_, X>>,
    dout: &CudaView<'_, G>,
    layout: Layout,
    (m, k, n): (usize, usize, usize),
) -> Result<(), Error> {
    if let Some((dinp, weight, _)) = &input {
        assert_eq!(dinp.len(), m * k, "dinp must be (M, K)");
        assert_eq!(weight.len(), k * n, "weight must hold K·N elements");
    }
    if let Some((dweight, inp)) = &trained {
        assert_eq!(dweight.len(), k * n, "dweight must hold K·N elements");
        assert_eq!(inp.len(), m * k, "inp must be (M, K)");
    }
    assert_eq!(dout.len(), m * n, "dout must be (M, N)");
    assert!(
        G::NAME == X::NAME || G::NAME == "f32",
        "dout must be X or f32"
    );
    assert!(m > 0 && k > 0 && n > 0, "cuBLASLt needs non-empty matrices");
    if let Some(db) = dbias {
        assert_eq!(db.len(), n, "dbias must be (N)");
        // The partial column sums live in the staging buffer: the stream runs the bias
        // kernels before any cast below reuses it.
        let cols = bias_backward_config(m, n);
        let (ml, nl, chunk) = (m as i64, n as i64, cols.chunk as i64);
        let mut staging = dev.blas().staging.lock().expect("staging lock");
        // SAFETY: scratch f32 fit STAGING_BYTES (bias_backward_config), and the first kernel
        // writes every partial the second reads.
        let mut parts = unsafe { staging.transmute_mut::<f32>(cols.scratch) }
            .expect("the partials fit staging");
        launch!(dev, "matmul.cu", format!("matmul_bias_backward_parts_{}", G::NAME), cols.parts;
            &mut parts, dout, &ml, &nl, &chunk);
        let parts = parts.as_view();
        launch!(dev, "matmul.cu", format!("matmul_bias_backward_sums_{}", X::NAME), cols.sums;
            db, &parts, &ml, &nl, &chunk);
    }
    let (s, blas) = (dev.stream(), dev.blas());
    let input =
        input.map(|(dinp, weight, mode)| (dinp.device_ptr_mut(s), weight.device_ptr(s), mode));
    let trained = trained.map(|(dweight, inp)| (dweight.device_ptr_mut(s), inp.device_ptr(s)));
    let size = size_of::<X>() as u64;
    // dinp and dweight from rows `i0..i0 + r` of dout (at `dy`, of dtype X).
    let rows = |i0: usize, r: usize, dy: u64| -> Result<(), Error> {
        let dy = Mat::new::<X>(dy, n, r);
        if let Some(((dx, _), (w, _), mode)) = &input {
            let dx = dx + (i0 * k) as u64 * size;
            // dinpᵀ (K, r) = W (K, N) · doutᵀ (N, r).
            let w = match layout {
                Layout::KN => Mat::new::<X>(*w, n, k).t(),
                Layout::NK => Mat::new::<X>(*w, k, n),
            };
            let acc = match mode {
                DinpMode::Overwrite => Accumulate::No,
                DinpMode::Accumulate => Accumulate::Yes,
            };
            blas.product(s, Mat::new::<X>(dx, k, r), w, dy, acc, None)?;
        }
        let Some(((dw, _), (x, _))) = &trained else {
            return Ok(());
        };
        let (dw, x) = (*dw, *x + (i0 * k) as u64 * size);
        // KN: dweightᵀ (N, K) += doutᵀ (N, r) · inp (r, K);
        // NK: dweightᵀ (K, N) += inpᵀ (K, r) · dout (r, N).
        let x = Mat::new::<X>(x, k, r);
        match layout {
            Layout::KN => {
                blas.product(s, Mat::new::<X>(dw, n, k), dy, x.t(), Accumulate::Yes, None)
            }
            Layout::NK => {
                blas.product(s, Mat::new::<X>(dw, k, n), x, dy.t(), Accumulate::Yes, None)
            }
        }
    };
    let (dy, _dy) = dout.device_ptr(s);
    if G::NAME == X::NAME {
        return rows(0, m, dy);
    }
    // Row blocks that fit the staging buffer, a multiple of 8 rows where possible so each
    // block of inp and dinp starts 16-byte aligned when K allows.
    let fit = (STAGING_BYTES / (n.max(1) * size_of::<X>())).max(1);
    let block = if fit >= 8 { fit / 8 * 8 } else { fit };
    let mut staging = blas.staging.lock().expect("staging lock");
    for i0 in (0..m).step_by(block) {
        let r = block.min(m - i0);
        let len = r * n;
        let src = dout.slice(i0 * n..i0 * n + len);
        // SAFETY: the staging buffer holds STAGING_BYTES ≥ len · size_of::<X>() bytes, and any
        // bit pattern is a valid X (the cast overwrites them all before they are read).
        let mut dst = unsafe { staging.transmute_mut::<X>(len) }.expect("a block fits staging");
        let nl = len as i64;
        let cast = format!("cast_from_f32_{}", X::NAME);
        launch!(dev, "casts.cu", cast, super::device::elementwise(len); &mut dst, &src, &nl);
        let (p, _p) = dst.device_ptr(s);
        rows(i0, r, p)?;
    }
    Ok(())
}

/// The two launches of `dbias +=` over an `(M, N)` dout ([`ColumnSums`]), with at most as many
/// chunks of rows as the staging buffer holds partials for.
pub fn bias_backward_config(m: usize, n: usize) -> ColumnSums {
    let fit = STAGING_BYTES / (size_of::<f32>() * n.max(1));
    ColumnSums::with_max_chunks(m, n, 1, fit.min(ColumnSums::MAX_CHUNKS))
}

/// A column-major matrix as cuBLASLt sees it: `rows × cols`, leading dimension `rows`, used
/// as itself or transposed.
#[derive(Clone, Copy)]
struct Mat {
    ptr: u64,
    dtype: sys::cudaDataType,
    rows: u64,
    cols: u64,
    trans: bool,
}

impl Mat {
    fn new<T: Float>(ptr: u64, rows: usize, cols: usize) -> Self {
        let dtype = match T::NAME {
            "f32" => sys::cudaDataType::CUDA_R_32F,
            "bf16" => sys::cudaDataType::CUDA_R_16BF,
            "f16" => sys::cudaDataType::CUDA_R_16F,
            other => panic!("no cuBLASLt dtype for {other}"),
        };
        Self {
            ptr,
            dtype,
            rows: rows as u64,
            cols: cols as u64,
            trans: false,
        }
    }

    fn t(self) -> Self {
        Self {
            trans: !self.trans,
            ..self
        }
    }

    /// The largest power of two, up to the 256 bytes cuBLASLt assumes by default, that the
    /// address divides: a block of rows may start less aligned than an allocation.
    fn alignment(&self) -> u32 {
        1 << self.ptr.trailing_zeros().min(8)
    }
}

/// Whether a product overwrites its output or adds to it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Accumulate {
    No,
    Yes,
}

impl Blas {
    /// `d = op(a) · op(b) (+ d) (+ bias per row of d)`, queued on `s`.
    fn product(
        &self,
        s: &CudaStream,
        d: Mat,
        a: Mat,
        b: Mat,
        acc: Accumulate,
        bias: Option<u64>,
    ) -> Result<(), Error> {
        let desc = Desc::new()?;
        desc.set(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &(a.trans as i32),
        )?;
        desc.set(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            &(b.trans as i32),
        )?;
        let epilogue = match bias {
            Some(p) => {
                desc.set(
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &p,
                )?;
                sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS
            }
            None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
        };
        desc.set(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &epilogue,
        )?;
        let (la, lb, ld) = (
            MatLayout::new(&a)?,
            MatLayout::new(&b)?,
            MatLayout::new(&d)?,
        );
        let pref = Pref::new()?;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &WORKSPACE_BYTES,
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            &a.alignment(),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            &b.alignment(),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            &d.alignment(),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            &d.alignment(),
        )?;
        s.context().bind_to_thread()?;
        // SAFETY: every descriptor is live; the heuristic is read only when cuBLASLt found one.
        let heuristic = unsafe {
            lt::get_matmul_algo_heuristic(self.handle, desc.0, la.0, lb.0, ld.0, ld.0, pref.0)
        }?;
        let (alpha, beta) = (1.0f32, if acc == Accumulate::Yes { 1.0f32 } else { 0.0 });
        let (ws, _ws) = self.workspace.device_ptr(s);
        // SAFETY: the callers checked every buffer against its shape and hold its guard until
        // this call has queued the product on `s`.
        unsafe {
            lt::matmul(
                self.handle,
                desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a.ptr as *const c_void,
                la.0,
                b.ptr as *const c_void,
                lb.0,
                d.ptr as *const c_void,
                ld.0,
                d.ptr as *mut c_void,
                ld.0,
                &heuristic.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                s.cu_stream() as sys::cudaStream_t,
            )
        }?;
        Ok(())
    }
}

/// A matmul descriptor: f32 compute and scale, whatever the storage dtypes.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Desc {
    fn new() -> Result<Self, CublasError> {
        lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map(Self)
    }

    fn set<T>(&self, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<(), CublasError> {
        // SAFETY: the descriptor is live and `v` is the attribute's C type.
        unsafe {
            lt::set_matmul_desc_attribute(self.0, attr, (v as *const T).cast(), size_of::<T>())
        }
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by create_matmul_desc, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

struct MatLayout(sys::cublasLtMatrixLayout_t);

impl MatLayout {
    fn new(m: &Mat) -> Result<Self, CublasError> {
        lt::create_matrix_layout(m.dtype, m.rows, m.cols, m.rows.max(1) as i64).map(Self)
    }
}

impl Drop for MatLayout {
    fn drop(&mut self) {
        // SAFETY: created by create_matrix_layout, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

struct Pref(sys::cublasLtMatmulPreference_t);

impl Pref {
    fn new() -> Result<Self, CublasError> {
        lt::create_matmul_pref().map(Self)
    }

    fn set<T>(
        &self,
        attr: sys::cublasLtMatmulPreferenceAttributes_t,
        v: &T,
    ) -> Result<(), CublasError> {
        // SAFETY: the preference is live and `v` is the attribute's C type.
        unsafe {
            lt::set_matmul_pref_attribute(self.0, attr, (v as *const T).cast(), size_of::<T>())
        }
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by create_matmul_pref, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// The bf16 GEMM rate of `dev` in GFLOP/s: the median of 5 timings of ten 8192³ products
/// (f32 accumulation, as the trainer's), the MFU denominator of the GPU benchmark.
pub fn measure_peak_gflops(dev: &Gpu) -> Result<f64, Error> {
    const S: usize = 8192;
    const REPS: usize = 10;
    let a: Vec<half::bf16> = (0..S * S)
        .map(|i| half::bf16::from_f32((i % 7) as f32 * 0.25))
        .collect();
    let (a, b) = (dev.upload(&a)?, dev.upload(&a)?);
    let mut c = dev.zeros::<half::bf16>(S * S)?;
    let mut product = || {
        matmul_forward(
            dev,
            &mut c.as_view_mut(),
            &a.as_view(),
            &b.as_view(),
            None::<&CudaView<'_, half::bf16>>,
            Layout::KN,
            (S, S, S),
        )
    };
    product()?; // cuBLASLt picks its algorithm on the first call
    dev.stream().synchronize()?;
    let mut times = Vec::with_capacity(5);
    for _ in 0..5 {
        let t = std::time::Instant::now();
        for _ in 0..REPS {
            product()?;
        }
        dev.stream().synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (S * S * S * REPS) as f64 / times[2] / 1e9)
}
