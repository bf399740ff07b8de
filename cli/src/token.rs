//! `zerotrain token create NAME --role R | list | revoke NAME`: manage bearer tokens (admin).
//! `zerotrain token create NAME --bootstrap` mints an admin token straight into the store, for
//! an admin locked out of the API: it needs the data dir (and the database), not a token.

use std::path::PathBuf;

use anyhow::{Context, bail};
use reqwest::Method;
use serde::Deserialize;
use serde_json::json;

use crate::client::{Client, Connection};
use server::auth;
use server::routes::tokens::check_name;
use server::settings::Settings;
use server::store::Store;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    action: Action,
    #[command(flatten)]
    conn: Connection,
}

#[derive(clap::Subcommand)]
enum Action {
    /// Create a token and print it (it is shown only this once).
    Create {
        /// Who the token is for; jobs submitted with it are owned by this name.
        name: String,
        /// viewer, submitter, admin or agent_join.
        #[arg(long, default_value = "submitter", conflicts_with = "bootstrap")]
        role: String,
        /// Mint an admin token without the server: write it into the store and to
        /// DATA_DIR/admin-token (recovery when every admin token was revoked).
        #[arg(long)]
        bootstrap: bool,
        /// With --bootstrap: the data directory [env: ZEROTRAIN_DATA_DIR].
        #[arg(long, requires = "bootstrap")]
        data_dir: Option<PathBuf>,
        /// With --bootstrap: the database, if not the data directory's SQLite
        /// [env: ZEROTRAIN_DATABASE_URL].
        #[arg(long, requires = "bootstrap")]
        database_url: Option<String>,
    },
    /// List tokens' names, roles and creation times.
    List,
    /// Revoke the token with this name.
    Revoke { name: String },
}

#[derive(Deserialize)]
struct Token {
    name: String,
    role: String,
    created_at: i64,
    token: Option<String>,
}

#[derive(Deserialize)]
struct TokenList {
    tokens: Vec<Token>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    if let Action::Create {
        name,
        bootstrap: true,
        data_dir,
        database_url,
        ..
    } = &args.action
    {
        return runtime.block_on(bootstrap(name, data_dir.clone(), database_url.clone()));
    }
    let client = Client::new(&args.conn)?;
    runtime.block_on(async {
        match args.action {
            Action::Create { name, role, .. } => {
                let body = json!({"name": name, "role": role});
                let t: Token = client
                    .json(client.request(Method::POST, "/v1/tokens").json(&body))
                    .await?;
                eprintln!(
                    "created {} token {:?}; it is not shown again:",
                    t.role, t.name
                );
                println!("{}", t.token.context("the server sent no token")?);
            }
            Action::List => {
                let list: TokenList = client
                    .json(client.request(Method::GET, "/v1/tokens"))
                    .await?;
                println!("{:<24} {:<10} CREATED (unix ms)", "NAME", "ROLE");
                for t in list.tokens {
                    println!("{:<24} {:<10} {}", t.name, t.role, t.created_at);
                }
            }
            Action::Revoke { name } => {
                let path = format!("/v1/tokens/{name}");
                client.send(client.request(Method::DELETE, &path)).await?;
                println!("revoked {name:?}");
            }
        }
        Ok(())
    })
}

/// `create NAME --bootstrap`: an admin token written into the store directly.
async fn bootstrap(
    name: &str,
    data_dir: Option<PathBuf>,
    database_url: Option<String>,
) -> anyhow::Result<()> {
    check_name(name).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut settings = Settings::from_env()?;
    if let Some(dir) = data_dir {
        settings.data_dir = dir;
    }
    if let Some(url) = database_url {
        settings.database_url = Some(url);
    }
    let url = settings.database_url();
    let store = Store::connect(&url)
        .await
        .with_context(|| format!("opening the store at {url}"))?;
    let minted = auth::mint_admin(&store, &settings.data_dir, name).await;
    store.close().await;
    let Some(token) = minted? else {
        bail!("a token named {name:?} exists; choose another name");
    };
    let file = settings.data_dir.join("admin-token");
    eprintln!(
        "created admin token {name:?} in the store and wrote it to {}; it is not shown again:",
        file.display()
    );
    println!("{token}");
    Ok(())
}
