//! The agent's side of the HTTP calls: JSON bodies with a bearer token, answers sorted into
//! "the server does not know this node" (register again) and everything else (try again), and
//! the backoff between tries.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBuilder};

use crate::Error;
use wire::agent::{Heartbeat, HeartbeatResponse, RegisterRequest, RegisterResponse};

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
        node: &str,
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
