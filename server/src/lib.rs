//! zerotrain's service: the HTTP API, the store, the scheduling loop and the console. The
//! `zerotrain` binary (crate `cli`) runs it; this library does not link the trainer.

pub mod app;
pub mod artifacts;
pub mod auth;
pub mod clock;
pub mod console;
pub mod domain;
pub mod error;
pub mod metrics;
pub mod retention;
pub mod routes;
pub mod scheduling;
pub mod session;
pub mod settings;
pub mod slurm;
pub mod state;
pub mod store;
pub mod throttle;

pub use app::{Server, build, router};
pub use settings::Settings;
pub use state::AppState;
