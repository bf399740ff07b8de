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
//! A message is one frame: its length (u64, little-endian) then its bytes, written in place.
//! The frame to the next rank goes out as far as the socket takes it at once — all of it,
//! unless it is large — and the rest on a second thread while the previous rank's frame is
//! read, so a ring of chunks larger than the socket buffers cannot deadlock. Every wait is
//! bounded by the timeout (read and write timeouts on the sockets, deadlines at rendezvous).
//! A failure — a neighbour that closed its connection, a frame of the wrong size, a neighbour
//! silent past the timeout — shuts both of this rank's links down, so it travels around the
//! ring at once instead of as a chain of timeouts, and every later collective repeats it.
//! Dropping the communicator shuts the links down too.

mod rendezvous;

use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::thread;
use std::time::Duration;

use super::{Communicator, Transport};
use crate::Error;

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
        Some(master) => rendezvous::serve(cfg, &master, port)?,
        None => rendezvous::join(cfg, port)?,
    };
    let (next, prev) = rendezvous::link(cfg, &listener, &table)?;
    let (rank, world_size, timeout) = (cfg.rank, cfg.world_size, cfg.timeout);
    let tcp = Tcp {
        rank,
        world_size,
        next,
        prev,
        timeout,
        failed: None,
    };
    Ok(Communicator::new(rank, world_size, Some(Box::new(tcp))))
}

/// A frame's length header, as written before its bytes.
fn header(parts: &[&[u8]]) -> [u8; 8] {
    (parts.iter().map(|p| p.len()).sum::<usize>() as u64).to_le_bytes()
}

/// A frame as slices of its header and parts, written in place (no copy into one buffer).
fn slices<'a>(header: &'a [u8; 8], parts: &[&'a [u8]]) -> Vec<IoSlice<'a>> {
    let all = std::iter::once(&header[..]).chain(parts.iter().copied());
    all.filter(|p| !p.is_empty()).map(IoSlice::new).collect()
}

/// Writes `slices`, advancing past what was written, until none are left or writing fails (on
/// a non-blocking socket, with `WouldBlock` once its buffer is full).
fn write_slices(mut stream: &TcpStream, slices: &mut &mut [IoSlice]) -> io::Result<()> {
    while !slices.is_empty() {
        match stream.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_frame(stream: &TcpStream, parts: &[&[u8]]) -> io::Result<()> {
    let header = header(parts);
    write_slices(stream, &mut &mut slices(&header, parts)[..])
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

    /// Sends `out` as one frame and receives one into `inp`; the first failure, as (peer,
    /// reason), shuts the links down, which also unblocks the other direction.
    fn transfer(&self, out: &[&[u8]], inp: &mut [u8]) -> Result<(), (usize, String)> {
        let n = self.world_size;
        let first = OnceLock::new();
        let fail = |peer: usize, reason: String| {
            if first.set((peer, reason)).is_ok() {
                self.shut_down();
            }
        };
        let sending = |e: io::Error| fail((self.rank + 1) % n, describe(&e, self.timeout, true));
        let mut receive = || {
            if let Err(e) = read_frame(&self.prev, inp) {
                fail((self.rank + n - 1) % n, describe(&e, self.timeout, false));
            }
        };
        let header = header(out);
        let mut slices = slices(&header, out);
        let mut rest = &mut slices[..];
        // What the socket takes at once (a whole frame, unless it is large) needs no second
        // thread; the rest is written on one while the previous rank's frame is read, since
        // it can only go out as the next rank reads.
        let now = (self.next.set_nonblocking(true))
            .and_then(|()| match write_slices(&self.next, &mut rest) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
                done => done,
            })
            .and_then(|()| self.next.set_nonblocking(false));
        match now {
            Err(e) => sending(e),
            Ok(()) if rest.is_empty() => receive(),
            Ok(()) => thread::scope(|s| {
                s.spawn(|| write_slices(&self.next, &mut rest).map_err(sending));
                receive();
            }),
        }
        first.into_inner().map_or(Ok(()), Err)
    }
}

impl Transport for Tcp {
    fn exchange(&mut self, out: &[&[u8]], inp: &mut [u8]) -> Result<(), Error> {
        if self.failed.is_none() {
            self.failed = self.transfer(out, inp).err();
        }
        match &self.failed {
            None => Ok(()),
            Some((peer, reason)) => {
                let (rank, peer, reason) = (self.rank, *peer, reason.clone());
                Err(Error::Peer { rank, peer, reason })
            }
        }
    }
}

impl Drop for Tcp {
    fn drop(&mut self) {
        self.shut_down();
    }
}
