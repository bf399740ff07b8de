//! Ranks as processes, possibly on different hosts, over TCP.
//!
//! Rendezvous: rank 0 listens at the job's master address. Every rank opens a ring listener of
//! its own on an ephemeral port, joins at the master (retrying, since rank 0 may start later)
//! with its rank, world size and port, and gets back every rank's listener address — the address
//! rank 0 saw its connection come from, unless it bound a specific one. Rank 0 refuses the job,
//! to everyone who joined, if two processes claim one rank or the world sizes disagree. Then each
//! rank connects to the next rank's listener and accepts the previous rank, and both ends of a
//! link check each other's rank.
//!
//! A message is one frame: its length (u64, little-endian) then its bytes. The frame to the next
//! rank is written on a second thread while the previous rank's frame is read, so a ring of
//! chunks larger than the socket buffers cannot deadlock. Every wait is bounded by the timeout.
//! A failure — a neighbour that closed its connection, a frame of the wrong size, a neighbour
//! silent past the timeout — shuts both of this rank's links down, so it travels around the
//! ring at once instead of as a chain of timeouts, and every later collective repeats it.
//! Dropping the communicator shuts the links down too.

use std::collections::BTreeMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{Communicator, Transport};
use crate::Error;

/// Named in every handshake, so that a stray connection is told apart from a rank.
const PROTOCOL: &str = "zerotrain-ring/1";
/// The largest handshake frame read (a rank table takes a few dozen bytes per rank).
const MAX_HANDSHAKE: u64 = 1 << 20;
/// The pause between attempts to reach a listener that is not up yet, or to accept.
const RETRY: Duration = Duration::from_millis(10);

/// How one rank of a TCP job finds the others.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// This rank, in `0..world_size`.
    pub rank: usize,
    pub world_size: usize,
    /// Rank 0's rendezvous address: rank 0 listens there, the others connect to it.
    pub master: SocketAddr,
    /// The longest wait for a peer: to join the rendezvous, to connect, and to send or take
    /// bytes in a collective (so it must exceed the longest computation between collectives).
    pub timeout: Duration,
    /// The address this rank's ring listener binds. `None`: every interface, advertised as the
    /// address rank 0 sees this rank's connection come from.
    pub bind: Option<IpAddr>,
}

impl TcpConfig {
    /// A rank listening on every interface.
    pub fn new(rank: usize, world_size: usize, master: SocketAddr, timeout: Duration) -> TcpConfig {
        TcpConfig {
            rank,
            world_size,
            master,
            timeout,
            bind: None,
        }
    }

    fn secs(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    fn peer(&self, peer: usize, reason: String) -> Error {
        Error::Peer {
            rank: self.rank,
            peer,
            reason,
        }
    }
}

/// This rank's communicator, once every rank has joined: rank 0 listens at `cfg.master`.
pub fn tcp_ring(cfg: &TcpConfig) -> Result<Communicator, Error> {
    if cfg.rank == 0 && cfg.world_size > 1 {
        let master = TcpListener::bind(cfg.master).map_err(|e| Error::Untrainable {
            reason: format!(
                "rank 0 cannot listen at the master address {}: {e}",
                cfg.master
            ),
        })?;
        connect(cfg, Some(master))
    } else {
        connect(cfg, None)
    }
}

/// Rank 0's communicator, with the rendezvous listener already bound (say to port 0, whose
/// address the caller hands the other ranks as their `master`); `cfg.master` is not used.
pub fn tcp_ring_with_master(cfg: &TcpConfig, master: TcpListener) -> Result<Communicator, Error> {
    if cfg.rank != 0 {
        return Err(Error::Untrainable {
            reason: format!(
                "rank {} was given the rendezvous listener, which is rank 0's",
                cfg.rank
            ),
        });
    }
    connect(cfg, Some(master))
}

fn connect(cfg: &TcpConfig, master: Option<TcpListener>) -> Result<Communicator, Error> {
    let untrainable = |reason: String| Error::Untrainable { reason };
    if cfg.rank >= cfg.world_size {
        return Err(untrainable(format!(
            "rank {} is not below world size {}",
            cfg.rank, cfg.world_size
        )));
    }
    if cfg.timeout.is_zero() {
        return Err(untrainable(
            "the collective timeout must be positive".into(),
        ));
    }
    if cfg.world_size == 1 {
        return Ok(Communicator::solo());
    }
    let any = match cfg.master {
        SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let bind = cfg.bind.unwrap_or(any);
    let listener = TcpListener::bind((bind, 0))
        .and_then(|l| Ok((l.local_addr()?.port(), l)))
        .map_err(|e| untrainable(format!("rank {} cannot listen on {bind}: {e}", cfg.rank)));
    let (port, listener) = listener?;
    let table = match master {
        Some(master) => serve_rendezvous(cfg, &master, port)?,
        None => join_rendezvous(cfg, port)?,
    };
    let link = open_links(cfg, &listener, &table)?;
    Ok(Communicator::new(
        cfg.rank,
        cfg.world_size,
        Some(Box::new(link)),
    ))
}

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
fn serve_rendezvous(
    cfg: &TcpConfig,
    master: &TcpListener,
    port: u16,
) -> Result<Vec<SocketAddr>, Error> {
    let n = cfg.world_size;
    let deadline = Instant::now() + cfg.timeout;
    let mut joined: BTreeMap<usize, (TcpStream, SocketAddr)> = BTreeMap::new();
    // Tells everyone who joined why the job cannot start, and returns rank 0's error.
    let refuse =
        |joined: &BTreeMap<_, (TcpStream, _)>, extra: Option<&TcpStream>, peer, reason: String| {
            let answer = Admission::Refused(format!("rank {peer} {reason}"));
            for stream in joined.values().map(|(s, _)| s).chain(extra) {
                let _ = send(stream, &answer);
            }
            cfg.peer(peer, reason)
        };
    master
        .set_nonblocking(true)
        .map_err(|e| Error::Untrainable {
            reason: format!("the rendezvous listener: {e}"),
        })?;
    while joined.len() + 1 < n {
        let (stream, from) = match master.accept() {
            Ok(connection) => connection,
            Err(_) if Instant::now() < deadline => {
                // Nobody yet (or an aborted connection): wait for the others.
                thread::sleep(RETRY);
                continue;
            }
            Err(_) => {
                let missing = (1..n)
                    .find(|r| !joined.contains_key(r))
                    .expect("a missing rank");
                let at = master.local_addr().map_or(cfg.master, |a| a);
                let reason = format!(
                    "did not join the rendezvous at {at} within {} s",
                    cfg.secs()
                );
                return Err(refuse(&joined, None, missing, reason));
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
        let reason = if join.world_size != n {
            Some(format!(
                "joined with world size {} but rank 0 has {n}",
                join.world_size
            ))
        } else if join.rank >= n {
            Some(format!("(from {from}) is not a rank of a {n}-rank job"))
        } else if join.rank == 0 {
            Some(format!(
                "was claimed by two processes (rank 0 itself and one at {from})"
            ))
        } else {
            joined.get(&join.rank).map(|(_, first)| {
                format!("was claimed by two processes (listening at {first} and {addr})")
            })
        };
        if let Some(reason) = reason {
            return Err(refuse(&joined, Some(&stream), join.rank, reason));
        }
        joined.insert(join.rank, (stream, addr));
    }
    let mut table: Vec<SocketAddr> = Some(SocketAddr::new(cfg.master.ip(), port))
        .into_iter()
        .chain(joined.values().map(|(_, addr)| *addr))
        .collect();
    for (&rank, (stream, _)) in &joined {
        // Rank 0 is reachable where this rank reached it.
        let seen = stream.local_addr().map(|a| a.ip());
        table[0] = SocketAddr::new(
            specific(cfg.bind).or(seen.ok()).unwrap_or(cfg.master.ip()),
            port,
        );
        send(stream, &Admission::Ring(table.clone()))
            .map_err(|e| cfg.peer(rank, format!("left the rendezvous before its answer: {e}")))?;
    }
    Ok(table)
}

/// Ranks other than 0: joins at the master and returns the table of ring listeners.
fn join_rendezvous(cfg: &TcpConfig, port: u16) -> Result<Vec<SocketAddr>, Error> {
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

/// Connects to the next rank's listener and accepts the previous rank, checking both.
fn open_links(cfg: &TcpConfig, listener: &TcpListener, table: &[SocketAddr]) -> Result<Tcp, Error> {
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
    Ok(Tcp {
        rank,
        world_size: n,
        next: to_next,
        prev: from_prev,
        timeout: cfg.timeout,
        failed: None,
    })
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

/// Writes one frame, the parts in place (no copy into one buffer).
fn write_frame(mut stream: &TcpStream, parts: &[&[u8]]) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let header = (len as u64).to_le_bytes();
    let mut slices: Vec<IoSlice> = std::iter::once(&header[..])
        .chain(parts.iter().copied())
        .filter(|p| !p.is_empty())
        .map(IoSlice::new)
        .collect();
    let mut slices = &mut slices[..];
    while !slices.is_empty() {
        match stream.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one frame's length.
fn read_len(mut stream: &TcpStream) -> io::Result<u64> {
    let mut len = [0; 8];
    stream.read_exact(&mut len)?;
    Ok(u64::from_le_bytes(len))
}

/// Reads one frame into `inp`, which it must fill exactly.
fn read_frame(mut stream: &TcpStream, inp: &mut [u8]) -> io::Result<()> {
    let len = read_len(stream)?;
    if len != inp.len() as u64 {
        let reason = format!(
            "sent a {len}-byte message where {} bytes were expected (the ranks disagree on a collective)",
            inp.len()
        );
        return Err(io::Error::new(io::ErrorKind::InvalidData, reason));
    }
    stream.read_exact(inp)
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

/// What a failed read from (or write to) a peer says about that peer.
fn describe(e: &io::Error, timeout: Duration, sending: bool) -> String {
    use io::ErrorKind::*;
    let secs = timeout.as_secs_f64();
    match e.kind() {
        WouldBlock | TimedOut if sending => format!("took no bytes for {secs} s"),
        WouldBlock | TimedOut => format!("sent nothing for {secs} s"),
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected => {
            "closed its connection (it exited or failed)".into()
        }
        InvalidData => e.to_string(),
        _ => format!("link failed: {e}"),
    }
}

/// This rank's two links: frames go out to the next rank and come in from the previous one.
struct Tcp {
    rank: usize,
    world_size: usize,
    next: TcpStream,
    prev: TcpStream,
    timeout: Duration,
    /// The first failure (peer, reason): the links are down and every later exchange repeats it.
    failed: Option<(usize, String)>,
}

impl Tcp {
    fn shut_down(&self) {
        let _ = self.next.shutdown(Shutdown::Both);
        let _ = self.prev.shutdown(Shutdown::Both);
    }
}

impl Transport for Tcp {
    fn exchange(&mut self, out: &[&[u8]], inp: &mut [u8]) -> Result<(), Error> {
        if self.failed.is_none() {
            let this = &*self;
            let (next, prev) = (
                (this.rank + 1) % this.world_size,
                (this.rank + this.world_size - 1) % this.world_size,
            );
            let first = OnceLock::new();
            // The first failure wins; shutting the links down unblocks the other direction.
            let fail = |peer: usize, reason: String| {
                if first.set((peer, reason)).is_ok() {
                    this.shut_down();
                }
            };
            thread::scope(|s| {
                s.spawn(|| {
                    if let Err(e) = write_frame(&this.next, out) {
                        fail(next, describe(&e, this.timeout, true));
                    }
                });
                if let Err(e) = read_frame(&this.prev, inp) {
                    fail(prev, describe(&e, this.timeout, false));
                }
            });
            self.failed = first.into_inner();
        }
        match &self.failed {
            None => Ok(()),
            Some((peer, reason)) => Err(Error::Peer {
                rank: self.rank,
                peer: *peer,
                reason: reason.clone(),
            }),
        }
    }
}

impl Drop for Tcp {
    fn drop(&mut self) {
        self.shut_down();
    }
}
