//! `zerotrain submit [SPEC] [--model-dir DIR] [--wait]`: queue a job; with `--wait`, follow it to the end with a
//! progress bar (state, step, loss, tokens/s).

use anyhow::{Context, bail};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use reqwest::Method;
use serde::Deserialize;

use crate::client::{Client, Connection};
use crate::spec_file::SpecArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    spec: SpecArgs,
    /// Follow the job until it ends; fails unless it succeeds.
    #[arg(long)]
    wait: bool,
    /// Higher runs first.
    #[arg(long, default_value_t = 0)]
    priority: i32,
    /// A retry with the same key returns the first job instead of queueing another.
    #[arg(long)]
    idempotency_key: Option<String>,
    #[command(flatten)]
    conn: Connection,
}

#[derive(Deserialize)]
struct Created {
    id: String,
    state: String,
    plan: PlanSummary,
    spec: serde_json::Value,
}

#[derive(Deserialize)]
struct PlanSummary {
    zero_stage: u8,
    micro_batch_size: u32,
    grad_accum_steps: u32,
    activation_checkpointing: bool,
    per_rank_bytes: Bytes,
}

#[derive(Deserialize)]
struct Bytes {
    total: u64,
}

/// A `state` or `step` event of `/v1/jobs/{id}/events`.
#[derive(Deserialize)]
struct Event {
    state: Option<String>,
    reason: Option<String>,
    step: Option<u32>,
    loss: Option<f64>,
    tokens_per_second: Option<f64>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let spec = args.spec.text()?;
    let client = Client::new(&args.conn)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let mut req = client
            .request(Method::POST, &format!("/v1/jobs?priority={}", args.priority))
            .header("content-type", "application/json")
            .body(spec);
        if let Some(key) = &args.idempotency_key {
            req = req.header("idempotency-key", key);
        }
        let job: Created = client.json(req).await?;
        let p = &job.plan;
        println!(
            "job {} {}: ZeRO stage {}, micro-batch {} × {} accumulation, activation checkpointing {}, {} per rank",
            job.id,
            job.state,
            p.zero_stage,
            p.micro_batch_size,
            p.grad_accum_steps,
            if p.activation_checkpointing { "on" } else { "off" },
            scheduler::bytes::human(p.per_rank_bytes.total),
        );
        if args.wait {
            let steps = job.spec["training"]["steps"].as_u64().unwrap_or(0);
            follow(&client, &job.id, steps).await?;
        }
        Ok(())
    })
}

async fn follow(client: &Client, id: &str, steps: u64) -> anyhow::Result<()> {
    let bar = ProgressBar::new(steps).with_style(
        ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed}]")
            .expect("a valid template"),
    );
    let mut events = Box::pin(client.events(&format!("/v1/jobs/{id}/events")).await?);
    let (mut state, mut reason) = (String::from("queued"), String::new());
    let (mut loss, mut rate) = (None::<f64>, None::<f64>);
    while let Some(event) = events.next().await {
        let event = event?;
        let e: Event = serde_json::from_str(&event.data).context("reading an event")?;
        match event.event.as_str() {
            "state" => {
                state = e.state.unwrap_or(state);
                reason = e.reason.unwrap_or_default();
            }
            "step" => {
                bar.set_position(u64::from(e.step.unwrap_or(0)));
                loss = e.loss.or(loss);
                rate = e.tokens_per_second.or(rate);
            }
            _ => continue,
        }
        let mut msg = state.clone();
        if let Some(l) = loss {
            msg.push_str(&format!("  loss {l:.4}"));
        }
        if let Some(r) = rate {
            msg.push_str(&format!("  {r:.0} tok/s"));
        }
        bar.set_message(msg);
    }
    bar.finish_and_clear();
    match state.as_str() {
        "succeeded" => {
            println!("job {id} succeeded: {reason}");
            Ok(())
        }
        "failed" | "cancelled" => bail!("job {id} {state}: {reason}"),
        other => bail!("the event stream ended with job {id} {other}"),
    }
}
