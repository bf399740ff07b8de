//! Step time and bytes moved per ZeRO stage for N = 1, 2, 4 ranks, as threads of this process
//! over the in-process ring (`local`) and over TCP on loopback (`tcp`: every rank still a
//! thread here, but each talks to its neighbours through real sockets, as separate processes
//! would). Bytes are what each rank sent per step, next to the memory model's count.
//!
//! Run: `cargo bench -p runner --bench zero [-- --steps N]`. The model is a small GPT
//! (V 8192, T 128, L 4, NH 4, C 256: 5.3M parameters) at micro-batch 4, seq 64, fp32, AdamW,
//! so that communication is a visible share of a step on a few cores. All ranks share this
//! machine's cores; the point is the comparison across stages and transports, not scaling.

use std::net::TcpListener;
use std::time::Duration;

use runner::comm::{Communicator, Op, TcpConfig, local_ring, tcp_ring, tcp_ring_with_master};
use runner::train::{Options, Summary, run_ranks};
use scheduler::memory::{self, DeviceKind, Setup};
use scheduler::plan::plan_local;
use scheduler::spec::{JobSpec, Purpose};

mod common;

const WARMUP: usize = 2;
const TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, PartialEq)]
enum Transport {
    Local,
    Tcp,
}

fn spec(world: usize, stage: u8, steps: usize) -> JobSpec {
    let json = format!(
        r#"{{"model": {{"vocab_size": 8192, "context_length": 128, "n_layer": 4, "n_head": 4,
                       "n_embd": 256}},
            "world_size": {world}, "zero": {{"stage": {stage}}}, "activation_checkpointing": false,
            "training": {{"micro_batch_size": 4, "seq_len": 64, "steps": {steps}}}}}"#
    );
    JobSpec::parse(&json, Purpose::Train)
        .expect("the benchmark spec is valid")
        .spec
}

/// Every rank's communicator, each rank connecting on a thread of its own as it would in its
/// own process; rank 0 listens on a port bound here, so there is no race for it.
fn tcp_ranks(world: usize) -> Vec<Communicator> {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let master = listener.local_addr().expect("a bound address");
    let mut listener = Some(listener);
    let joining: Vec<_> = (0..world)
        .map(|rank| {
            let cfg = TcpConfig::new(rank, world, master, TIMEOUT);
            let listener = listener.take_if(|_| rank == 0);
            std::thread::spawn(move || match listener {
                Some(l) => tcp_ring_with_master(&cfg, l),
                None => tcp_ring(&cfg),
            })
        })
        .collect();
    joining
        .into_iter()
        .map(|j| j.join().expect("rank thread").expect("the ring connects"))
        .collect()
}

/// Rank 0's step times (warm-up dropped) and the run's summary.
fn time(spec: &JobSpec, transport: Transport) -> (Vec<f64>, Summary) {
    let world = spec.world_size.get() as usize;
    let comms = match transport {
        Transport::Local => local_ring(world, TIMEOUT),
        Transport::Tcp => tcp_ranks(world),
    };
    let mut seconds = Vec::new();
    let mut progress = |p: runner::train::Progress| seconds.push(p.step_seconds);
    let plan = plan_local(spec, None).expect("the bench's specs fit");
    let summary =
        run_ranks(spec, &plan, comms, &Options::default(), &mut progress).expect("training runs");
    seconds.drain(..WARMUP);
    (seconds, summary)
}

fn main() {
    common::setup();
    let args: Vec<String> = std::env::args().collect();
    let measured = args
        .iter()
        .position(|a| a == "--steps")
        .and_then(|i| args.get(i + 1))
        .map_or(8, |s| s.parse().expect("--steps takes a number"));
    let steps = WARMUP + measured;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "kernel threads: {threads}; {measured} measured steps after {WARMUP} of warm-up; \
         bytes are per rank per step"
    );
    println!();
    println!(
        "| transport | N | stage | median step ms | min–max ms | sent MB | model MB | \
         all-reduce MB | reduce-scatter MB | all-gather MB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for world in [1usize, 2, 4] {
        for transport in [Transport::Local, Transport::Tcp] {
            // One rank sends nothing: there is no transport to compare.
            if world == 1 && transport == Transport::Tcp {
                continue;
            }
            for stage in 0..=3u8 {
                let spec = spec(world, stage, steps);
                let micro = spec.training.micro_batch_size.fixed().expect("fixed").get();
                let zero = spec.zero.stage.fixed().expect("fixed");
                let model =
                    memory::estimate(&Setup::new(&spec, zero, false, micro, 1), DeviceKind::Cpu)
                        .comm;
                let (seconds, summary) = time(&spec, transport);
                let (median, lo, hi) = common::median_min_max(&seconds);
                let rank0 = &summary.ranks[0];
                let per_step = |bytes: u64| bytes as f64 / steps as f64 / 1e6;
                let sent = |op| per_step(rank0.comm_bytes_sent.get(&op).copied().unwrap_or(0));
                println!(
                    "| {} | {world} | {stage} | {:.1} | {:.1}–{:.1} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
                    match transport {
                        Transport::Local => "local",
                        Transport::Tcp => "tcp",
                    },
                    1e3 * median,
                    1e3 * lo,
                    1e3 * hi,
                    per_step(rank0.comm_bytes_sent.values().sum()),
                    model.total() as f64 / 1e6,
                    sent(Op::AllReduce),
                    sent(Op::ReduceScatter),
                    sent(Op::AllGather),
                );
            }
        }
    }
}
