//! `throttle`: failed authentications per client address. A request bearing a token the server
//! does not know counts against its address; once an address has made `limit` such requests
//! within a minute of its first, every request from it is answered 429 with `Retry-After` until
//! that minute is over. The address is the TCP peer's (behind a proxy, the proxy's). Requests
//! without a peer address (in-process tests calling the router) are not counted.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::{ApiError, AuthFailed};
use crate::state::AppState;

/// The window failures are counted in.
const WINDOW: Duration = Duration::from_secs(60);

/// Addresses tracked before expired windows are swept out.
const SWEEP_ABOVE: usize = 10_000;

/// Failed authentications by address; `limit` 0 counts nothing.
#[derive(Debug)]
pub struct AuthThrottle {
    limit: u32,
    windows: Mutex<HashMap<IpAddr, Window>>,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    /// The first failure of this window.
    start: Instant,
    failures: u32,
}

impl AuthThrottle {
    pub fn new(limit_per_minute: u32) -> AuthThrottle {
        AuthThrottle {
            limit: limit_per_minute,
            windows: Mutex::default(),
        }
    }

    /// How long `addr` must wait before its requests are served again, if it must.
    pub fn retry_after(&self, addr: IpAddr, now: Instant) -> Option<Duration> {
        if self.limit == 0 {
            return None;
        }
        let windows = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        let w = windows.get(&addr)?;
        let ends = w.start + WINDOW;
        (w.failures >= self.limit && now < ends).then(|| ends - now)
    }

    /// Counts a failed authentication from `addr`.
    pub fn failed(&self, addr: IpAddr, now: Instant) {
        if self.limit == 0 {
            return;
        }
        let mut windows = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        if windows.len() > SWEEP_ABOVE {
            windows.retain(|_, w| now < w.start + WINDOW);
        }
        let w = windows.entry(addr).or_insert(Window {
            start: now,
            failures: 0,
        });
        if now >= w.start + WINDOW {
            *w = Window {
                start: now,
                failures: 0,
            };
        }
        w.failures += 1;
    }
}

/// Middleware: refuses an address over the limit, and counts the unknown tokens it brings.
pub async fn throttle_failed_auth(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let Some(peer) = peer else {
        return next.run(request).await;
    };
    if let Some(wait) = state.auth_throttle.retry_after(peer, Instant::now()) {
        let retry_after_s = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        return ApiError::AuthThrottled { retry_after_s }.into_response();
    }
    let response = next.run(request).await;
    if response.extensions().get::<AuthFailed>().is_some() {
        state.auth_throttle.failed(peer, Instant::now());
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_refused_after_the_limit_until_its_minute_is_over() {
        let t = AuthThrottle::new(3);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let start = Instant::now();
        for i in 0..3 {
            assert_eq!(t.retry_after(a, start), None, "failure {i}");
            t.failed(a, start + Duration::from_secs(i));
        }
        let later = start + Duration::from_secs(20);
        assert_eq!(t.retry_after(a, later), Some(Duration::from_secs(40)));
        assert_eq!(
            t.retry_after(b, later),
            None,
            "another address is not affected"
        );
        assert_eq!(t.retry_after(a, start + WINDOW), None);
        t.failed(a, start + WINDOW);
        assert_eq!(t.retry_after(a, start + WINDOW), None, "a new window");
    }

    #[test]
    fn a_limit_of_zero_counts_nothing() {
        let t = AuthThrottle::new(0);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let now = Instant::now();
        for _ in 0..100 {
            t.failed(a, now);
        }
        assert_eq!(t.retry_after(a, now), None);
    }
}
