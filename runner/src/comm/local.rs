//! Ranks as threads of one process. Each link of the ring is a one-message slot: the sender
//! posts where its bytes are, the receiver copies them out (so nothing is buffered in between)
//! and the sender waits until they have been taken. A rank whose communicator is dropped —
//! it finished, failed or panicked — closes its links, and a neighbour waiting on a closed or
//! silent link fails with an error naming it instead of hanging.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::{Communicator, Transport};
use crate::Error;

/// A posted message: pointers to the sender's parts, valid until the receiver takes them
/// (the sender blocks until then).
struct Posted(Vec<(*const u8, usize)>);

// SAFETY: the pointers are only read by the receiving thread while the sending thread is
// blocked in `exchange`, keeping the borrowed slices alive.
unsafe impl Send for Posted {}

#[derive(Default)]
struct Slot {
    message: Option<Posted>,
    closed: bool,
}

#[derive(Default)]
struct Link {
    slot: Mutex<Slot>,
    changed: Condvar,
}

impl Link {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Local {
    rank: usize,
    world_size: usize,
    /// Link `i` carries messages from rank `i` to rank `i + 1`.
    links: Arc<Vec<Link>>,
    timeout: Duration,
}

/// Communicators for `world_size` ranks running as threads; a rank that waits longer than
/// `timeout` for a neighbour fails.
pub fn local_ring(world_size: usize, timeout: Duration) -> Vec<Communicator> {
    if world_size == 1 {
        return vec![Communicator::solo()];
    }
    let links: Arc<Vec<Link>> = Arc::new((0..world_size).map(|_| Link::default()).collect());
    (0..world_size)
        .map(|rank| {
            let t = Local {
                rank,
                world_size,
                links: links.clone(),
                timeout,
            };
            Communicator::new(rank, world_size, Some(Box::new(t)))
        })
        .collect()
}

impl Local {
    fn prev(&self) -> usize {
        (self.rank + self.world_size - 1) % self.world_size
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world_size
    }

    fn peer_failed(&self, peer: usize, closed: bool) -> Error {
        let reason = if closed {
            "left the job".to_string()
        } else {
            format!("sent nothing for {} s", self.timeout.as_secs_f64())
        };
        Error::Peer {
            rank: self.rank,
            peer,
            reason,
        }
    }

    /// Waits on `link` until `ready` holds; fails if the link closes or nothing happens in time.
    fn wait<'a>(
        &self,
        link: &'a Link,
        peer: usize,
        ready: impl Fn(&Slot) -> bool,
    ) -> Result<MutexGuard<'a, Slot>, Error> {
        let (guard, timeout) = link
            .changed
            .wait_timeout_while(link.lock(), self.timeout, |s| !ready(s) && !s.closed)
            .unwrap_or_else(|p| p.into_inner());
        if ready(&guard) {
            Ok(guard)
        } else {
            Err(self.peer_failed(peer, !timeout.timed_out()))
        }
    }
}

impl Transport for Local {
    fn exchange(&mut self, out: &[&[u8]], inp: &mut [u8]) -> Result<(), Error> {
        let outgoing = &self.links[self.rank];
        {
            let mut slot = self.wait(outgoing, self.next(), |s| s.message.is_none())?;
            slot.message = Some(Posted(out.iter().map(|p| (p.as_ptr(), p.len())).collect()));
            outgoing.changed.notify_all();
        }
        let result = self.receive(inp).and_then(|()| {
            // Keep our bytes alive until the next rank has copied them.
            self.wait(outgoing, self.next(), |s| s.message.is_none())
                .map(drop)
        });
        if result.is_err() {
            // Whatever went wrong, no one may read our bytes after we return. A receiver
            // copies under the lock, so once we hold it the message is either taken or ours.
            outgoing.lock().message = None;
        }
        result
    }
}

impl Local {
    fn receive(&self, inp: &mut [u8]) -> Result<(), Error> {
        let incoming = &self.links[self.prev()];
        let mut slot = self.wait(incoming, self.prev(), |s| s.message.is_some())?;
        let Posted(parts) = slot.message.take().expect("a posted message");
        let mut at = 0;
        for (ptr, len) in parts {
            // SAFETY: see `Posted`; the sender cannot return before this copy is done.
            let part = unsafe { std::slice::from_raw_parts(ptr, len) };
            inp[at..at + len].copy_from_slice(part);
            at += len;
        }
        assert_eq!(at, inp.len(), "ranks disagree on a message's size");
        incoming.changed.notify_all();
        Ok(())
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        for link in [&self.links[self.rank], &self.links[self.prev()]] {
            link.lock().closed = true;
            link.changed.notify_all();
        }
    }
}
