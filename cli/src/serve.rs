//! `zerotrain serve [--port] [--data-dir] [--database-url]`: the server alone (agents join it
//! with `zerotrain agent`). On first start it creates an admin token and an agent join token.

use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::Context;

use server::Server;
use server::auth::{self, AdminFile};
use server::settings::{Settings, parse_artifacts, parse_duration, parse_margin};

/// The server's flags, shared by `serve` and `up`.
#[derive(clap::Args)]
// `up` flattens these in among its own arguments: the group needs a name of its own.
#[group(id = "server")]
pub struct Args {
    /// Port to listen on [env: ZEROTRAIN_PORT; default 8080].
    #[arg(long)]
    port: Option<u16>,
    /// Address to listen on [env: ZEROTRAIN_LISTEN; default 127.0.0.1].
    #[arg(long)]
    listen: Option<IpAddr>,
    /// Database, tokens and job outputs [env: ZEROTRAIN_DATA_DIR].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// A directory jobs may read input files from (repeatable) [env: ZEROTRAIN_DATA_ROOTS,
    /// `:`-separated; default DATA_DIR/datasets]. `up`'s local agent reads only there.
    #[arg(long = "data-root", value_name = "DIR")]
    data_roots: Vec<PathBuf>,
    /// sqlite://PATH or postgres://… [env: ZEROTRAIN_DATABASE_URL; default SQLite in the data
    /// directory].
    #[arg(long)]
    database_url: Option<String>,
    /// Where checkpoints and exports are kept: s3://bucket/prefix (configured by the usual
    /// AWS_* variables) or a directory [env: ZEROTRAIN_ARTIFACTS; default DATA_DIR/artifacts].
    #[arg(long, value_parser = parse_artifacts)]
    artifacts: Option<String>,
    /// A node silent this long is lost, e.g. 30s [env: ZEROTRAIN_HEARTBEAT_TIMEOUT].
    #[arg(long, value_parser = parse_duration)]
    heartbeat_timeout: Option<std::time::Duration>,
    /// Fraction of each device placement keeps free [env: ZEROTRAIN_SAFETY_MARGIN; 0.05].
    #[arg(long, value_parser = parse_margin)]
    safety_margin: Option<f64>,
    /// Queue jobs that ask for a device kind no node has registered yet (e.g. `"device":
    /// "cuda"` before the GPU nodes join) instead of refusing them [env:
    /// ZEROTRAIN_QUEUE_UNREGISTERED_DEVICES; default false].
    #[arg(long)]
    queue_unregistered_devices: bool,
}

impl Args {
    /// The settings: defaults ← `ZEROTRAIN_*` ← these flags.
    pub(super) fn settings(self) -> anyhow::Result<Settings> {
        let mut settings = Settings::from_env()?;
        if let Some(port) = self.port {
            settings.port = port;
        }
        if let Some(listen) = self.listen {
            settings.listen = listen;
        }
        if let Some(dir) = self.data_dir {
            settings.data_dir = dir;
        }
        if !self.data_roots.is_empty() {
            settings.data_roots = self.data_roots;
        }
        if let Some(url) = self.database_url {
            settings.database_url = Some(url);
        }
        if let Some(location) = self.artifacts {
            settings.artifacts = Some(location);
        }
        if let Some(timeout) = self.heartbeat_timeout {
            settings.heartbeat_timeout = timeout;
        }
        if let Some(margin) = self.safety_margin {
            settings.safety_margin = margin;
        }
        if self.queue_unregistered_devices {
            settings.queue_unregistered_devices = true;
        }
        Ok(settings)
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let settings = args.settings()?;
    init_tracing();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let (server, _) = start(settings).await?;
        server.run_until(stop_requested()).await?;
        Ok(())
    })
}

/// Completes on Ctrl-C (SIGINT) or SIGTERM (what service managers and `kill` send), so the
/// server finishes its requests and closes the store either way.
pub(super) async fn stop_requested() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler installs");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Builds the server, creates its tokens on first start and says where to find them.
pub(super) async fn start(settings: Settings) -> anyhow::Result<(Server, auth::Bootstrap)> {
    let data_dir = settings.data_dir.clone();
    let server = server::build(settings).await?;
    let admin = std::env::var("ZEROTRAIN_TOKEN").ok();
    let tokens = auth::bootstrap(&server.state().store, &data_dir, admin.as_deref()).await?;
    eprintln!("zerotrain serving at {}", server.url());
    let console = server
        .state()
        .settings
        .public_url
        .as_ref()
        .map_or_else(|| format!("{}/", server.url()), |u| u.to_string());
    eprintln!("console: {console} (log in with a token)");
    let admin_file = data_dir.join("admin-token");
    let recover = format!(
        "recover with `zerotrain token create NAME --bootstrap --data-dir {}` (needs this data \
         directory and the database; writes a new admin token to {})",
        data_dir.display(),
        admin_file.display()
    );
    match &tokens.new_admin_token {
        Some(token) => eprintln!("admin token: {token} (saved to {})", admin_file.display()),
        None => match auth::admin_file(&server.state().store, &data_dir).await? {
            AdminFile::Admin => eprintln!(
                "admin token: in {} (or ZEROTRAIN_TOKEN)",
                admin_file.display()
            ),
            AdminFile::Revoked => eprintln!(
                "admin token: the one in {} was revoked and no longer works; {recover}",
                admin_file.display()
            ),
            AdminFile::Missing => eprintln!(
                "admin token: {} is missing; use another admin token, or {recover}",
                admin_file.display()
            ),
        },
    }
    eprintln!(
        "agents join with: zerotrain agent --server {} --token $(cat {})",
        server.url(),
        data_dir.join("join-token").display()
    );
    Ok((server, tokens))
}

/// Logs to stderr, `RUST_LOG` filtering (default: info).
pub(crate) fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
