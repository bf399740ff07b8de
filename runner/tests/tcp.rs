//! The `tcp` back end over real loopback sockets: every rank builds its own communicator on its
//! own thread, as it would in its own process. Collectives must give the same bits as `local`
//! and as a sequential sum in ring order; a rank that exits, stalls or is configured twice must
//! make the others fail promptly with an error naming a neighbour.

use crate::rings;

use std::fmt::Debug;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::thread;
use std::time::{Duration, Instant};

use half::bf16;
use rings::with_scratch;
use runner::Error;
use runner::comm::{
    Communicator, Op, Summable, TcpConfig, local_ring, tcp_ring, tcp_ring_with_master,
};

const TIMEOUT: Duration = Duration::from_secs(2);

fn tcp_ranks(n: usize) -> Vec<Communicator> {
    rings::tcp_ranks(n, TIMEOUT)
}

/// Runs `f` on every rank at once, each on its own thread.
fn on_every_rank<R: Send>(
    comms: &mut [Communicator],
    f: impl Fn(&mut Communicator) -> R + Sync,
) -> Vec<R> {
    thread::scope(|s| {
        let f = &f;
        let ranks: Vec<_> = comms.iter_mut().map(|c| s.spawn(move || f(c))).collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

/// An element type with deterministic test values and a sum written out independently of the
/// code under test.
trait Elem: Summable + PartialEq + Debug {
    fn value(seed: u64) -> Self;
    fn plus(a: Self, b: Self) -> Self;
}

/// A well-mixed 64-bit hash (splitmix64).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Nonzero values spread over 2^-12..2^12, so the order of a sum shows in its low bits.
fn spread(seed: u64) -> f64 {
    let h = mix(seed);
    let mantissa = 1.0 + (h >> 11) as f64 / (1u64 << 53) as f64;
    let sign = if h & 1 == 0 { 1.0 } else { -1.0 };
    sign * mantissa * 2f64.powi(((h >> 1) % 25) as i32 - 12)
}

impl Elem for f32 {
    fn value(seed: u64) -> Self {
        spread(seed) as f32
    }
    fn plus(a: Self, b: Self) -> Self {
        a + b
    }
}

impl Elem for f64 {
    fn value(seed: u64) -> Self {
        spread(seed)
    }
    fn plus(a: Self, b: Self) -> Self {
        a + b
    }
}

impl Elem for bf16 {
    fn value(seed: u64) -> Self {
        bf16::from_f64(spread(seed))
    }
    fn plus(a: Self, b: Self) -> Self {
        bf16::from_f32(a.to_f32() + b.to_f32())
    }
}

impl Elem for u8 {
    fn value(seed: u64) -> Self {
        mix(seed) as u8
    }
    fn plus(a: Self, b: Self) -> Self {
        a.wrapping_add(b)
    }
}

#[derive(Clone, Copy, Debug)]
enum Collective {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast { root: usize },
}

impl Collective {
    fn op(self) -> Op {
        match self {
            Collective::AllReduce => Op::AllReduce,
            Collective::ReduceScatter => Op::ReduceScatter,
            Collective::AllGather => Op::AllGather,
            Collective::Broadcast { .. } => Op::Broadcast,
        }
    }

    /// Ring passes over the buffer: a reduce-scatter and an all-gather each make one.
    fn passes(self) -> u64 {
        match self {
            Collective::ReduceScatter | Collective::AllGather => 1,
            Collective::AllReduce | Collective::Broadcast { .. } => 2,
        }
    }

    fn run<T: Summable>(self, comm: &mut Communicator, buf: &mut [T]) -> Result<(), Error> {
        match self {
            Collective::AllReduce => comm.all_reduce(buf),
            Collective::ReduceScatter => comm.reduce_scatter(buf),
            Collective::AllGather => comm.all_gather(buf),
            Collective::Broadcast { root } => comm.broadcast(buf, root),
        }
    }
}

/// Every rank's buffer after `collective`, and the bytes each rank sent for it.
fn run<T: Elem>(
    comms: &mut [Communicator],
    inputs: &[Vec<T>],
    collective: Collective,
) -> Vec<(Vec<T>, u64)> {
    on_every_rank(comms, |comm| {
        let op = collective.op();
        let before = comm.sent_bytes().get(&op).copied().unwrap_or(0);
        let mut buf = inputs[comm.rank()].clone();
        collective.run(comm, &mut buf).unwrap();
        (buf, comm.sent_bytes()[&op] - before)
    })
}

/// What rank `rank` holds after a ring reduce-scatter: chunk `c` summed, in ring order, over
/// the ranks c+1, c+2, …, `rank` (all N of them at the chunk's owner, rank c).
fn reduce_scattered<T: Elem>(inputs: &[Vec<T>], rank: usize) -> Vec<T> {
    let (n, len) = (inputs.len(), inputs[0].len());
    let s = len.div_ceil(n);
    (0..len)
        .map(|i| {
            let c = i / s;
            let terms = (rank + n - c - 1) % n + 1;
            (2..=terms)
                .map(|j| inputs[(c + j) % n][i])
                .fold(inputs[(c + 1) % n][i], T::plus)
        })
        .collect()
}

/// The sequential reference for every rank after `collective`.
fn expected<T: Elem>(inputs: &[Vec<T>], collective: Collective, rank: usize) -> Vec<T> {
    let (n, len) = (inputs.len(), inputs[0].len());
    let s = len.div_ceil(n);
    match collective {
        Collective::ReduceScatter => reduce_scattered(inputs, rank),
        Collective::AllReduce => {
            let owners: Vec<Vec<T>> = (0..n).map(|r| reduce_scattered(inputs, r)).collect();
            (0..len).map(|i| owners[i / s][i]).collect()
        }
        Collective::AllGather => (0..len).map(|i| inputs[i / s][i]).collect(),
        Collective::Broadcast { root } => inputs[root].clone(),
    }
}

fn collectives_match_local_and_ring_order_sum<T: Elem>() {
    for n in [2, 3, 4] {
        let lens = [1, n - 1, n + 1, 2 * n + 1, 7, 1001, 4099];
        let scratch = 4099usize.div_ceil(n) * size_of::<T>();
        let mut tcp = with_scratch(tcp_ranks(n), scratch);
        let mut local = with_scratch(local_ring(n, TIMEOUT), scratch);
        for len in lens.into_iter().filter(|&len| len > 0) {
            let inputs: Vec<Vec<T>> = (0..n)
                .map(|r| {
                    (0..len)
                        .map(|i| T::value(((len * 8 + r) * 10_000 + i) as u64))
                        .collect()
                })
                .collect();
            let wire = (len.div_ceil(n) * size_of::<T>()) as u64;
            let collectives = [
                Collective::AllReduce,
                Collective::ReduceScatter,
                Collective::AllGather,
                Collective::Broadcast { root: len % n },
            ];
            for collective in collectives {
                let over_tcp = run(&mut tcp, &inputs, collective);
                let over_local = run(&mut local, &inputs, collective);
                for (rank, ((got, sent), (want_local, _))) in
                    over_tcp.iter().zip(&over_local).enumerate()
                {
                    let what = format!("{collective:?}, n {n}, len {len}, rank {rank}");
                    let bits: &[u8] = bytemuck::cast_slice(got);
                    assert_eq!(
                        bits,
                        bytemuck::cast_slice::<T, u8>(want_local),
                        "tcp vs local: {what}"
                    );
                    assert_eq!(
                        got,
                        &expected(&inputs, collective, rank),
                        "tcp vs sequential: {what}"
                    );
                    assert_eq!(
                        *sent,
                        collective.passes() * (n as u64 - 1) * wire,
                        "bytes sent: {what}"
                    );
                }
            }
        }
        let sent = on_every_rank(&mut tcp, |comm| {
            comm.barrier().unwrap();
            comm.sent_bytes()[&Op::Barrier]
        });
        assert_eq!(
            sent,
            vec![n as u64 - 1; n],
            "a barrier gathers one byte per rank"
        );
    }
}

#[test]
fn f32_collectives_over_tcp_match_local_and_a_ring_order_sum() {
    collectives_match_local_and_ring_order_sum::<f32>();
}

#[test]
fn bf16_collectives_over_tcp_match_local_and_a_ring_order_sum() {
    collectives_match_local_and_ring_order_sum::<bf16>();
}

#[test]
fn f64_collectives_over_tcp_match_local_and_a_ring_order_sum() {
    collectives_match_local_and_ring_order_sum::<f64>();
}

#[test]
fn u8_collectives_over_tcp_match_local_and_a_ring_order_sum() {
    collectives_match_local_and_ring_order_sum::<u8>();
}

#[test]
fn chunks_larger_than_socket_buffers_do_not_deadlock() {
    let (n, len): (usize, usize) = (3, 3 << 20); // 4 MiB chunks of f32
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| (0..len).map(|i| f32::value((r * len + i) as u64)).collect())
        .collect();
    let scratch = len.div_ceil(n) * 4;
    let mut tcp = with_scratch(tcp_ranks(n), scratch);
    let mut local = with_scratch(local_ring(n, TIMEOUT), scratch);
    let start = Instant::now();
    let over_tcp = run(&mut tcp, &inputs, Collective::AllReduce);
    eprintln!(
        "all-reduce of {} MiB over 3 tcp ranks: {:?}",
        (len * 4) >> 20,
        start.elapsed()
    );
    let over_local = run(&mut local, &inputs, Collective::AllReduce);
    for ((got, _), (want, _)) in over_tcp.iter().zip(&over_local) {
        assert!(
            got.iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }
}

#[test]
fn rank_zero_may_start_after_the_others_and_a_rank_may_bind_one_address() {
    // Rank 0 binds the master address itself here, so the port is found first and freed.
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let n = 3;
    let ranks: Vec<_> = (0..n)
        .rev()
        .map(|rank| {
            if rank == 0 {
                // The behaviour under test: rank 0 comes up after the others have started
                // dialling its address.
                thread::sleep(Duration::from_millis(300));
            }
            let mut cfg = TcpConfig::new(rank, n, addr, TIMEOUT);
            if rank == 2 {
                // Advertised as bound, not as rank 0 sees it.
                cfg.bind = Some(Ipv4Addr::LOCALHOST.into());
            }
            thread::spawn(move || tcp_ring(&cfg))
        })
        .collect();
    let comms: Vec<Communicator> = ranks
        .into_iter()
        .rev()
        .map(|r| r.join().unwrap().unwrap())
        .collect();
    assert_eq!(
        comms.iter().map(|c| c.rank()).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    let mut comms = with_scratch(comms, 8);
    let sums = on_every_rank(&mut comms, |comm| {
        let mut buf = [comm.rank() as f32 + 1.0];
        comm.all_reduce(&mut buf).map(|()| buf[0])
    });
    assert!(sums.into_iter().all(|s| s.unwrap() == 6.0));
}

/// The peer an error names, checking it is one of `rank`'s ring neighbours.
fn neighbour_named(result: Result<(), Error>, rank: usize, n: usize) -> (usize, String) {
    match result {
        Err(Error::Peer {
            rank: r,
            peer,
            reason,
        }) => {
            assert_eq!(r, rank);
            assert!(
                peer == (rank + 1) % n || peer == (rank + n - 1) % n,
                "rank {rank} names {peer}"
            );
            (peer, reason)
        }
        other => panic!("rank {rank}: expected a peer error, got {other:?}"),
    }
}

#[test]
fn a_rank_that_exits_mid_all_reduce_fails_every_other_rank_at_once() {
    let (n, len, quitter) = (4, 1 << 20, 2);
    let mut comms = with_scratch(tcp_ranks(n), len / n * 4);
    let results = on_every_rank(&mut comms, |comm| {
        let mut buf = vec![1.0f32; len];
        comm.all_reduce(&mut buf).unwrap();
        if comm.rank() == quitter {
            // Take part in the first half of the next all-reduce, then exit as a killed rank
            // would: its links close in the middle of the others' all-gather.
            comm.reduce_scatter(&mut buf).unwrap();
            let taken = std::mem::replace(comm, Communicator::solo());
            drop(taken);
            return None;
        }
        let start = Instant::now();
        let result = comm.all_reduce(&mut buf);
        Some((result, start.elapsed()))
    });
    for (rank, result) in results.into_iter().enumerate() {
        let Some((result, elapsed)) = result else {
            continue;
        };
        let (peer, reason) = neighbour_named(result, rank, n);
        eprintln!("rank {rank} failed after {elapsed:?}: peer {peer} {reason}");
        assert!(elapsed < TIMEOUT, "rank {rank} took {elapsed:?} to notice");
    }
}

#[test]
fn a_rank_that_stalls_past_the_timeout_fails_every_other_rank() {
    let (n, staller) = (3, 1);
    let mut comms = with_scratch(tcp_ranks(n), 4096);
    let results = on_every_rank(&mut comms, |comm| {
        let mut buf = vec![1.0f32; 1000];
        comm.all_reduce(&mut buf).unwrap();
        if comm.rank() == staller {
            // The behaviour under test: a rank silent past the others' timeout.
            thread::sleep(TIMEOUT + Duration::from_millis(500));
        }
        let start = Instant::now();
        let result = comm.all_reduce(&mut buf);
        let elapsed = start.elapsed();
        // The links are down: a later collective fails at once, the same way.
        let again = Instant::now();
        let second = comm.all_reduce(&mut buf);
        assert!(second.is_err() && again.elapsed() < Duration::from_millis(100));
        (result, elapsed)
    });
    for (rank, (result, elapsed)) in results.into_iter().enumerate() {
        let (peer, reason) = neighbour_named(result, rank, n);
        eprintln!("rank {rank} failed after {elapsed:?}: peer {peer} {reason}");
        if rank == staller + 1 {
            // The rank after the staller is the one that waits out the timeout, and says so.
            assert_eq!(peer, staller);
            assert!(reason.contains("sent nothing for 2 s"), "{reason}");
            assert!(elapsed >= TIMEOUT, "rank {rank} gave up after {elapsed:?}");
        }
        if rank == staller {
            assert!(
                elapsed < Duration::from_millis(500),
                "the stalled rank finds its links closed"
            );
        } else {
            assert!(
                elapsed < TIMEOUT + Duration::from_secs(1),
                "rank {rank} took {elapsed:?}"
            );
        }
    }
}

/// Every rank's outcome of a rendezvous at a test-bound master, one (rank, world size) each.
fn rendezvous(ranks: &[(usize, usize)]) -> Vec<Result<Communicator, Error>> {
    let master = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr: SocketAddr = master.local_addr().unwrap();
    let mut master = Some(master);
    let threads: Vec<_> = ranks
        .iter()
        .map(|&(rank, world_size)| {
            let cfg = TcpConfig::new(rank, world_size, addr, TIMEOUT);
            let master = master.take_if(|_| rank == 0);
            thread::spawn(move || match master {
                Some(master) => tcp_ring_with_master(&cfg, master),
                None => tcp_ring(&cfg),
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn a_duplicate_rank_is_refused_at_rendezvous() {
    let start = Instant::now();
    let results = rendezvous(&[(0, 3), (1, 3), (1, 3)]);
    assert!(
        start.elapsed() < TIMEOUT,
        "refused at once, not after a timeout"
    );
    for (result, rank) in results.into_iter().zip([0, 1, 1]) {
        let err = result.expect_err("a job with a duplicate rank must not start");
        eprintln!("{err}");
        match err {
            Error::Peer {
                rank: r,
                peer,
                reason,
            } if rank == 0 => {
                assert_eq!((r, peer), (0, 1));
                assert!(reason.contains("claimed by two processes"), "{reason}");
            }
            Error::Peer {
                rank: r,
                peer,
                reason,
            } => {
                assert_eq!((r, peer), (1, 0));
                assert!(
                    reason.contains("refused") && reason.contains("rank 1 was claimed"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_rank_that_never_joins_fails_the_rendezvous_within_the_timeout() {
    let start = Instant::now();
    let results = rendezvous(&[(0, 4), (1, 4), (3, 4)]);
    let elapsed = start.elapsed();
    assert!(
        elapsed >= TIMEOUT && elapsed < TIMEOUT + Duration::from_secs(1),
        "{elapsed:?}"
    );
    for (result, rank) in results.into_iter().zip([0, 1, 3]) {
        let err = result.expect_err("a job missing a rank must not start");
        eprintln!("{err}");
        let Error::Peer {
            rank: r,
            peer,
            reason,
        } = err
        else {
            panic!("{err:?}")
        };
        assert_eq!((r, peer), (rank, if rank == 0 { 2 } else { 0 }));
        assert!(reason.contains("did not join the rendezvous"), "{reason}");
    }
}

#[test]
fn a_mismatched_world_size_is_refused_at_rendezvous() {
    let results = rendezvous(&[(0, 2), (1, 3)]);
    for result in results {
        let err = result.expect_err("ranks that disagree on the world size must not start");
        assert!(matches!(err, Error::Peer { .. }), "{err:?}");
        assert!(
            err.to_string().contains("world size 3 but rank 0 has 2"),
            "{err}"
        );
    }
}

#[test]
fn ranks_that_disagree_on_a_message_size_fail_naming_the_peer() {
    let n = 2;
    let mut comms = with_scratch(tcp_ranks(n), 64);
    let results = on_every_rank(&mut comms, |comm| {
        let mut buf = vec![1.0f32; 10 * (comm.rank() + 1)];
        comm.all_reduce(&mut buf)
    });
    let reasons: Vec<String> = results
        .into_iter()
        .enumerate()
        .map(|(rank, result)| neighbour_named(result, rank, n).1)
        .collect();
    // The first rank to read the other's frame says why; the other may see its links shut
    // down before that frame arrives.
    assert!(
        reasons.iter().any(|r| r.contains("bytes were expected")),
        "{reasons:?}"
    );
}

#[test]
fn a_rank_outside_the_world_is_rejected() {
    let addr = "127.0.0.1:1".parse().unwrap();
    let err = tcp_ring(&TcpConfig::new(2, 2, addr, TIMEOUT)).unwrap_err();
    assert!(matches!(err, Error::Untrainable { .. }), "{err:?}");
}
