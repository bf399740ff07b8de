//! Every kernel program compiles with NVRTC, through the back end's own [`compile`], for the
//! architectures the trainer targets. Needs only NVRTC, no GPU: CI installs it and sets
//! `ZEROTRAIN_REQUIRE_NVRTC=1`, which turns a missing NVRTC into a failure; elsewhere the
//! tests say they did not run. The sources are those `kernels::cuda` embeds, so the binary runs
//! anywhere (scripts/gpu-check runs it from the GPU bundle).
#![cfg(feature = "cuda")]

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use kernels::cuda::{
    Arch, Error, Image, PROGRAMS, Program, cache_file, compile, compile_all_in, nvrtc_present,
};

/// False (after saying why on stderr) when NVRTC is absent and not required.
fn nvrtc_available() -> bool {
    if nvrtc_present() {
        return true;
    }
    assert!(
        std::env::var_os("ZEROTRAIN_REQUIRE_NVRTC").is_none(),
        "ZEROTRAIN_REQUIRE_NVRTC is set but {}",
        Error::NoNvrtc
    );
    let _ = writeln!(
        std::io::stderr(),
        "not run: {} (set ZEROTRAIN_REQUIRE_NVRTC=1 to make this a failure)",
        Error::NoNvrtc
    );
    false
}

/// Compiled one by one through [`compile`]; `sm_90` goes through the device's cached path.
const TARGETS: [Arch; 2] = [Arch::Ptx { compute: 90 }, Arch::Ptx { compute: 80 }];

/// The newest PTX ISA the CUDA 13.0 driver of the H200 machine accepts (NVRTC 13.0 emits it).
const MAX_PTX_VERSION: (u32, u32) = (9, 0);

/// `(major, minor)` of the PTX's `.version` directive.
fn ptx_version(ptx: &str) -> (u32, u32) {
    let v = ptx
        .lines()
        .find_map(|l| l.strip_prefix(".version "))
        .expect("PTX has a .version directive");
    let (major, minor) = v.trim().split_once('.').expect("version is major.minor");
    (major.parse().unwrap(), minor.parse().unwrap())
}

/// A fresh folder under the system's temporary one.
fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zerotrain-nvrtc-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn every_kernel_program_compiles_for_compute_90_compute_80_and_sm_90() {
    if !nvrtc_available() {
        return;
    }
    let mut failures = Vec::new();
    for program in PROGRAMS {
        for target in TARGETS {
            match compile(program, target) {
                Ok(Image::Ptx(ptx)) => {
                    let Arch::Ptx { compute } = target else {
                        panic!("{}: PTX for {target:?}", program.name)
                    };
                    assert!(
                        ptx.contains(&format!(".target sm_{compute}")),
                        "{} for {target:?}: PTX lacks `.target sm_{compute}`",
                        program.name
                    );
                    assert!(
                        ptx_version(&ptx) <= MAX_PTX_VERSION,
                        "{}: PTX {:?} is newer than the H200's CUDA 13.0 driver takes ({:?}): pin NVRTC 13.0",
                        program.name,
                        ptx_version(&ptx),
                        MAX_PTX_VERSION
                    );
                }
                Ok(Image::Cubin(_)) => panic!("{}: a cubin for {target:?}", program.name),
                Err(e) => failures.push(format!("{target:?}: {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));

    // sm_90 as a device compiles it: every program at once, in parallel, kept on disk.
    let sm90 = Arch::Cubin { sm: 90 };
    let dir = temp_dir("sm90");
    let t0 = Instant::now();
    let images = compile_all_in(Some(&dir), PROGRAMS, sm90).unwrap_or_else(|e| panic!("{e}"));
    let compiled = t0.elapsed();
    assert_eq!(images.len(), PROGRAMS.len());
    for (program, image) in PROGRAMS.iter().zip(&images) {
        let Image::Cubin(cubin) = image else {
            panic!("{}: PTX for {sm90:?}", program.name)
        };
        assert_eq!(
            &cubin[..4],
            b"\x7fELF",
            "{}: cubin is not ELF",
            program.name
        );
        let file = cache_file(&dir, program, sm90).unwrap();
        let on_disk = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert_eq!(
            &on_disk,
            cubin,
            "{}: the disk cache holds another image",
            file.display()
        );
    }
    // The second time comes from the process's cache, even with the disk cache gone.
    std::fs::remove_dir_all(&dir).unwrap();
    let t0 = Instant::now();
    assert_eq!(compile_all_in(None, PROGRAMS, sm90).unwrap(), images);
    let _ = writeln!(
        std::io::stderr(),
        "sm_90: {} programs compiled in parallel in {:.2} s, then from the process's cache in {:.2} ms",
        PROGRAMS.len(),
        compiled.as_secs_f64(),
        t0.elapsed().as_secs_f64() * 1e3
    );
}

/// A fact about the source tree, checked where the tree is (CI, any checkout); a binary carried
/// elsewhere (the GPU bundle) says so and passes, as it compiles what it embeds.
#[test]
fn programs_cover_every_cuda_source_file() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/cuda");
    let Ok(entries) = std::fs::read_dir(dir) else {
        let _ = writeln!(
            std::io::stderr(),
            "not run: {dir} is not here (a carried binary); it compiles the {} programs it embeds",
            PROGRAMS.len()
        );
        return;
    };
    let mut files: Vec<String> = entries
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|f| f.ends_with(".cu"))
        .collect();
    files.sort();
    let names: Vec<&str> = PROGRAMS.iter().map(|p| p.name).collect();
    assert_eq!(
        names, files,
        "PROGRAMS must list every kernels/cuda/*.cu, sorted"
    );
}

#[test]
fn a_broken_kernel_is_an_error_carrying_nvrtcs_log() {
    if !nvrtc_available() {
        return;
    }
    let broken = Program {
        name: "broken.cu",
        source: "extern \"C\" __global__ void broken(float *x) { x[0] = undeclared_name; }\n",
    };
    match compile(&broken, Arch::Ptx { compute: 90 }) {
        Err(Error::Compile { program, log, .. }) => {
            assert_eq!(program, "broken.cu");
            assert!(
                log.contains("broken.cu(1)") && log.contains("undeclared_name"),
                "log should point at the error: {log}"
            );
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}
