//! The rendezvous at rank 0 and the handshakes that open the ring's links.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{TcpConfig, describe, read_len, write_frame};
use crate::Error;

/// Named in every handshake, so that a stray connection is told apart from a rank.
const PROTOCOL: &str = "zerotrain-ring/1";
/// The largest handshake frame read (a rank table takes a few dozen bytes per rank).
const MAX_HANDSHAKE: u64 = 1 << 20;
/// The pause between attempts to reach a listener that is not up yet, or to accept.
const RETRY: Duration = Duration::from_millis(10);

/// A rank's request to join, sent to rank 0.
#[derive(Serialize, Deserialize)]
struct Join {
    protocol: String,
    rank: usize,
    world_size: usize,
    /// The ring listener's address if bound to a specific one.
    ip: Option<IpAddr>,
    port: u16,
}

/// Rank 0's answer: every rank's ring listener, or why the job cannot start.
#[derive(Serialize, Deserialize)]
enum Admission {
    Ring(Vec<SocketAddr>),
    Refused(String),
}

/// The first message each way on a ring link.
#[derive(Serialize, Deserialize, PartialEq)]
struct Hello {
    protocol: String,
    rank: usize,
    world_size: usize,
}

/// The address to advertise for a listener bound to `bind`, if it is a specific one.
fn specific(bind: Option<IpAddr>) -> Option<IpAddr> {
    bind.filter(|ip| !ip.is_unspecified())
}

/// Rank 0: collects every other rank's listener address and answers each with the table.
pub(super) fn serve(
    cfg: &TcpConfig,
    master: &TcpListener,
    port: u16,
) -> Result<Vec<SocketAddr>, Error> {
    let n = cfg.world_size;
    let deadline = Instant::now() + cfg.timeout;
    master
        .set_nonblocking(true)
        .map_err(|e| Error::Untrainable {
            reason: format!("the rendezvous listener: {e}"),
        })?;
    let mut joined: BTreeMap<usize, (TcpStream, SocketAddr)> = BTreeMap::new();
    while joined.len() + 1 < n {
        let (stream, from) = match master.accept() {
            Ok(connection) => connection,
            Err(_) if Instant::now() < deadline => {
                // Nobody yet (or an aborted connection): wait for the others.
                thread::sleep(RETRY);
                continue;
            }
            Err(_) => {
                let missing: Vec<usize> = (1..n).filter(|r| !joined.contains_key(r)).collect();
                let at = master.local_addr().unwrap_or(cfg.master);
                let mut reason = format!(
                    "did not join the rendezvous at {at} within {} s",
                    cfg.secs()
                );
                if missing.len() > 1 {
                    reason += &format!(" (nor did ranks {:?})", &missing[1..]);
                }
                refuse(joined.values().map(|(s, _)| s), missing[0], &reason);
                return Err(cfg.peer(missing[0], reason));
            }
        };
        let join = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(cfg.timeout)))
            .and_then(|()| stream.set_write_timeout(Some(cfg.timeout)))
            .and_then(|()| receive::<Join>(&stream));
        let join = match join {
            Ok(join) if join.protocol == PROTOCOL => join,
            _ => continue, // a stray connection, not a rank
        };
        let addr = SocketAddr::new(join.ip.unwrap_or(from.ip()), join.port);
        let first = joined.get(&join.rank).map(|(_, first)| *first);
        if let Some(reason) = objection(&join, n, addr, first) {
            let everyone = joined.values().map(|(s, _)| s).chain([&stream]);
            refuse(everyone, join.rank, &reason);
            return Err(cfg.peer(join.rank, reason));
        }
        joined.insert(join.rank, (stream, addr));
    }
    let mut table = vec![SocketAddr::new(cfg.master.ip(), port)];
    table.extend(joined.values().map(|(_, addr)| *addr));
    for (&rank, (stream, _)) in &joined {
        // Rank 0's listener is reachable where this rank reached rank 0.
        let seen = stream.local_addr().map_or(cfg.master.ip(), |a| a.ip());
        table[0] = SocketAddr::new(specific(cfg.bind).unwrap_or(seen), port);
        send(stream, &Admission::Ring(table.clone()))
            .map_err(|e| cfg.peer(rank, format!("left the rendezvous before its answer: {e}")))?;
    }
    Ok(table)
}

/// Why rank 0 cannot admit `join` (listening at `addr`) to an `n`-rank job, where `first` is
/// the listener of a process that already claimed the same rank.
fn objection(join: &Join, n: usize, addr: SocketAddr, first: Option<SocketAddr>) -> Option<String> {
    if join.world_size != n {
        Some(format!(
            "joined with world size {} but rank 0 has {n}",
            join.world_size
        ))
    } else if join.rank >= n {
        Some(format!(
            "(listening at {addr}) is not a rank of a {n}-rank job"
        ))
    } else if join.rank == 0 {
        Some(format!(
            "was claimed by two processes (rank 0 itself and one listening at {addr})"
        ))
    } else {
        first.map(|first| format!("was claimed by two processes (listening at {first} and {addr})"))
    }
}

/// Tells every process that joined why the job cannot start (rank 0's verdict on `peer`).
fn refuse<'a>(streams: impl Iterator<Item = &'a TcpStream>, peer: usize, reason: &str) {
    let answer = Admission::Refused(format!("rank {peer} {reason}"));
    for stream in streams {
        // Best effort: a process that left already needs no answer.
        let _ = send(stream, &answer);
    }
}

/// Ranks other than 0: joins at the master and returns the table of ring listeners.
pub(super) fn join(cfg: &TcpConfig, port: u16) -> Result<Vec<SocketAddr>, Error> {
    let stream = connect_retrying(cfg.master, Instant::now() + cfg.timeout).map_err(|e| {
        let reason = format!(
            "could not be reached at {} for {} s: {e}",
            cfg.master,
            cfg.secs()
        );
        cfg.peer(0, reason)
    })?;
    // Rank 0 answers once every rank has joined, which takes at most its own timeout.
    stream
        .set_read_timeout(Some(cfg.timeout * 2))
        .and_then(|()| stream.set_write_timeout(Some(cfg.timeout)))
        .map_err(|e| cfg.peer(0, format!("rendezvous connection failed: {e}")))?;
    let join = Join {
        protocol: PROTOCOL.into(),
        rank: cfg.rank,
        world_size: cfg.world_size,
        ip: specific(cfg.bind),
        port,
    };
    send(&stream, &join).map_err(|e| cfg.peer(0, describe(&e, cfg.timeout, true)))?;
    match receive::<Admission>(&stream) {
        Ok(Admission::Ring(table)) if table.len() == cfg.world_size => Ok(table),
        Ok(Admission::Ring(table)) => Err(cfg.peer(
            0,
            format!(
                "sent a table of {} ranks for a {}-rank job",
                table.len(),
                cfg.world_size
            ),
        )),
        Ok(Admission::Refused(reason)) => {
            Err(cfg.peer(0, format!("refused to start the job: {reason}")))
        }
        Err(e) => Err(cfg.peer(0, describe(&e, cfg.timeout * 2, false))),
    }
}

/// Connects to the next rank's listener and accepts the previous rank, checking both: the
/// links to the next rank and from the previous one.
pub(super) fn link(
    cfg: &TcpConfig,
    listener: &TcpListener,
    table: &[SocketAddr],
) -> Result<(TcpStream, TcpStream), Error> {
    let (n, rank) = (cfg.world_size, cfg.rank);
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let deadline = Instant::now() + cfg.timeout;
    let hello = Hello {
        protocol: PROTOCOL.into(),
        rank,
        world_size: n,
    };
    // The next rank's listener is bound before it joined the rendezvous, so this connects even
    // before that rank accepts; its answer is read once this rank has accepted its own link.
    let to_next = connect_retrying(table[next], deadline)
        .and_then(|s| configure(&s, cfg.timeout).map(|()| s))
        .and_then(|s| send(&s, &hello).map(|()| s))
        .map_err(|e| {
            cfg.peer(
                next,
                format!("could not be reached at {}: {e}", table[next]),
            )
        })?;
    let from_prev = accept(cfg, listener, prev, deadline)?;
    send(&from_prev, &hello).map_err(|e| cfg.peer(prev, describe(&e, cfg.timeout, true)))?;
    let answer =
        receive::<Hello>(&to_next).map_err(|e| cfg.peer(next, describe(&e, cfg.timeout, false)))?;
    let expected = Hello {
        rank: next,
        ..hello
    };
    if answer != expected {
        let reason = format!(
            "answered at {} as rank {} of {}",
            table[next], answer.rank, answer.world_size
        );
        return Err(cfg.peer(next, reason));
    }
    Ok((to_next, from_prev))
}

/// Waits for the previous rank's connection, skipping strays.
fn accept(
    cfg: &TcpConfig,
    listener: &TcpListener,
    prev: usize,
    deadline: Instant,
) -> Result<TcpStream, Error> {
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::Untrainable {
            reason: format!("the ring listener: {e}"),
        })?;
    loop {
        let (stream, from) = match listener.accept() {
            Ok(connection) => connection,
            Err(_) if Instant::now() < deadline => {
                thread::sleep(RETRY);
                continue;
            }
            Err(_) => {
                return Err(cfg.peer(prev, format!("did not connect within {} s", cfg.secs())));
            }
        };
        let hello = stream
            .set_nonblocking(false)
            .and_then(|()| configure(&stream, cfg.timeout))
            .and_then(|()| receive::<Hello>(&stream));
        match hello {
            Ok(h) if h.protocol == PROTOCOL && h.rank == prev && h.world_size == cfg.world_size => {
                return Ok(stream);
            }
            Ok(h) if h.protocol == PROTOCOL => {
                let reason = format!(
                    "(of {}, from {from}) connected where rank {prev} of {} should have",
                    h.world_size, cfg.world_size
                );
                return Err(cfg.peer(h.rank, reason));
            }
            _ => {} // a stray connection, not a rank
        }
    }
}

fn connect_retrying(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(RETRY)) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() + RETRY >= deadline => return Err(e),
            Err(_) => thread::sleep(RETRY),
        }
    }
}

fn configure(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))
}

fn send<M: Serialize>(stream: &TcpStream, message: &M) -> io::Result<()> {
    write_frame(
        stream,
        &[&serde_json::to_vec(message).map_err(io::Error::other)?],
    )
}

fn receive<M: DeserializeOwned>(mut stream: &TcpStream) -> io::Result<M> {
    let len = read_len(stream)?;
    if len > MAX_HANDSHAKE {
        let reason = format!("a {len}-byte handshake");
        return Err(io::Error::new(io::ErrorKind::InvalidData, reason));
    }
    let mut body = vec![0; len as usize];
    stream.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}
