//! The collectives the engine runs on device buffers (`DeviceCollectives::collective`), one test
//! body for every back end: `local` and `tcp` (the ring, on the CPU device) and `nccl` (feature
//! `cuda`, on GPUs: world size 1 where there is one GPU, every GPU where there are more). Each gives
//! every rank the exact sum (values are small integers, so no order of summation rounds) and
//! counts the bytes the memory model does. Where NCCL cannot run the test says why;
//! `ZEROTRAIN_REQUIRE_GPU=1` (the GPU check) turns that into a failure.

use crate::rings;

use std::fmt::Debug;
use std::thread;
use std::time::Duration;

use half::{bf16, f16};
use rings::{tcp_ranks, with_scratch};
use runner::Error;
use runner::comm::{Collective, Communicator, DeviceCollectives, Summable, local_ring};
use runner::device::{Cpu, Elem};

const TIMEOUT: Duration = Duration::from_secs(5);

/// Bytes of ring scratch: a chunk of the largest buffer (1000 × N elements of ≤ 8 bytes).
const SCRATCH: usize = 8000;

/// A value type with small integer test values, exact in every dtype once summed over ≤ 4
/// ranks.
trait Value: Elem + Summable + PartialEq + Debug {
    fn of(i: usize) -> Self;
}

impl Value for f32 {
    fn of(i: usize) -> Self {
        (i % 61) as f32 - 30.0
    }
}
impl Value for f64 {
    fn of(i: usize) -> Self {
        (i % 61) as f64 - 30.0
    }
}
impl Value for bf16 {
    fn of(i: usize) -> Self {
        bf16::from_f32((i % 61) as f32 - 30.0)
    }
}
impl Value for f16 {
    fn of(i: usize) -> Self {
        f16::from_f32((i % 61) as f32 - 30.0)
    }
}
impl Value for u8 {
    fn of(i: usize) -> Self {
        (i % 61) as u8
    }
}

/// What rank `rank` must hold after `c`, of the part the collective defines: everything, but
/// only the own chunk after a reduce-scatter (other chunks are the back end's business).
fn check<T: Value>(c: Collective, inputs: &[Vec<T>], rank: usize, got: &[T], what: &str) {
    let (n, len) = (inputs.len(), inputs[0].len());
    let chunk = len / n;
    let sum = |i: usize| {
        (1..n).fold(inputs[0][i], |acc, r| {
            let mut a = [acc];
            T::add(&mut a, &[inputs[r][i]]);
            a[0]
        })
    };
    let (range, want): (std::ops::Range<usize>, Vec<T>) = match c {
        Collective::AllReduce => (0..len, (0..len).map(sum).collect()),
        Collective::ReduceScatter => {
            let own = rank * chunk..(rank + 1) * chunk;
            (own.clone(), own.map(sum).collect())
        }
        Collective::AllGather => (0..len, (0..len).map(|i| inputs[i / chunk][i]).collect()),
    };
    assert_eq!(&got[range], &want[..], "{what}");
}

/// One rank's part: each collective on buffers of several lengths (multiples of the world
/// size, as the engine's padded units are); it must hold the sum and have sent what the ring
/// sends. Every rank runs it at once, each on its own thread.
fn collectives_give_the_sum<D: DeviceCollectives, T: Value>(
    dev: &D,
    comm: &mut Communicator,
    label: &str,
) {
    let (n, rank) = (comm.world_size(), comm.rank());
    for len in [n, 4 * n, 1000 * n] {
        let inputs: Vec<Vec<T>> = (0..n)
            .map(|r| (0..len).map(|i| T::of(i * 7 + r * 13 + 1)).collect())
            .collect();
        for c in [
            Collective::AllReduce,
            Collective::ReduceScatter,
            Collective::AllGather,
        ] {
            let what = format!(
                "{label} {c:?}, n {n}, len {len}, rank {rank}, {}",
                std::any::type_name::<T>()
            );
            let passes = if c == Collective::AllReduce { 2 } else { 1 };
            let wire = (passes * (n - 1) * len.div_ceil(n) * size_of::<T>()) as u64;
            let before = comm.sent_bytes().get(&c.op()).copied().unwrap_or(0);
            let mut buf = dev.zeros::<T>(len).unwrap();
            dev.on_host(D::view_mut(&mut buf), |h| h.copy_from_slice(&inputs[rank]))
                .unwrap();
            dev.collective(comm, c, D::view_mut(&mut buf))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let got = dev.to_host(D::view(&buf)).unwrap();
            check(c, &inputs, rank, &got, &what);
            let sent = comm.sent_bytes().get(&c.op()).copied().unwrap_or(0) - before;
            assert_eq!(sent, wire, "bytes sent: {what}");
        }
    }
}

fn every_dtype<D: DeviceCollectives>(dev: &D, comm: &mut Communicator, label: &str) {
    collectives_give_the_sum::<D, f32>(dev, comm, label);
    collectives_give_the_sum::<D, bf16>(dev, comm, label);
    collectives_give_the_sum::<D, f16>(dev, comm, label);
    collectives_give_the_sum::<D, f64>(dev, comm, label);
    collectives_give_the_sum::<D, u8>(dev, comm, label);
}

/// Runs `body` on every rank at once, each on its own thread with the device `open` gives it
/// (opened there: a GPU's handles stay on their thread); the first rank that could not open
/// its device says why.
fn on_every_rank<D: DeviceCollectives>(
    comms: Vec<Communicator>,
    open: impl Fn(&mut Communicator) -> Result<D, Error> + Sync,
    body: impl Fn(&D, &mut Communicator) + Sync,
) -> Result<(), Error> {
    thread::scope(|s| {
        let ranks: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let (open, body) = (&open, &body);
                s.spawn(move || {
                    let dev = open(&mut comm)?;
                    body(&dev, &mut comm);
                    Ok(())
                })
            })
            .collect();
        ranks
            .into_iter()
            .try_for_each(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })
}

fn on_the_cpu(comms: Vec<Communicator>, label: &str) {
    on_every_rank(
        with_scratch(comms, SCRATCH),
        |_| Ok(Cpu),
        |dev, comm| every_dtype(dev, comm, label),
    )
    .unwrap();
}

#[test]
fn device_collectives_over_local_give_the_sum_and_the_model_bytes() {
    for n in 1..=4 {
        on_the_cpu(local_ring(n, TIMEOUT), "local");
    }
}

#[test]
fn device_collectives_over_tcp_give_the_sum_and_the_model_bytes() {
    for n in [2, 3] {
        on_the_cpu(tcp_ranks(n, TIMEOUT), "tcp");
    }
}

/// Why NCCL could not run here: a failure under `ZEROTRAIN_REQUIRE_GPU=1`, else a notice.
fn nccl_did_not_run(why: &str) {
    if std::env::var_os("ZEROTRAIN_REQUIRE_GPU").is_some_and(|v| v == "1") {
        panic!("ZEROTRAIN_REQUIRE_GPU=1 but nccl did not run: {why}");
    }
    eprintln!("nccl: did not run: {why}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn device_collectives_over_nccl_give_the_sum_and_the_model_bytes() {
    nccl_did_not_run("built without the cuda feature");
}

#[cfg(feature = "cuda")]
mod nccl {
    use runner::comm::Op;
    use runner::device::{Cuda, Target};
    use runner::train::{Options, run_ranks};
    use scheduler::memory::Category;
    use scheduler::memory::DeviceKind;
    use scheduler::plan::plan_local_on;
    use scheduler::spec::{JobSpec, Purpose};

    use super::*;

    /// Rank r on GPU r, joined to the others in one NCCL communicator through the local ring,
    /// as a node's agent joins them.
    fn open_gpu(comm: &mut Communicator) -> Result<Cuda, Error> {
        let dev = Cuda::new(comm.rank())?;
        comm.request_nccl();
        dev.join_collectives(comm)?;
        Ok(dev)
    }

    fn gpu_count() -> usize {
        kernels::cuda::gpus::discover().map_or(0, |g| g.len())
    }

    #[test]
    fn device_collectives_over_nccl_give_the_sum_and_the_model_bytes() {
        let mut sizes = vec![1];
        if gpu_count() >= 2 {
            sizes.push(gpu_count().min(4));
        }
        for n in sizes {
            let ran = on_every_rank(
                with_scratch(local_ring(n, TIMEOUT), SCRATCH),
                open_gpu,
                |dev, comm| every_dtype(dev, comm, "nccl"),
            );
            if let Err(e) = ran {
                return nccl_did_not_run(&format!("{n} rank(s): {e}"));
            }
        }
    }

    /// A gpt2-tiny job at world size 1 on cuda:0 with its collectives on NCCL trains to the
    /// bits of the same job without it, holds the model's bytes, and sends nothing.
    #[test]
    fn a_job_on_nccl_at_world_size_1_trains_as_without_it() {
        let json = r#"{"model": {"preset": "gpt2-tiny"}, "precision": {"dtype": "bf16"},
            "zero": {"stage": 3}, "activation_checkpointing": false,
            "training": {"steps": 8, "micro_batch_size": 2, "lr": 1e-3}}"#;
        let spec = JobSpec::parse(json, Purpose::Train).unwrap().spec;
        let plan = plan_local_on(&spec, None, DeviceKind::Cuda).unwrap();
        let opts = Options {
            device: Target::Cuda(0),
            ..Options::default()
        };
        let train = |nccl: bool| {
            let mut comm = Communicator::solo();
            if nccl {
                comm.request_nccl();
            }
            run_ranks(&spec, &plan, vec![comm], &opts, &mut |_| {})
        };
        let ring = match train(false) {
            Ok(s) => s,
            Err(e) => return nccl_did_not_run(&format!("cuda:0: {e}")),
        };
        let over_nccl = match train(true) {
            Ok(s) => s,
            Err(e) => return nccl_did_not_run(&format!("nccl on cuda:0: {e}")),
        };
        assert_eq!(over_nccl.losses, ring.losses);
        let r = &over_nccl.ranks[0];
        for &c in Category::ALL {
            assert_eq!(
                r.measured_peak_bytes.get(c),
                r.predicted_bytes.get(c),
                "{}",
                c.name()
            );
        }
        assert!(
            r.comm_bytes_sent.values().all(|&b| b == 0),
            "{:?}",
            r.comm_bytes_sent
        );
        assert!(r.device_used_peak_bytes.is_some_and(|b| b > 0));
    }

    /// `scripts/gpu-check --multi`, for machines with two GPUs or more: gpt2-tiny fp32 at
    /// stages 0-3 on two GPUs over NCCL (each rank pinned to its own) gives the losses of one
    /// GPU with the doubled batch, as the CPU tests find for the ring (`tests/zero.rs`). The
    /// GEMMs of a batch of 4 and of two batches of 2 sum in other orders, hence the tolerance.
    #[test]
    fn two_gpus_over_nccl_give_the_losses_of_one_with_the_doubled_batch() {
        if gpu_count() < 2 {
            let why = format!("{} GPU(s) here; this needs two", gpu_count());
            if std::env::var_os("ZEROTRAIN_REQUIRE_GPUS").is_some_and(|v| v == "2") {
                panic!("ZEROTRAIN_REQUIRE_GPUS=2 but {why}");
            }
            return eprintln!("two GPUs: did not run: {why}");
        }
        let job = |world: usize, stage: u8, micro: usize| {
            let json = format!(
                r#"{{"model": {{"preset": "gpt2-tiny"}}, "world_size": {world}, "zero": {{"stage": {stage}}},
                    "activation_checkpointing": false,
                    "training": {{"steps": 10, "micro_batch_size": {micro}, "lr": 1e-3}}}}"#
            );
            JobSpec::parse(&json, Purpose::Train).unwrap().spec
        };
        let train = |spec: &JobSpec| {
            let plan = plan_local_on(spec, None, DeviceKind::Cuda).unwrap();
            let world = spec.world_size.get() as usize;
            let opts = Options {
                device: Target::Cuda(0),
                rank_devices: (0..world).map(|r| (r, Target::Cuda(r))).collect(),
                ..Options::default()
            };
            let mut comms = local_ring(world, TIMEOUT);
            comms.iter_mut().for_each(Communicator::request_nccl);
            run_ranks(spec, &plan, comms, &opts, &mut |_| {}).unwrap()
        };
        let one = train(&job(1, 0, 4));
        for stage in 0..=3 {
            let two = train(&job(2, stage, 2));
            for (step, (a, b)) in two.losses.iter().zip(&one.losses).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs(),
                    "stage {stage}, step {step}: 2 GPUs {a} vs 1 GPU {b}"
                );
            }
            let spec = job(2, stage, 2);
            let plan = plan_local_on(&spec, None, DeviceKind::Cuda).unwrap();
            let model = scheduler::memory::estimate(&plan.chosen.setup(&spec), DeviceKind::Cuda);
            for r in &two.ranks {
                let sent = |op| r.comm_bytes_sent.get(&op).copied().unwrap_or(0);
                let per_op = [
                    (Op::AllReduce, model.comm.all_reduce),
                    (Op::ReduceScatter, model.comm.reduce_scatter),
                    (Op::AllGather, model.comm.all_gather),
                ];
                for (op, per_step) in per_op {
                    assert_eq!(
                        sent(op),
                        10 * per_step,
                        "stage {stage} rank {} {op:?}",
                        r.rank
                    );
                }
                eprintln!(
                    "stage {stage} rank {}: {} bytes sent per step (the model's); device peak {:?} bytes",
                    r.rank,
                    model.comm.total(),
                    r.device_used_peak_bytes
                );
            }
        }
    }
}
