//! Every kernel program compiles with NVRTC, through the back end's own [`compile`], for the
//! architectures the trainer targets. Needs only NVRTC, no GPU: CI installs it and sets
//! `ZEROTRAIN_REQUIRE_NVRTC=1`, which turns a missing NVRTC into a failure; elsewhere the
//! tests say they did not run.
#![cfg(feature = "cuda")]

use std::io::Write;

use kernels::cuda::{Error, Image, PROGRAMS, Program, Target, compile, nvrtc_present};

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

const TARGETS: [Target; 3] = [
    Target::Ptx { compute: 90 },
    Target::Ptx { compute: 80 },
    Target::Cubin { sm: 90 },
];

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
                    let Target::Ptx { compute } = target else {
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
                Ok(Image::Cubin(cubin)) => {
                    assert_eq!(target, Target::Cubin { sm: 90 }, "{}", program.name);
                    assert_eq!(
                        &cubin[..4],
                        b"\x7fELF",
                        "{}: cubin is not ELF",
                        program.name
                    );
                }
                Err(e) => failures.push(format!("{target:?}: {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn programs_cover_every_cuda_source_file() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/cuda");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .expect("kernels/cuda exists")
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
    match compile(&broken, Target::Ptx { compute: 90 }) {
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
