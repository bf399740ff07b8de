//! The CUDA kernels on the CPU: every program of `kernels::cuda::PROGRAMS` (`common.cuh` + one
//! `.cu` file, the text NVRTC compiles) built with the system C++ compiler against
//! `kernels/shim/cuda_shim.h` into a shared library, loaded with libloading.
//!
//! Built here, at test time, rather than by a build script: a build.rs would compile the shim
//! (about 10 s of C++) into every build of the crate and of everything that depends on it,
//! tests or not. The library is kept in `CARGO_TARGET_TMPDIR` under a hash of everything that
//! goes into it, so only the first run after a kernel changes pays for the compile.
//!
//! The compiler is `$CXX`, else `c++` (g++ ≥ 11 or clang++ ≥ 16: `std::barrier`, C++20).
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CString, c_char, c_void};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};

use kernels::cuda::{PROGRAMS, Program};

const HEADER: &str = include_str!("../../shim/cuda_shim.h");
const COMMON: &str = include_str!("../../cuda/common.cuh");

/// The shim's own test kernel (not a program of the back end: not in the coverage check).
pub const SELFTEST: Program = Program {
    name: "shim_selftest.cu",
    source: include_str!("selftest.cu"),
};

/// What the library holds: the back end's programs, then the self-test.
fn programs() -> impl Iterator<Item = &'static Program> {
    PROGRAMS.iter().chain(std::iter::once(&SELFTEST))
}

/// Flags: C++20 for std::barrier; no contraction of `a·b + c` into FMAs (NVRTC's
/// `--fmad=false`); IEEE arithmetic (no fast-math), as `--prec-div --prec-sqrt`.
const FLAGS: &[&str] = &[
    "-std=c++20",
    "-O1",
    "-fPIC",
    "-shared",
    "-pthread",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-Wall",
    "-Wno-unused-function",
    "-Wno-unused-variable",
    "-Wno-sign-compare",
];

/// One `extern "C" __global__` function of a program.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Kernel {
    pub program: &'static str,
    pub name: String,
}

type LaunchFn = unsafe extern "C" fn(
    name: *const c_char,
    grid: *const u32,
    block: *const u32,
    args: *const *mut c_void,
    sizes: *const usize,
    nargs: usize,
    err: *mut c_char,
    errlen: usize,
) -> i32;

pub struct Shim {
    _lib: libloading::Library,
    launch: LaunchFn,
    /// Every kernel of every program of `kernels::cuda::PROGRAMS`, from the preprocessed
    /// sources (the self-test's are launchable too, but not listed).
    pub kernels: Vec<Kernel>,
    /// Launches per kernel so far.
    launched: Mutex<BTreeMap<String, usize>>,
}

/// One kernel parameter as cuLaunchKernel takes it: the bytes of the value (a pointer or a
/// scalar), which the launch points at.
pub struct Arg(Vec<u8>);

/// A scalar parameter (`int` = i32, `long` = i64, `float` = f32, ...).
pub fn val<T: Copy>(v: T) -> Arg {
    // SAFETY: reads the bytes of a Copy value.
    let bytes =
        unsafe { std::slice::from_raw_parts((&v as *const T).cast::<u8>(), size_of::<T>()) };
    Arg(bytes.to_vec())
}

/// A buffer the kernel writes (its address).
pub fn out<T>(s: &mut [T]) -> Arg {
    val(s.as_mut_ptr() as usize)
}

/// A buffer the kernel reads.
pub fn inp<T>(s: &[T]) -> Arg {
    val(s.as_ptr() as usize)
}

/// A null pointer (an optional buffer left out).
pub fn null() -> Arg {
    val(0usize)
}

impl Shim {
    /// The shim, built (or found built) and loaded once per test binary.
    pub fn get() -> &'static Shim {
        static SHIM: OnceLock<Shim> = OnceLock::new();
        SHIM.get_or_init(|| Shim::load().unwrap_or_else(|e| panic!("CUDA shim: {e}")))
    }

    fn load() -> Result<Shim, String> {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let version = Command::new(&cxx).arg("--version").output().map_err(|e| {
            format!("cannot run the C++ compiler `{cxx}` ({e}): install g++ or set CXX")
        })?;
        let mut all = Vec::new();
        for p in programs() {
            for name in kernel_names(&cxx, p.name, p.source)? {
                all.push(Kernel {
                    program: p.name,
                    name,
                });
            }
        }
        let source = library_source(&all);
        let kernels = all
            .into_iter()
            .filter(|k| k.program != SELFTEST.name)
            .collect();
        let mut h = DefaultHasher::new();
        (&source, HEADER, FLAGS, &version.stdout).hash(&mut h);
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-shim");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let lib = dir.join(format!("libcuda_shim-{:016x}.so", h.finish()));
        if !lib.exists() {
            build(&cxx, &dir, &source, &lib)?;
        }
        // SAFETY: our own library; its initialisers only set up C++ globals.
        let library = unsafe { libloading::Library::new(&lib) }
            .map_err(|e| format!("{}: {e}", lib.display()))?;
        // SAFETY: the symbol's C signature is LaunchFn (generated by library_source).
        let launch = unsafe { library.get::<LaunchFn>(b"zerotrain_shim_launch\0") }
            .map_err(|e| e.to_string())?;
        Ok(Shim {
            launch: *launch,
            _lib: library,
            kernels,
            launched: Mutex::new(BTreeMap::new()),
        })
    }

    /// Run kernel `name` over `grid` × `block` threads, to completion.
    pub fn launch(&self, name: &str, grid: (u32, u32, u32), block: (u32, u32, u32), args: &[Arg]) {
        self.try_launch(name, grid, block, args)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`Shim::launch`], returning the shim's refusal (bad geometry, wrong parameters).
    pub fn try_launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<(), String> {
        let cname = CString::new(name).unwrap();
        let ptrs: Vec<*mut c_void> = args.iter().map(|a| a.0.as_ptr() as *mut c_void).collect();
        let sizes: Vec<usize> = args.iter().map(|a| a.0.len()).collect();
        let mut err = vec![0u8; 512];
        let (g, b) = ([grid.0, grid.1, grid.2], [block.0, block.1, block.2]);
        // SAFETY: the parameters' count and sizes are checked against the kernel's C++
        // signature by the shim; the buffers they point at outlive the (synchronous) launch.
        let rc = unsafe {
            (self.launch)(
                cname.as_ptr(),
                g.as_ptr(),
                b.as_ptr(),
                ptrs.as_ptr(),
                sizes.as_ptr(),
                args.len(),
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        match rc {
            0 => {
                *self
                    .launched
                    .lock()
                    .unwrap()
                    .entry(name.into())
                    .or_default() += 1;
                Ok(())
            }
            -2 => Err(format!("no kernel named {name} in kernels/cuda")),
            _ => {
                let end = err.iter().position(|&c| c == 0).unwrap_or(err.len());
                Err(String::from_utf8_lossy(&err[..end]).into_owned())
            }
        }
    }

    /// The kernels no test has launched yet.
    pub fn not_launched(&self) -> Vec<&Kernel> {
        let launched = self.launched.lock().unwrap();
        self.kernels
            .iter()
            .filter(|k| !launched.contains_key(&k.name))
            .collect()
    }

    pub fn launches(&self) -> BTreeMap<String, usize> {
        self.launched.lock().unwrap().clone()
    }
}

/// The `extern "C" __global__` functions of one program, in order: its text (`common.cuh` +
/// the `.cu` file) run through the C preprocessor, as NVRTC sees it, then scanned for
/// `__global__ void NAME(`. A `__global__` without `extern "C"` is an error (the device looks
/// kernels up by their unmangled names).
fn kernel_names(cxx: &str, program: &str, source: &str) -> Result<Vec<String>, String> {
    let mut child = Command::new(cxx)
        .args(["-E", "-P", "-x", "c++", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{cxx} -E: {e}"))?;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{COMMON}\n{source}").as_bytes())
        .map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "{cxx} -E {program}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let tokens: Vec<&str> = text
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '"'))
        .filter(|t| !t.is_empty())
        .collect();
    let mut names = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if *t != "__global__" {
            continue;
        }
        let externc = i >= 2 && tokens[i - 2] == "extern" && tokens[i - 1] == "\"C\"";
        let (Some(&"void"), Some(name)) = (tokens.get(i + 1), tokens.get(i + 2)) else {
            return Err(format!("{program}: __global__ not followed by `void NAME`"));
        };
        if !externc {
            return Err(format!("{program}: kernel {name} is not extern \"C\""));
        }
        names.push(name.to_string());
    }
    let unique: BTreeSet<&String> = names.iter().collect();
    if unique.len() != names.len() {
        return Err(format!("{program}: a kernel name appears twice"));
    }
    Ok(names)
}

/// One C++ file: the shim, `common.cuh` once, each program in a namespace of its own (their
/// templates share names) with its macros undefined after it, and `zerotrain_shim_launch`,
/// which finds a kernel by name and launches it (-2: no such kernel).
fn library_source(kernels: &[Kernel]) -> String {
    let mut s = format!("{HEADER}\n#line 1 \"common.cuh\"\n{COMMON}\n");
    for (i, p) in programs().enumerate() {
        s += &format!(
            "namespace program{i} {{\n#line 1 \"{}\"\n{}\n}}\n",
            p.name, p.source
        );
        for line in p.source.lines() {
            if let Some(rest) = line.trim_start().strip_prefix("#define ") {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                s += &format!("#undef {name}\n");
            }
        }
    }
    s += "extern \"C\" int zerotrain_shim_launch(const char *name, const unsigned *grid, \
          const unsigned *block, void **args, const size_t *sizes, size_t nargs, char *err, \
          size_t errlen) {\n";
    for k in kernels {
        let i = programs().position(|p| p.name == k.program).unwrap();
        s += &format!(
            "    if (!strcmp(name, \"{n}\")) return shim::launch_kernel(name, &program{i}::{n}, \
             grid, block, args, sizes, nargs, err, errlen);\n",
            n = k.name
        );
    }
    s += "    return -2;\n}\n";
    s
}

fn build(cxx: &str, dir: &Path, source: &str, lib: &Path) -> Result<(), String> {
    let pid = std::process::id();
    let src = dir.join(format!("cuda_shim-{pid}.cpp"));
    let tmp = dir.join(format!("cuda_shim-{pid}.so"));
    std::fs::write(&src, source).map_err(|e| format!("{}: {e}", src.display()))?;
    let t0 = std::time::Instant::now();
    let out = Command::new(cxx)
        .args(FLAGS)
        .arg(&src)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| format!("{cxx}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cxx} {} failed:\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let warnings = String::from_utf8_lossy(&out.stderr);
    let _ = writeln!(
        std::io::stderr(),
        "cuda shim: compiled {} in {:.1} s{}{warnings}",
        lib.display(),
        t0.elapsed().as_secs_f64(),
        if warnings.is_empty() { "" } else { ":\n" }
    );
    // The temporary name, then a rename: a concurrent run never loads half a library.
    std::fs::rename(&tmp, lib).map_err(|e| format!("{}: {e}", lib.display()))?;
    let _ = std::fs::remove_file(&src);
    Ok(())
}
