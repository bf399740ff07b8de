//! `zerotrain estimate [SPEC.json] [--model-dir DIR] [--devices N] [--device-memory 80GiB]
//! [--compare] [--json]`

use scheduler::bytes::{human, parse_size};
use scheduler::compare::{ACCELERATE_VERSION, Comparison, DEEPSPEED_VERSION};
use scheduler::inventory::Inventory;
use scheduler::memory::{Category, DeviceKind};
use scheduler::report::{PlanOutcome, Report};
use scheduler::spec::{JobSpec, Purpose};
use std::fmt::Write as _;
use std::num::NonZeroU32;

use crate::spec_file::SpecArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    spec: SpecArgs,
    /// Data-parallel ranks, one per device [default: the spec's world_size].
    #[arg(long)]
    devices: Option<NonZeroU32>,
    /// Memory of each device, e.g. 80GiB or 40GB.
    #[arg(long, default_value = "80GiB", value_parser = parse_size)]
    device_memory: u64,
    /// Kind of device: `cuda` reserves its runtime overhead, `cpu` a process's [default: the
    /// spec's `device`, else cuda].
    #[arg(long, value_enum)]
    device_kind: Option<Kind>,
    /// Add what DeepSpeed's and accelerate's estimators give for the same model and world size,
    /// and why each differs.
    #[arg(long)]
    compare: bool,
    /// Print the report as JSON (integers are bytes).
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Kind {
    Cpu,
    Cuda,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let text = args.spec.text()?;
    let mut parsed = JobSpec::parse(&text, Purpose::Estimate)?;
    if let Some(n) = args.devices {
        parsed.spec.world_size = n;
        parsed.spec.validate(Purpose::Estimate)?;
    }
    let kind = match args.device_kind {
        Some(Kind::Cpu) => DeviceKind::Cpu,
        Some(Kind::Cuda) => DeviceKind::Cuda,
        None => parsed.spec.device.fixed().unwrap_or(DeviceKind::Cuda),
    };
    let devices = parsed.spec.world_size.get() as usize;
    let inventory = Inventory::uniform(devices, args.device_memory, kind);
    let mut report = Report::new(&parsed.spec, parsed.unsupported_keys, &inventory, kind)?;
    if args.compare {
        report = report.with_comparison(&parsed.spec);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report, args.device_memory));
    }
    Ok(())
}

fn table(r: &Report, device_memory: u64) -> String {
    let mut out = String::new();
    let kind = match r.device_kind {
        DeviceKind::Cpu => "CPU",
        DeviceKind::Cuda => "CUDA",
    };
    let _ = writeln!(
        out,
        "{} parameters on {} {kind} device(s) of {}; micro-batch {} × {} accumulation steps, activation checkpointing {}",
        group_digits(r.parameters),
        r.world_size,
        human(device_memory),
        r.micro_batch_size,
        r.grad_accum_steps,
        if r.activation_checkpointing {
            "on"
        } else {
            "off"
        },
    );
    if let Some(m) = &r.model {
        let _ = writeln!(out, "model: {}", m.line());
    }
    if r.trainable_parameters != r.parameters {
        // PEFT's `print_trainable_parameters` line.
        let _ = writeln!(
            out,
            "trainable params: {} || all params: {} || trainable%: {:.4}",
            group_digits(r.trainable_parameters),
            group_digits(r.parameters),
            100.0 * r.trainable_parameters as f64 / r.parameters as f64,
        );
    }
    let _ = writeln!(out, "\nper rank:");
    let mut header = format!("{:<6}", "stage");
    for &c in Category::ALL {
        let _ = write!(header, "{:>12}", c.name());
    }
    let _ = writeln!(out, "{header}{:>12}{:>14}", "total", "comm/step");
    for row in &r.stages {
        let b = &row.per_rank_bytes;
        let mut line = format!("{:<6}", row.stage);
        for &c in Category::ALL {
            let _ = write!(line, "{:>12}", human(b.get(c)));
        }
        let _ = writeln!(
            line,
            "{:>12}{:>14}",
            human(b.total()),
            human(row.comm_bytes_per_step)
        );
        out.push_str(&line);
    }
    if let Some(s) = &r.step_scratch {
        let _ = writeln!(
            out,
            "of which attention (log-sum-exp per layer, backward scratch) {}, logits {} (loss in chunks of {} rows)",
            human(s.attention_bytes),
            human(s.logits_bytes),
            s.loss_chunk_rows,
        );
    }
    out.push('\n');
    match &r.plan {
        PlanOutcome::Fits { plan, .. } => {
            let c = &plan.chosen;
            let _ = writeln!(
                out,
                "plan: stage {}, activation checkpointing {}, micro-batch {} × {} accumulation steps: {} per rank, {} sent per rank per step",
                c.zero_stage.index(),
                if c.activation_checkpointing {
                    "on"
                } else {
                    "off"
                },
                c.micro_batch_size,
                c.grad_accum_steps,
                human(plan.per_rank_bytes.total()),
                human(plan.comm_bytes_per_step),
            );
        }
        PlanOutcome::DoesNotFit { reason, .. } => {
            let _ = writeln!(out, "plan: does not fit: {reason}");
        }
    }
    if let Some(c) = &r.compare {
        comparison(&mut out, c);
    }
    if !r.unsupported_keys.is_empty() {
        let _ = writeln!(
            out,
            "ignored DeepSpeed keys: {}",
            r.unsupported_keys.join(", ")
        );
    }
    out
}

/// The three estimators side by side, per rank, and why they differ.
fn comparison(out: &mut String, c: &Comparison) {
    let _ = writeln!(
        out,
        "\ncompared with other estimators (per rank, N = {}):",
        c.world_size
    );
    let deepspeed = format!("DeepSpeed {DEEPSPEED_VERSION}");
    let accelerate = format!("accelerate {ACCELERATE_VERSION}");
    let _ = writeln!(
        out,
        "{:<6}{:>12}{:>14}{:>18}{:>18}",
        "stage", "zerotrain", "model states", deepspeed, accelerate
    );
    let cell = |b: Option<u64>| b.map_or("-".to_string(), human);
    for s in &c.stages {
        let _ = writeln!(
            out,
            "{:<6}{:>12}{:>14}{:>18}{:>18}",
            s.stage,
            human(s.zerotrain_bytes),
            human(s.zerotrain_model_states_bytes),
            cell(s.deepspeed_bytes),
            cell(s.accelerate_bytes),
        );
    }
    let _ = writeln!(out, "why they differ:");
    for reason in &c.reasons {
        let _ = writeln!(out, "  - {reason}");
    }
}

/// 124439808 → "124,439,808".
fn group_digits(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}
