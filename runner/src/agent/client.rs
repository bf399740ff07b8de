//! The agent's side of the HTTP calls: JSON bodies with a bearer token, answers sorted into
//! "the server does not know this node" (register again) and everything else (try again), and
//! the backoff between tries; and an attempt's files, to and from the server's artifact store.

use std::fs::{self, File};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};

use crate::Error;
use crate::checkpoint::Upload;
use wire::agent::{Heartbeat, HeartbeatResponse, RegisterRequest, RegisterResponse};
use wire::artifact::{Artifact, url_segment};
use wire::{JobId, NodeId};

/// Longest pause between two tries before jitter, which adds up to as much again: well inside
/// the server's heartbeat timeout (30 s by default), so a node cut off for a while, or a
/// server restarted, is heard from again before the node is declared lost.
const MAX_DELAY: Duration = Duration::from_secs(2);
const MIN_DELAY: Duration = Duration::from_millis(100);

/// The delays between tries: exponential from 100 ms, doubling, capped at 2 s, with jitter so
/// that nodes cut off together do not all come back in the same instant; tries never run out.
pub fn backoff() -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(MIN_DELAY)
        .with_max_delay(MAX_DELAY)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
}

#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// 410, 401 or 403: the server has declared the node lost or does not know its token.
    #[error("the server no longer knows this node")]
    Gone,
    /// A 4xx that trying again cannot mend (for registration: a wrong join token).
    #[error(transparent)]
    Refused(Error),
    /// The server could not be reached, or failed; trying again may succeed.
    #[error(transparent)]
    Failed(Error),
}

#[derive(Clone)]
pub struct Client {
    http: ureq::Agent,
    server: String,
}

impl Client {
    /// Every call gives up after `timeout` (a long-poll's wait included).
    pub fn new(server: &str, timeout: Duration) -> Client {
        Client {
            http: ureq::Agent::config_builder()
                .timeout_global(Some(timeout))
                .build()
                .into(),
            server: server.to_string(),
        }
    }

    /// Registers, trying again with [`backoff`] until it succeeds, the server refuses the join
    /// token, or `stop` is set (`Ok(None)`).
    pub fn register(
        &self,
        join_token: &str,
        req: &RegisterRequest,
        stop: &AtomicBool,
        mut failed: impl FnMut(&CallError, Duration),
    ) -> Result<Option<RegisterResponse>, Error> {
        let url = format!("{}/v1/agents/register", self.server);
        let mut delays = backoff().build();
        while !stop.load(Ordering::Relaxed) {
            match self.post(&url, join_token, req) {
                Ok(registered) => return Ok(Some(registered)),
                Err(e @ CallError::Failed(_)) => {
                    let delay = delays.next().unwrap_or(MAX_DELAY);
                    failed(&e, delay);
                    sleep_unless(stop, delay);
                }
                Err(CallError::Gone) => {
                    return Err(Error::Server {
                        url,
                        reason: "the join token is not accepted".into(),
                    });
                }
                Err(CallError::Refused(e)) => return Err(e),
            }
        }
        Ok(None)
    }

    /// One heartbeat of node `node`.
    pub fn beat(
        &self,
        node: &NodeId,
        token: &str,
        beat: &Heartbeat,
    ) -> Result<HeartbeatResponse, CallError> {
        let url = format!("{}/v1/agents/{node}/heartbeat", self.server);
        self.post(&url, token, beat)
    }

    fn post<B: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        token: &str,
        body: &B,
    ) -> Result<R, CallError> {
        let fail = |e: ureq::Error| Error::Server {
            url: url.to_string(),
            reason: e.to_string(),
        };
        let response = self
            .http
            .post(url)
            .header("Authorization", &format!("Bearer {token}"))
            .send_json(body);
        match response {
            Ok(mut r) => r
                .body_mut()
                .read_json()
                .map_err(|e| CallError::Failed(fail(e))),
            Err(ureq::Error::StatusCode(401 | 403 | 410)) => Err(CallError::Gone),
            Err(e @ ureq::Error::StatusCode(400..=499))
                if !matches!(e, ureq::Error::StatusCode(408 | 429)) =>
            {
                Err(CallError::Refused(fail(e)))
            }
            Err(e) => Err(CallError::Failed(fail(e))),
        }
    }
}

/// Tries a file transfer gets before the rank fails.
const FILE_TRIES: usize = 4;
const FILE_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest sending a file, waiting for the answer, or receiving a file may take.
const FILE_PHASE_TIMEOUT: Duration = Duration::from_secs(3600);

/// One attempt's files in the server's artifact store, as its node sends and fetches them.
/// Transfers have no overall timeout (a model file takes as long as it takes), only ones for
/// each phase; one that failed for a reason that may pass (the network, a 5xx) is tried again
/// with [`backoff`], one the server refused (a 4xx: the attempt is over, say) is not.
#[derive(Debug, Clone)]
pub struct Files {
    http: ureq::Agent,
    /// `SERVER/v1/agents/NODE/jobs/JOB`.
    base: String,
    token: String,
    attempt: u32,
}

impl Files {
    pub fn new(server: &str, node: &NodeId, token: &str, job_id: &JobId, attempt: u32) -> Files {
        Files {
            http: ureq::Agent::config_builder()
                .timeout_connect(Some(FILE_CONNECT_TIMEOUT))
                .timeout_send_body(Some(FILE_PHASE_TIMEOUT))
                .timeout_recv_response(Some(FILE_PHASE_TIMEOUT))
                .timeout_recv_body(Some(FILE_PHASE_TIMEOUT))
                .build()
                .into(),
            base: format!("{server}/v1/agents/{node}/jobs/{job_id}"),
            token: token.to_string(),
            attempt,
        }
    }

    /// Sends `file` as the artifact `a` of this attempt.
    pub fn put(&self, a: Artifact, file: &Path) -> Result<(), Error> {
        let url = format!(
            "{}/attempts/{}/artifacts/{}",
            self.base,
            self.attempt,
            url_segment(&a.name())
        );
        self.with_tries(&url, || {
            let body = File::open(file).map_err(|e| Failure::Final(e.to_string()))?;
            self.http
                .put(&url)
                .header("Authorization", &format!("Bearer {}", self.token))
                .header("Content-Type", "application/octet-stream")
                .send(body)
                .map(drop)
                .map_err(Failure::from)
        })
    }

    /// Fetches the job's artifact `a` (or one of what it starts from: the server says which)
    /// into `to`.
    pub fn get(&self, a: Artifact, to: &Path) -> Result<(), Error> {
        self.fetch(
            &format!("{}/artifacts/{}", self.base, url_segment(&a.name())),
            to,
        )
    }

    /// Fetches `url` into `to` (written whole, then renamed into place).
    fn fetch(&self, url: &str, to: &Path) -> Result<(), Error> {
        let url = url.to_string();
        let part = to.with_extension("part");
        if let Some(dir) = to.parent() {
            fs::create_dir_all(dir).map_err(|e| Error::Server {
                url: url.clone(),
                reason: format!("creating {}: {e}", dir.display()),
            })?;
        }
        self.with_tries(&url, || {
            let response = self
                .http
                .get(&url)
                .header("Authorization", &format!("Bearer {}", self.token))
                .call()
                .map_err(Failure::from)?;
            let mut out = File::create(&part).map_err(|e| Failure::Final(e.to_string()))?;
            std::io::copy(&mut response.into_body().into_reader(), &mut out)
                .and_then(|_| out.sync_all())
                .and_then(|()| fs::rename(&part, to))
                .map_err(|e| Failure::Passing(format!("writing {}: {e}", to.display())))
        })
    }

    fn with_tries(
        &self,
        url: &str,
        mut call: impl FnMut() -> Result<(), Failure>,
    ) -> Result<(), Error> {
        let mut delays = backoff().build();
        let mut tries = 0;
        loop {
            tries += 1;
            let reason = match call() {
                Ok(()) => return Ok(()),
                Err(Failure::Passing(_)) if tries < FILE_TRIES => {
                    std::thread::sleep(delays.next().unwrap_or(MAX_DELAY));
                    continue;
                }
                Err(Failure::Passing(reason) | Failure::Final(reason)) => reason,
            };
            return Err(Error::Server {
                url: url.to_string(),
                reason: format!("{reason} (after {tries} tries)"),
            });
        }
    }
}

/// Why a transfer failed: for a reason that may pass, or one that trying again cannot mend.
enum Failure {
    Passing(String),
    Final(String),
}

impl From<ureq::Error> for Failure {
    fn from(e: ureq::Error) -> Failure {
        match e {
            ureq::Error::StatusCode(408 | 429 | 500..) => Failure::Passing(e.to_string()),
            ureq::Error::StatusCode(_) => Failure::Final(e.to_string()),
            e => Failure::Passing(e.to_string()),
        }
    }
}

/// The agent's uploads: a file written for the server goes there, and its local copy, which
/// nothing reads again (a resume fetches the committed checkpoint from the server), is removed.
impl Upload for Files {
    fn upload(&self, a: Artifact, file: &Path) -> Result<(), Error> {
        self.put(a, file)?;
        fs::remove_file(file).map_err(|e| Error::Checkpoint {
            path: file.to_path_buf(),
            reason: e.to_string(),
        })
    }
}

/// Sleeps `d`, waking early once `stop` is set.
fn sleep_unless(stop: &AtomicBool, d: Duration) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::Relaxed) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_grows_from_100ms_and_stays_capped_with_jitter() {
        let delays: Vec<Duration> = backoff().build().take(12).collect();
        assert_eq!(delays.len(), 12, "tries never run out");
        assert!(
            delays[0] >= MIN_DELAY && delays[0] < 2 * MIN_DELAY,
            "{delays:?}"
        );
        assert!(delays[3] >= 8 * MIN_DELAY, "doubles: {delays:?}");
        for d in &delays {
            // Jitter adds less than the delay itself to a delay of at most MAX_DELAY.
            assert!(*d < 2 * MAX_DELAY, "{delays:?}");
        }
        assert!(delays[11] >= MAX_DELAY, "reaches the cap: {delays:?}");
        let again: Vec<Duration> = backoff().build().take(12).collect();
        assert_ne!(delays, again, "jittered");
    }
}
