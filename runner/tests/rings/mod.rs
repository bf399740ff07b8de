//! Rings for the collective tests (`tcp.rs`, `comm.rs`): TCP ranks that meet at a listener the
//! test bound to a free port (so there is no race for the port), and receive buffers.

use std::net::TcpListener;
use std::thread;
use std::time::Duration;

use runner::accounting::Accountant;
use runner::comm::{Communicator, TcpConfig, tcp_ring, tcp_ring_with_master};
use scheduler::memory::Category;

/// `n` TCP ranks on loopback, each built on its own thread as it would be in its own process.
pub fn tcp_ranks(n: usize, timeout: Duration) -> Vec<Communicator> {
    let master = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = master.local_addr().unwrap();
    let mut master = Some(master);
    let ranks: Vec<_> = (0..n)
        .map(|rank| {
            let cfg = TcpConfig::new(rank, n, addr, timeout);
            let master = master.take_if(|_| rank == 0);
            thread::spawn(move || match master {
                Some(master) => tcp_ring_with_master(&cfg, master),
                None => tcp_ring(&cfg),
            })
        })
        .collect();
    ranks
        .into_iter()
        .map(|r| r.join().unwrap().unwrap())
        .collect()
}

/// Gives every communicator a scratch buffer of at least `bytes` (the engine sizes it by the
/// memory model).
pub fn with_scratch(mut comms: Vec<Communicator>, bytes: usize) -> Vec<Communicator> {
    let accountant = Accountant::new(None);
    for comm in &mut comms {
        comm.set_scratch(
            accountant
                .alloc::<u64>(Category::Buffers, bytes.div_ceil(8))
                .unwrap(),
        );
    }
    comms
}
