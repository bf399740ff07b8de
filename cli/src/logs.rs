//! `zerotrain logs JOB [-f]`: a job's log lines; `-f` follows them until the job ends.

use anyhow::Context;
use futures::StreamExt;
use reqwest::Method;
use serde::Deserialize;

use crate::client::{Client, Connection, check_id};

#[derive(clap::Args)]
pub struct Args {
    /// The job's id.
    job: String,
    /// Keep printing lines as they arrive, until the job ends.
    #[arg(short, long)]
    follow: bool,
    #[command(flatten)]
    conn: Connection,
}

#[derive(Deserialize)]
struct Line {
    line: String,
}

#[derive(Deserialize)]
struct Page {
    lines: Vec<Line>,
    last_seq: i64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let id = check_id(&args.job)?;
    let client = Client::new(&args.conn)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let path = format!("/v1/jobs/{id}/logs");
        if args.follow {
            let mut events = Box::pin(client.events(&format!("{path}?follow=true")).await?);
            while let Some(event) = events.next().await {
                let event = event?;
                if event.event == "log" {
                    let line: Line = serde_json::from_str(&event.data)?;
                    println!("{}", line.line);
                }
            }
            return Ok(());
        }
        let mut after = 0;
        loop {
            let req = client
                .request(Method::GET, &path)
                .query(&[("after", after)]);
            let page: Page = client.json(req).await?;
            if page.lines.is_empty() {
                return Ok(());
            }
            for l in &page.lines {
                println!("{}", l.line);
            }
            after = page.last_seq;
        }
    })
}
