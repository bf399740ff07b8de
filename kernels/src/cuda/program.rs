//! The CUDA C++ kernel sources (`kernels/cuda/*.cu`) and their NVRTC compilation.
//!
//! Every program is `common.cuh` followed by one `.cu` file, compiled as one string (NVRTC
//! then needs no include paths). [`compile`] is the one NVRTC call of the back end: the CI test
//! compiles every program through it, and the device reaches it through [`compile_all`], which
//! keeps what it compiled so that a device opens in milliseconds after the first:
//!
//! - in the process, by a hash of the full source, the options, the target and NVRTC's version;
//! - on disk, under the same hash, in `ZEROTRAIN_KERNEL_CACHE` (`off` or empty: no disk cache),
//!   else `$XDG_CACHE_HOME/zerotrain/kernels`, else `~/.cache/zerotrain/kernels`. Files are
//!   written to a temporary name and renamed, so a reader never sees half a file; the cache is
//!   best-effort (a folder that cannot be written, or a file that does not read back as PTX or
//!   an ELF cubin, means compiling again).
//!
//! The programs a device lacks are compiled on one thread each (NVRTC takes concurrent calls on
//! distinct programs).

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

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
    program!("dropout.cu"),
    program!("encoder.cu"),
    program!("gelu.cu"),
    program!("layernorm.cu"),
    program!("matmul.cu"),
    program!("nf4.cu"),
    program!("norm.cu"),
    program!("optim.cu"),
    program!("residual.cu"),
    program!("rope.cu"),
    program!("swiglu.cu"),
];

/// What NVRTC emits: PTX for a virtual architecture (`compute_90`: the driver JIT-compiles it
/// for any later GPU) or a cubin for one real architecture (`sm_90`: no JIT at load time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Ptx { compute: u32 },
    Cubin { sm: u32 },
}

impl Arch {
    /// The NVRTC option that selects it.
    fn option(self) -> String {
        match self {
            Arch::Ptx { compute } => format!("--gpu-architecture=compute_{compute}"),
            Arch::Cubin { sm } => format!("--gpu-architecture=sm_{sm}"),
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
pub fn compile(program: &Program, target: Arch) -> Result<Image, Error> {
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

fn compile_source(name: &str, source: &str, target: Arch) -> Result<Image, Error> {
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

fn build(prog: sys::nvrtcProgram, name: &str, target: Arch) -> Result<Image, Error> {
    let mut options: Vec<String> = OPTIONS.iter().map(|o| o.to_string()).collect();
    options.push(target.option());
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
        Arch::Ptx { .. } => {
            let ptx = unsafe { result::get_ptx(prog) }.map_err(Error::Nvrtc)?;
            Ok(Image::Ptx(text(&ptx)))
        }
        Arch::Cubin { .. } => {
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

/// The disk cache's folder from the environment (module docs); `None`: no disk cache.
fn cache_dir_from_env() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("ZEROTRAIN_KERNEL_CACHE") {
        return (!dir.is_empty() && dir != "off").then(|| PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))?;
    Some(base.join("zerotrain").join("kernels"))
}

/// The disk cache's folder, read from the environment once per process.
pub fn cache_dir() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(cache_dir_from_env).as_deref()
}

/// Every program of [`PROGRAMS`] for `target`, in that order: from this process's cache, else
/// from the disk cache ([`cache_dir`]), else compiled (the misses in parallel) and kept in both.
pub fn compile_all(target: Arch) -> Result<Vec<Image>, Error> {
    compile_all_in(cache_dir(), PROGRAMS, target)
}

/// [`compile_all`] for `programs`, with the disk cache in `dir` (`None`: none).
pub fn compile_all_in(
    dir: Option<&Path>,
    programs: &[Program],
    target: Arch,
) -> Result<Vec<Image>, Error> {
    if !nvrtc_present() {
        return Err(Error::NoNvrtc);
    }
    let keys: Vec<Key> = programs
        .iter()
        .map(|p| Key::new(p, target, nvrtc_version()))
        .collect();
    let mut images: Vec<Option<Image>> = {
        let memory = memory().lock().unwrap_or_else(|e| e.into_inner());
        keys.iter().map(|k| memory.get(&k.hash).cloned()).collect()
    };
    for (image, key) in images.iter_mut().zip(&keys) {
        if image.is_none() {
            *image = dir.and_then(|d| read_entry(&d.join(key.file_name())));
        }
    }
    // The misses, one thread each.
    let compiled: Vec<(usize, Result<Image, Error>)> = std::thread::scope(|s| {
        let handles: Vec<_> = images
            .iter()
            .enumerate()
            .filter(|(_, image)| image.is_none())
            .map(|(i, _)| {
                let program = &programs[i];
                (i, s.spawn(move || compile(program, target)))
            })
            .collect();
        handles
            .into_iter()
            .map(|(i, h)| (i, h.join().expect("an NVRTC compile thread panicked")))
            .collect()
    });
    for (i, result) in compiled {
        let image = result?;
        if let Some(d) = dir {
            write_entry(d, &keys[i].file_name(), &image);
        }
        images[i] = Some(image);
    }
    let mut memory = memory().lock().unwrap_or_else(|e| e.into_inner());
    Ok(images
        .into_iter()
        .zip(&keys)
        .map(|(image, key)| {
            let image = image.expect("every program was found or compiled");
            memory.entry(key.hash).or_insert_with(|| image.clone());
            image
        })
        .collect())
}

/// The disk cache's file for `program` compiled for `target` by this process's NVRTC (it
/// exists once [`compile_all_in`] put it there). `None` without NVRTC.
pub fn cache_file(dir: &Path, program: &Program, target: Arch) -> Option<PathBuf> {
    nvrtc_present().then(|| dir.join(Key::new(program, target, nvrtc_version()).file_name()))
}

/// This process's compiled programs, by [`Key::hash`].
fn memory() -> &'static Mutex<HashMap<u128, Image>> {
    static MEMORY: OnceLock<Mutex<HashMap<u128, Image>>> = OnceLock::new();
    MEMORY.get_or_init(Mutex::default)
}

/// NVRTC's `(major, minor)`, once per process; `(0, 0)` if it cannot say.
fn nvrtc_version() -> (i32, i32) {
    static VERSION: OnceLock<(i32, i32)> = OnceLock::new();
    *VERSION.get_or_init(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers; only called once NVRTC was found present.
        match unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result() {
            Ok(()) => (major, minor),
            Err(_) => (0, 0),
        }
    })
}

/// What a compiled program depends on: the file's name (for people) and a hash of the rest.
struct Key {
    name: &'static str,
    arch: String,
    hash: u128,
}

impl Key {
    fn new(program: &Program, target: Arch, nvrtc: (i32, i32)) -> Self {
        let arch = match target {
            Arch::Ptx { compute } => format!("compute_{compute}"),
            Arch::Cubin { sm } => format!("sm_{sm}"),
        };
        let mut h = Fnv128::default();
        for part in [program.name, &source(program), &OPTIONS.join(" "), &arch] {
            h.write(part.as_bytes());
            h.write(&[0]);
        }
        h.write(&nvrtc.0.to_le_bytes());
        h.write(&nvrtc.1.to_le_bytes());
        Self {
            name: program.name,
            arch,
            hash: h.0,
        }
    }

    fn file_name(&self) -> String {
        let stem = self.name.strip_suffix(".cu").unwrap_or(self.name);
        let ext = if self.arch.starts_with("sm_") {
            "cubin"
        } else {
            "ptx"
        };
        format!("{stem}-{}-{:032x}.{ext}", self.arch, self.hash)
    }
}

/// FNV-1a, 128-bit: stable across processes, builds and Rust releases (std's hashers are not
/// promised to be).
struct Fnv128(u128);

impl Default for Fnv128 {
    fn default() -> Self {
        Self(0x6c62272e07bb014262b821756295c58d)
    }
}

impl Fnv128 {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u128::from(b);
            self.0 = self.0.wrapping_mul(0x0000000001000000000000000000013b);
        }
    }
}

/// A cached file's image, if it reads back as one: `.cubin` an ELF file, `.ptx` UTF-8 PTX.
fn read_entry(path: &Path) -> Option<Image> {
    let bytes = std::fs::read(path).ok()?;
    match path.extension()?.to_str()? {
        "cubin" => bytes.starts_with(b"\x7fELF").then_some(Image::Cubin(bytes)),
        "ptx" => String::from_utf8(bytes)
            .ok()
            .filter(|t| t.contains(".version ") && t.contains(".target "))
            .map(Image::Ptx),
        _ => None,
    }
}

/// Write `image` as `dir/name`, through a temporary file renamed into place; errors are ignored
/// (the cache is best-effort).
fn write_entry(dir: &Path, name: &str, image: &Image) {
    let bytes = match image {
        Image::Ptx(text) => text.as_bytes(),
        Image::Cubin(bytes) => bytes.as_slice(),
    };
    let tmp = dir.join(format!(
        ".{name}.{}.{:?}.tmp",
        std::process::id(),
        std::thread::current().id()
    ));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, bytes))
        .and_then(|()| std::fs::rename(&tmp, dir.join(name)));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "zerotrain-kernel-cache-{tag}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn cache_entries_round_trip_and_refuse_what_is_not_an_image() {
        let dir = temp_dir("entries");
        let cubin = Image::Cubin(b"\x7fELF and the rest".to_vec());
        let ptx = Image::Ptx(".version 9.0\n.target sm_90\n".into());
        write_entry(&dir, "a-sm_90-0.cubin", &cubin);
        write_entry(&dir, "a-compute_90-0.ptx", &ptx);
        assert_eq!(read_entry(&dir.join("a-sm_90-0.cubin")), Some(cubin));
        assert_eq!(read_entry(&dir.join("a-compute_90-0.ptx")), Some(ptx));
        std::fs::write(dir.join("b-sm_90-0.cubin"), b"half a fi").unwrap();
        std::fs::write(dir.join("b-compute_90-0.ptx"), b"\xff\xfe").unwrap();
        assert_eq!(read_entry(&dir.join("b-sm_90-0.cubin")), None);
        assert_eq!(read_entry(&dir.join("b-compute_90-0.ptx")), None);
        assert_eq!(read_entry(&dir.join("missing.cubin")), None);
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn keys_differ_by_source_target_and_nvrtc_version_and_name_their_file() {
        let p = PROGRAMS[0];
        let edited = Program {
            source: "// edited\n",
            ..p
        };
        let sm90 = Arch::Cubin { sm: 90 };
        let key = Key::new(&p, sm90, (13, 0));
        assert_eq!(key.hash, Key::new(&p, sm90, (13, 0)).hash);
        for other in [
            Key::new(&edited, sm90, (13, 0)),
            Key::new(&p, Arch::Cubin { sm: 100 }, (13, 0)),
            Key::new(&p, Arch::Ptx { compute: 90 }, (13, 0)),
            Key::new(&p, sm90, (13, 1)),
        ] {
            assert_ne!(key.hash, other.hash);
        }
        let name = key.file_name();
        assert!(
            name.starts_with("adafactor-sm_90-") && name.ends_with(".cubin"),
            "{name}"
        );
        assert!(
            Key::new(&p, Arch::Ptx { compute: 90 }, (13, 0))
                .file_name()
                .ends_with(".ptx")
        );
    }

    #[test]
    fn fnv128_matches_its_reference_values() {
        // FNV-1a 128 of "" and "a" (the offset basis, and draft-eastlake-fnv's test vector).
        assert_eq!(Fnv128::default().0, 0x6c62272e07bb014262b821756295c58d);
        let mut h = Fnv128::default();
        h.write(b"a");
        assert_eq!(h.0, 0xd228cb696f1a8caf78912b704e4a8964);
    }
}
