//! The `server` package's integration tests as one binary, a module per concern: one link
//! instead of one per file (CI's build time). One module alone:
//! `cargo test -p server --test server MODULE::`.

mod api_helpers;
#[path = "../../tests/pyenv/mod.rs"]
mod pyenv;

mod api_agents;
mod api_auth;
mod api_jobs;
mod api_openapi;
mod api_problems;
mod api_session;
mod api_tokens;
mod console_pages;
mod store;
