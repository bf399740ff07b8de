//! `zerotrain serve [--port] [--data-dir] [--database-url] …`: the server alone (agents join it
//! with `zerotrain agent`). On first start it creates an admin token and an agent join token.

use anyhow::Context;

use server::Server;
use server::auth::{self, AdminFile};
use server::settings::{S3Options, Settings};

/// The server's settings, shared by `serve` and `up`: each a flag and a `ZEROTRAIN_*` variable.
#[derive(clap::Args)]
// `up` flattens these in among its own arguments: the group needs a name of its own.
#[group(id = "server")]
pub struct Args {
    #[command(flatten)]
    settings: Settings,
}

impl Args {
    /// The settings: defaults ← `ZEROTRAIN_*` ← flags, and the `AWS_*` variables for S3.
    pub(super) fn settings(self) -> Settings {
        Settings {
            s3: S3Options::from_env(),
            ..self.settings
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let settings = args.settings();
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
    let admin = std::env::var("ZEROTRAIN_TOKEN").ok();
    let (server, tokens) = server::build(settings, admin.as_deref()).await?;
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
