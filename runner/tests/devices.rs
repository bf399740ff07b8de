//! One test body for every device this machine has: gpt2-tiny and llama-tiny train 50 steps per
//! dtype on each, the losses follow the CPU run's (fp32 tightly, fp16/bf16 to their precision), and the
//! bytes each rank measured equal the memory model's for that device, category by category; a
//! checkpoint written on one device resumes on each other one.
//! Where a device cannot be opened the test says so and why; `ZEROTRAIN_REQUIRE_GPU=1` turns
//! that into a failure (the GPU check sets it).

use std::fs;
use std::path::Path;

use runner::device::Target;
use runner::train::{Options, Summary, run};
use scheduler::memory::Category;
use scheduler::plan::plan_local_on;
use scheduler::spec::{JobSpec, Purpose};

fn job(dtype: &str, steps: u32) -> JobSpec {
    job_of("gpt2-tiny", dtype, steps)
}

fn job_of(model: &str, dtype: &str, steps: u32) -> JobSpec {
    let json = format!(
        r#"{{"model": {{"preset": "{model}"}}, "precision": {{"dtype": "{dtype}"}},
            "activation_checkpointing": false,
            "training": {{"steps": {steps}, "micro_batch_size": 2, "lr": 1e-3}}}}"#
    );
    JobSpec::parse(&json, Purpose::Train)
        .unwrap_or_else(|e| panic!("{e}: {json}"))
        .spec
}

/// Trains `spec` on `device` by the plan for that kind of device, as `zerotrain train` does.
fn train(device: Target, spec: &JobSpec) -> Result<Summary, runner::Error> {
    train_in(device, spec, None)
}

/// [`train`], writing checkpoints and the export under `out` (resuming from its newest).
fn train_in(device: Target, spec: &JobSpec, out: Option<&Path>) -> Result<Summary, runner::Error> {
    let plan = plan_local_on(spec, None, device.kind()).unwrap();
    let opts = Options {
        device,
        out_dir: out.map(Path::to_path_buf),
        ..Options::default()
    };
    run(spec, &plan, &opts, &mut |_| {})
}

/// The CPU and every GPU that opens.
fn devices() -> Vec<Target> {
    let mut all = vec![Target::Cpu];
    all.extend(gpus());
    all
}

/// The GPUs to compare with the CPU: GPU 0 where one opens; otherwise why not.
fn gpus() -> Vec<Target> {
    let why = match train(Target::Cuda(0), &job("fp32", 1)) {
        Ok(_) => return vec![Target::Cuda(0)],
        Err(e) => e.to_string(),
    };
    if std::env::var_os("ZEROTRAIN_REQUIRE_GPU").is_some_and(|v| v == "1") {
        panic!("ZEROTRAIN_REQUIRE_GPU=1 but cuda:0 cannot be used: {why}");
    }
    eprintln!("cuda:0: did not run: {why}");
    Vec::new()
}

fn assert_measured_is_predicted(device: Target, dtype: &str, s: &Summary) {
    for r in &s.ranks {
        for &c in Category::ALL {
            assert_eq!(
                r.measured_peak_bytes.get(c),
                r.predicted_bytes.get(c),
                "{} on {device}, {dtype}",
                c.name()
            );
        }
    }
}

#[test]
fn every_device_trains_like_the_cpu_within_its_dtype_and_measures_the_model_bytes() {
    let gpus = gpus();
    // Relative loss tolerance per dtype: GEMMs sum in another order on the GPU.
    let dtypes = [("fp32", 1e-4), ("bf16", 2e-2), ("fp16", 5e-3)];
    for (model, (dtype, rtol)) in ["gpt2-tiny", "llama-tiny"]
        .into_iter()
        .flat_map(|m| dtypes.map(|d| (m, d)))
    {
        let spec = job_of(model, dtype, 50);
        let cpu = train(Target::Cpu, &spec).unwrap();
        assert_measured_is_predicted(Target::Cpu, dtype, &cpu);
        assert!(
            cpu.final_loss < cpu.losses[0] - 0.5,
            "{model}, {dtype}: the CPU run learns ({:?})",
            cpu.losses
        );
        for &gpu in &gpus {
            let got = train(gpu, &spec).unwrap_or_else(|e| panic!("{gpu}, {model}, {dtype}: {e}"));
            assert_measured_is_predicted(gpu, dtype, &got);
            for (step, (g, c)) in got.losses.iter().zip(&cpu.losses).enumerate() {
                assert!(
                    (g - c).abs() <= rtol * c.abs(),
                    "{gpu}, {model}, {dtype}, step {step}: loss {g} vs the CPU's {c}"
                );
            }
            assert_eq!(
                got.skipped_steps, cpu.skipped_steps,
                "{gpu}, {model}, {dtype}"
            );
        }
    }
}

#[test]
fn an_fp16_overflow_skips_the_step_and_halves_the_scale_on_every_device() {
    // A first scale of 2^32 overflows fp16 gradients; the scaler backs off until they fit.
    let json = r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp16",
                   "loss_scale": {"semantics": "torch", "init": 4294967296}}, "activation_checkpointing": false,
                   "training": {"steps": 3, "micro_batch_size": 2}}"#;
    let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
    for device in devices() {
        let s = train(device, &spec).unwrap_or_else(|e| panic!("{device}: {e}"));
        assert!(s.skipped_steps >= 1, "{device}: {s:?}");
        // The summary reports the scale the last step carried.
        assert_eq!(
            s.loss_scale,
            2f32.powi(33 - s.skipped_steps as i32),
            "{device}: halved once per skipped step"
        );
    }
}

#[test]
fn a_checkpoint_written_on_one_device_resumes_on_every_device() {
    let json = r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "fp32"},
                   "optimizer": {"type": "adamw"}, "activation_checkpointing": false,
                   "training": {"steps": 10, "micro_batch_size": 2, "lr": 1e-3},
                   "checkpoint": {"every_steps": 4}}"#;
    let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
    let devices = devices();
    for &from in &devices {
        let written = tempfile::tempdir().unwrap();
        let whole = train_in(from, &spec, Some(written.path())).unwrap();
        let step4 = Path::new("checkpoints").join("step-00000004");
        for &to in &devices {
            // Only the step-4 checkpoint of `from`'s run, as if it had stopped there.
            let resumed_dir = tempfile::tempdir().unwrap();
            let (src, dst) = (written.path().join(&step4), resumed_dir.path().join(&step4));
            fs::create_dir_all(&dst).unwrap();
            for f in fs::read_dir(&src).unwrap() {
                let f = f.unwrap();
                fs::copy(f.path(), dst.join(f.file_name())).unwrap();
            }
            fs::write(
                resumed_dir.path().join("checkpoints/latest"),
                "step-00000004",
            )
            .unwrap();
            let resumed = train_in(to, &spec, Some(resumed_dir.path()))
                .unwrap_or_else(|e| panic!("{from} → {to}: {e}"));
            assert_eq!(resumed.resumed_from, Some(4), "{from} → {to}");
            // The steps trained after the resume: the same on one device, to fp32 rounding of
            // the other device's sums across devices.
            let rtol = if from == to { 0.0 } else { 1e-4 };
            for step in 4..10 {
                let (r, w) = (resumed.losses[step], whole.losses[step]);
                assert!(
                    (r - w).abs() <= rtol * w.abs(),
                    "{from} → {to}, step {step}: loss {r} resumed vs {w} uninterrupted"
                );
            }
        }
    }
}

/// The CUDA overhead as the driver sees it: memory in use on GPU 0 before this process opens
/// it (`nvidia-smi`), and after the context, the NVRTC modules and cuBLASLt. Printed for
/// docs/gpu.md and checked against the allowance the memory model plans with.
#[cfg(feature = "cuda")]
#[test]
fn the_driver_measured_cuda_overhead_fits_the_models_allowance() {
    use scheduler::kernel_figures::CUDA_GEMM_RESIDENT_BYTES;
    use scheduler::memory::CUDA_OVERHEAD_BYTES;
    // Read before anything of this process touches the GPU (`gpus` trains a step there), so
    // the baseline holds no context of ours: one left over could only raise the figure.
    let before = std::process::Command::new("nvidia-smi")
        .args([
            "-i",
            "0",
            "--query-gpu=memory.used",
            "--format=csv,noheader,nounits",
        ])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(|mib| mib << 20);
    if gpus().is_empty() {
        return;
    }
    let dev = kernels::cuda::Gpu::new(0).unwrap();
    let m = dev.opening_memory();
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let base = before.unwrap_or(0);
    println!("CUDA overhead on GPU 0 (driver-reported memory in use, MiB; nvidia-smi before):");
    println!("| stage | in use | over before |");
    println!("|---|---:|---:|");
    match before {
        Some(b) => println!("| before the context | {:.0} | 0 |", mib(b)),
        None => println!("| before the context | (nvidia-smi unavailable) | — |"),
    }
    for (stage, used) in [
        ("after the context", m.after_context),
        ("after the NVRTC modules", m.after_modules),
        ("after cuBLASLt (workspace + staging)", m.after_blas),
    ] {
        println!(
            "| {stage} | {:.0} | {:.0} |",
            mib(used as u64),
            mib((used as u64).saturating_sub(base))
        );
    }
    let measured = (m.after_blas as u64).saturating_sub(base);
    println!(
        "measured overhead {:.0} MiB (of which GEMM buffers {:.0} MiB); the model plans {:.0} MiB",
        mib(measured),
        mib(CUDA_GEMM_RESIDENT_BYTES),
        mib(CUDA_OVERHEAD_BYTES)
    );
    assert!(m.after_context <= m.after_modules && m.after_modules <= m.after_blas);
    assert!(
        (m.after_blas - m.after_modules) as u64 >= CUDA_GEMM_RESIDENT_BYTES,
        "cuBLASLt's buffers are at least the GEMM bytes the model counts"
    );
    if before.is_some() {
        assert!(
            measured <= CUDA_OVERHEAD_BYTES,
            "the driver measured {measured} bytes of overhead, over the model's {CUDA_OVERHEAD_BYTES}"
        );
    }
}
