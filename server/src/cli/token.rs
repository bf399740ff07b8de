//! `zerotrain token create NAME --role R | list | revoke NAME`: manage bearer tokens (admin).

use anyhow::Context;
use reqwest::Method;
use serde::Deserialize;
use serde_json::json;

use super::client::{Client, Connection};

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
        #[arg(long, default_value = "submitter")]
        role: String,
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
    let client = Client::new(&args.conn)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        match args.action {
            Action::Create { name, role } => {
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
