//! A live service for end-to-end tests: the real server (`app::build`) on a free port over
//! SQLite in a temporary directory, its tokens bootstrapped, and runner agents on threads of
//! the test process.

#![allow(dead_code)] // each test binary uses its own part of the helpers

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::thread::JoinHandle;
use std::time::Duration;

use scheduler::inventory::Device;
use scheduler::memory::DeviceKind;
use server::app::{self, Server};
use server::auth;
use server::settings::Settings;

pub struct Live {
    pub server: Server,
    /// The agents' join token.
    pub join: String,
    pub dir: tempfile::TempDir,
}

/// A server with `admin` as its admin token; agents heartbeat every 100 ms and are lost after
/// 2 s of silence; the scheduler runs every 100 ms.
pub async fn start(admin: &str) -> Live {
    let dir = tempfile::tempdir().unwrap();
    let settings = Settings {
        port: 0,
        data_dir: dir.path().to_path_buf(),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(2),
        scheduling_interval: Duration::from_millis(100),
        ..Settings::default()
    };
    let server = app::build(settings).await.unwrap();
    let tokens = auth::bootstrap(&server.state().store, dir.path(), Some(admin))
        .await
        .unwrap();
    Live {
        server,
        join: tokens.join_token,
        dir,
    }
}

/// An agent of `devices` CPU devices of `memory` bytes on a thread of this process, until the
/// returned flag is set.
pub fn agent(
    server: &Server,
    join: &str,
    name: &str,
    devices: usize,
    memory: u64,
) -> (Arc<AtomicBool>, JoinHandle<()>) {
    let cfg = runner::agent::AgentConfig {
        server: server.url(),
        join_token: join.to_string(),
        name: name.into(),
        host: "127.0.0.1".into(),
        devices: vec![
            Device {
                kind: DeviceKind::Cpu,
                memory_bytes: memory
            };
            devices
        ],
        threads: None,
        data_roots: server.state().data_roots.clone(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    (
        stop,
        std::thread::spawn(move || {
            runner::agent::run(&cfg, &flag, &runner::agent::AgentMetrics::new()).unwrap()
        }),
    )
}
