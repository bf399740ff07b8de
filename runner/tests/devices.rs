//! One test body for every device this machine has: gpt2-tiny trains a few steps per dtype on
//! each, the losses follow the CPU run's (fp32 tightly, fp16/bf16 to their precision), and the
//! bytes each rank measured equal the memory model's for that device, category by category.
//! Where a device cannot be opened the test says so and why; `ZEROTRAIN_REQUIRE_GPU=1` turns
//! that into a failure (the GPU check sets it).

use runner::device::Target;
use runner::train::{Options, Summary, run};
use scheduler::memory::Category;
use scheduler::plan::plan_local_on;
use scheduler::spec::{JobSpec, Purpose};

fn job(dtype: &str, steps: u32) -> JobSpec {
    let json = format!(
        r#"{{"model": {{"preset": "gpt2-tiny"}}, "precision": {{"dtype": "{dtype}"}},
            "activation_checkpointing": false,
            "training": {{"steps": {steps}, "micro_batch_size": 2, "lr": 1e-3}}}}"#
    );
    JobSpec::parse(&json, Purpose::Train)
        .unwrap_or_else(|e| panic!("{e}: {json}"))
        .spec
}

/// Trains `spec` on `device` by the plan for that kind of device, as `zerotrain train` does.
fn train(device: Target, spec: &JobSpec) -> Result<Summary, runner::Error> {
    let plan = plan_local_on(spec, None, device.kind()).unwrap();
    let opts = Options {
        device,
        threads: Some(1),
        ..Options::default()
    };
    run(spec, &plan, &opts, &mut |_| {})
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
        for c in Category::ALL {
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
    for (dtype, rtol) in [("fp32", 1e-4), ("bf16", 2e-2), ("fp16", 5e-3)] {
        let spec = job(dtype, 20);
        let cpu = train(Target::Cpu, &spec).unwrap();
        assert_measured_is_predicted(Target::Cpu, dtype, &cpu);
        assert!(
            cpu.final_loss < cpu.losses[0] - 0.5,
            "{dtype}: the CPU run learns ({:?})",
            cpu.losses
        );
        for &gpu in &gpus {
            let got = train(gpu, &spec).unwrap_or_else(|e| panic!("{gpu}, {dtype}: {e}"));
            assert_measured_is_predicted(gpu, dtype, &got);
            for (step, (g, c)) in got.losses.iter().zip(&cpu.losses).enumerate() {
                assert!(
                    (g - c).abs() <= rtol * c.abs(),
                    "{gpu}, {dtype}, step {step}: loss {g} vs the CPU's {c}"
                );
            }
            assert_eq!(got.skipped_steps, cpu.skipped_steps, "{gpu}, {dtype}");
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
    let mut devices = vec![Target::Cpu];
    devices.extend(gpus());
    for device in devices {
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

#[cfg(feature = "cuda")]
#[test]
fn the_model_counts_the_gemm_buffers_cuda_allocates() {
    assert_eq!(
        scheduler::memory::CUDA_GEMM_RESIDENT_BYTES,
        kernels::cuda::matmul::resident_bytes() as u64
    );
}
