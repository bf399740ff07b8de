//! The CUDA C++ kernel sources (`kernels/cuda/*.cu`) and their NVRTC compilation.
//!
//! Every program is `common.cuh` followed by one `.cu` file, compiled as one string (NVRTC
//! then needs no include paths). [`compile`] is the one NVRTC call of the back end: the device
//! uses it at start-up and the CI test compiles every program through it.

use std::ffi::{CStr, CString, c_char};

use cudarc::nvrtc::{Ptx, result, sys};

use super::Error;

/// The prelude of every program: storage dtypes, casts, block reductions.
const COMMON: &str = include_str!("../../cuda/common.cuh");

/// One `.cu` file: its kernels are `extern "C"`, named `<kernel>_<dtype>` per storage dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Program {
    /// File name, as NVRTC's log shows it.
    pub name: &'static str,
    pub source: &'static str,
}

macro_rules! program {
    ($file:literal) => {
        Program {
            name: $file,
            source: include_str!(concat!("../../cuda/", $file)),
        }
    };
}

/// Every kernel program of the back end.
pub const PROGRAMS: &[Program] = &[
    program!("adafactor.cu"),
    program!("adam8bit.cu"),
    program!("attention.cu"),
    program!("casts.cu"),
    program!("crossentropy.cu"),
    program!("encoder.cu"),
    program!("gelu.cu"),
    program!("layernorm.cu"),
    program!("matmul.cu"),
    program!("norm.cu"),
    program!("optim.cu"),
    program!("residual.cu"),
];

/// What NVRTC emits: PTX for a virtual architecture (`compute_90`: the driver JIT-compiles it
/// for any later GPU) or a cubin for one real architecture (`sm_90`: no JIT at load time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Ptx { compute: u32 },
    Cubin { sm: u32 },
}

impl Target {
    fn arch(self) -> String {
        match self {
            Target::Ptx { compute } => format!("--gpu-architecture=compute_{compute}"),
            Target::Cubin { sm } => format!("--gpu-architecture=sm_{sm}"),
        }
    }
}

/// A compiled program, as the driver loads it ([`Ptx::from`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Image {
    Ptx(String),
    Cubin(Vec<u8>),
}

impl From<Image> for Ptx {
    fn from(image: Image) -> Ptx {
        match image {
            Image::Ptx(text) => Ptx::from_src(text),
            Image::Cubin(bytes) => Ptx::from_binary(bytes),
        }
    }
}

/// Options of every compilation. FTZ matches the CPU back end's training threads (FTZ/DAZ);
/// `fmad=false` keeps `a·b + c` rounded twice as Rust does, so CUDA and CPU agree more
/// closely (the layer kernels are memory-bound: fusing would buy nothing measurable).
const OPTIONS: &[&str] = &[
    "--std=c++17",
    "--ftz=true",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--fmad=false",
];

/// Whether NVRTC (`libnvrtc.so.13` or another name cudarc tries) can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the candidate names.
    unsafe { sys::is_culib_present() }
}

/// Compile `program` for `target`; NVRTC's log comes
/// back in [`Error::Compile`].
pub fn compile(program: &Program, target: Target) -> Result<Image, Error> {
    if !nvrtc_present() {
        return Err(Error::NoNvrtc);
    }
    compile_source(program.name, &source(program), target)
}

/// The full text NVRTC compiles for `program`, the prelude first; `#line` keeps the log's line
/// numbers those of the `.cu` file.
fn source(program: &Program) -> String {
    format!("{COMMON}\n#line 1 \"{}\"\n{}", program.name, program.source)
}

fn compile_source(name: &str, source: &str, target: Target) -> Result<Image, Error> {
    let src = CString::new(source).map_err(|_| Error::Source(name.into()))?;
    let cname = CString::new(name).map_err(|_| Error::Source(name.into()))?;
    let prog = result::create_program(&src, Some(&cname)).map_err(Error::Nvrtc)?;
    let built = build(prog, name, target);
    // SAFETY: `prog` came from create_program and is destroyed once.
    let destroyed = unsafe { result::destroy_program(prog) }.map_err(Error::Nvrtc);
    let image = built?;
    destroyed?;
    Ok(image)
}

fn build(prog: sys::nvrtcProgram, name: &str, target: Target) -> Result<Image, Error> {
    let mut options: Vec<String> = OPTIONS.iter().map(|o| o.to_string()).collect();
    options.push(target.arch());
    // SAFETY: `prog` is a live program (see compile_source).
    if let Err(e) = unsafe { result::compile_program(prog, &options) } {
        let log = unsafe { result::get_program_log(prog) }.map_err(Error::Nvrtc)?;
        return Err(Error::Compile {
            program: name.into(),
            options: options.join(" "),
            status: e,
            log: text(&log),
        });
    }
    match target {
        Target::Ptx { .. } => {
            let ptx = unsafe { result::get_ptx(prog) }.map_err(Error::Nvrtc)?;
            Ok(Image::Ptx(text(&ptx)))
        }
        Target::Cubin { .. } => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled for a real architecture, so it holds a cubin of `size`
            // bytes, which NVRTC copies into a buffer of that size.
            let cubin = unsafe {
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(Error::Nvrtc)?;
                let mut cubin = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                    .result()
                    .map_err(Error::Nvrtc)?;
                cubin
            };
            Ok(Image::Cubin(cubin))
        }
    }
}

/// NVRTC's NUL-terminated text (log or PTX) as a Rust string.
fn text(raw: &[c_char]) -> String {
    // SAFETY: NVRTC terminates its strings with NUL, and the buffer holds the terminator.
    unsafe { CStr::from_ptr(raw.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}
