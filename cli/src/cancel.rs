//! `zerotrain cancel JOB`: cancel a job; its ranks stop at their agents' next heartbeat.

use anyhow::Context;
use reqwest::Method;
use serde::Deserialize;

use crate::client::{Client, Connection, check_id};

#[derive(clap::Args)]
pub struct Args {
    /// The job's id.
    job: String,
    #[command(flatten)]
    conn: Connection,
}

#[derive(Deserialize)]
struct Job {
    id: String,
    state: String,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let id = check_id(&args.job)?;
    let client = Client::new(&args.conn)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let job: Job = runtime
        .block_on(client.json(client.request(Method::POST, &format!("/v1/jobs/{id}/cancel"))))?;
    println!("job {} {}", job.id, job.state);
    Ok(())
}
