//! The service's one clock: wall time in Unix milliseconds, as the store stamps rows and the
//! scheduler measures silence and wall time. Tests hold it still and move it, so behaviour that
//! depends on time passing is tested without waiting for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The system's clock, or a manual one that stands still until moved. Cloning shares it.
#[derive(Debug, Clone, Default)]
pub struct Clock(Option<Arc<AtomicI64>>);

impl Clock {
    /// The system's wall clock.
    pub fn system() -> Clock {
        Clock(None)
    }

    /// A clock standing at the system's time now, which moves only by [`Clock::advance`].
    pub fn manual() -> Clock {
        Clock(Some(Arc::new(AtomicI64::new(system_ms()))))
    }

    /// Unix milliseconds now.
    pub fn now_ms(&self) -> i64 {
        match &self.0 {
            None => system_ms(),
            Some(ms) => ms.load(Ordering::SeqCst),
        }
    }

    /// Moves a manual clock forward by `by`.
    ///
    /// # Panics
    /// On the system clock, which no one moves.
    pub fn advance(&self, by: Duration) {
        let ms = self.0.as_ref().expect("only a manual clock is moved");
        let by = i64::try_from(by.as_millis()).expect("a duration in i64 milliseconds");
        ms.fetch_add(by, Ordering::SeqCst);
    }
}

fn system_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced() {
        let clock = Clock::manual();
        let shared = clock.clone();
        let at = clock.now_ms();
        assert_eq!(shared.now_ms(), at);
        shared.advance(Duration::from_millis(1500));
        assert_eq!(clock.now_ms(), at + 1500);
    }
}
