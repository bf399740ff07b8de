//! `zerotrain jobs [--state S] [--name N] [--limit N]`: jobs, newest first.

use anyhow::Context;
use reqwest::Method;
use serde::Deserialize;

use crate::client::{Client, Connection};

#[derive(clap::Args)]
pub struct Args {
    /// Only jobs in this state (queued, scheduled, running, succeeded, failed, cancelled).
    #[arg(long)]
    state: Option<String>,
    /// Only jobs with this name.
    #[arg(long)]
    name: Option<String>,
    /// At most this many jobs.
    #[arg(long, default_value_t = 20)]
    limit: u32,
    /// Print the jobs as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    conn: Connection,
}

#[derive(Deserialize)]
struct Page {
    jobs: Vec<serde_json::Value>,
    next_cursor: Option<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(&args.conn)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let jobs = runtime.block_on(async {
        let mut jobs = Vec::new();
        let mut cursor: Option<String> = None;
        while jobs.len() < args.limit as usize {
            let mut query: Vec<(&str, String)> = vec![(
                "limit",
                (args.limit as usize - jobs.len()).min(500).to_string(),
            )];
            if let Some(s) = &args.state {
                query.push(("state", s.clone()));
            }
            if let Some(n) = &args.name {
                query.push(("name", n.clone()));
            }
            if let Some(c) = &cursor {
                query.push(("cursor", c.clone()));
            }
            let page: Page = client
                .json(client.request(Method::GET, "/v1/jobs").query(&query))
                .await?;
            jobs.extend(page.jobs);
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        anyhow::Ok(jobs)
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&jobs)?);
        return Ok(());
    }
    println!(
        "{:<36}  {:<20}  {:<9}  {:<14}  {:>5}  {:>7}  REASON",
        "ID", "NAME", "STATE", "MODEL", "RANKS", "ATTEMPT"
    );
    for j in &jobs {
        // The spec as the server normalised it: its model's type and size.
        let model = serde_json::from_value::<scheduler::spec::JobSpec>(j["spec"].clone())
            .map_or_else(|_| "-".to_string(), |s| s.architecture().label());
        println!(
            "{:<36}  {:<20}  {:<9}  {:<14}  {:>5}  {:>7}  {}",
            j["id"].as_str().unwrap_or_default(),
            j["name"].as_str().unwrap_or("-"),
            j["state"].as_str().unwrap_or_default(),
            model,
            j["world_size"].to_string(),
            j["attempt"].to_string(),
            j["reason"].as_str().unwrap_or_default(),
        );
    }
    Ok(())
}
