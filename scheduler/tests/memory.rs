//! The memory model against the ZeRO paper, hand-computed examples and its invariants.

use proptest::prelude::*;
use scheduler::kernel_figures::{CUDA_GEMM_RESIDENT_BYTES, MATMUL_SCRATCH_F32};
use scheduler::memory::{self, Breakdown, DeviceKind, Setup};
use scheduler::model::{GptShape, Preset, SHARD_ALIGN, Units};
use scheduler::spec::{AdamW, Architecture, Dtype, Lion, Momentum, Optimizer, Sgd, ZeroStage};
use serde::Deserialize;

fn setup(arch: Architecture, dtype: Dtype, opt: Optimizer, stage: ZeroStage, n: usize) -> Setup {
    Setup {
        arch,
        dtype,
        optimizer: opt,
        stage,
        world_size: n,
        micro_batch: 4,
        seq_len: 64,
        grad_accum: 1,
        checkpointing: false,
        reduces_norm: false,
        token_width: 0,
        validates: false,
        lora: None,
    }
}

fn adamw() -> Optimizer {
    Optimizer::Adamw(AdamW::default())
}

fn per_rank(s: &Setup) -> Breakdown {
    memory::estimate(s, DeviceKind::Cpu).per_rank
}

#[derive(Deserialize)]
struct Table1 {
    rows: Vec<Row>,
}

#[derive(Deserialize)]
struct Row {
    model: String,
    psi: f64,
    #[serde(rename = "K")]
    k: u64,
    #[serde(rename = "Nd")]
    nd: usize,
    zero_stage: u64,
    printed_gb: f64,
    recomputed_bytes: f64,
}

#[test]
fn reproduces_zero_paper_table_1() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/reference/zero_paper_table1.json"
    );
    let text = std::fs::read_to_string(path)
        .unwrap()
        .replace("printed_GB", "printed_gb");
    let table: Table1 = serde_json::from_str(&text).unwrap();
    assert_eq!(table.rows.len(), 54);
    for row in table.rows {
        assert_eq!(row.k, 12, "Table 1 is mixed-precision Adam");
        let s = setup(
            Architecture::Params(row.psi as u64),
            Dtype::Fp16,
            adamw(),
            ZeroStage::from_index(row.zero_stage).unwrap(),
            row.nd,
        );
        let states = per_rank(&s).model_states();
        // Bytes are whole: the one fractional cell (7.5B, Nd 1024, stage 2: 2Ψ/N = 14648437.5
        // bytes of gradients) rounds up; every other cell is exact.
        assert_eq!(
            states,
            row.recomputed_bytes.ceil() as u64,
            "{} Nd={} stage {}",
            row.model,
            row.nd,
            row.zero_stage
        );
        // Printed cells are rounded to 3 significant figures, or truncated for integers.
        let gb = states as f64 / 1e9;
        let digits = if row.printed_gb >= 100.0 || row.printed_gb.fract() == 0.0 {
            0
        } else if row.printed_gb >= 10.0 {
            1
        } else {
            2
        };
        let unit = 10f64.powi(-digits);
        assert!(
            (gb - row.printed_gb).abs() < unit,
            "{} Nd={} stage {}: {gb} GB vs printed {}",
            row.model,
            row.nd,
            row.zero_stage,
            row.printed_gb
        );
    }
}

/// The synthetic data loader at T = 64: its successor table and one row.
const SYNTHETIC_LOADER: u64 = 32 * 32 * 16 + 65 * 4;

#[test]
fn gpt2_124m_bf16_adamw_breakdown_matches_hand_count() {
    let shape = Preset::Gpt2Small.shape();
    let psi = 124_439_808u64;
    // Every unit of gpt2-124M is already a multiple of 16 elements: no padding at N = 1.
    assert_eq!(Units::new(&shape, 1).padded_len() as u64, psi);
    let b = per_rank(&setup(
        Architecture::Gpt(shape),
        Dtype::Bf16,
        adamw(),
        ZeroStage::Ddp,
        1,
    ));
    assert_eq!(b.params, 2 * psi);
    assert_eq!(b.grads, 2 * psi);
    assert_eq!(b.optimizer, 12 * psi);
    // B=4, T=64, C=768, NH=12, L=12 in bf16 (LayerNorm statistics and the attention's
    // log-sum-exp fp32): per block 5·BTC + 3BTC + 8BTC = 3,145,728 bf16 and 4BT + B·NH·T =
    // 4,096 fp32 elements; once: 2·BTC (encoded, lnf) + 2·BTC + 4BTC (backward scratch) bf16,
    // 512 fp32 statistics and the attention backward's B·NH·T fp32 row sums. Nothing is T².
    let per_block = 3_145_728 * 2 + 4_096 * 4;
    let once = (2 * 196_608 + 2 * 196_608 + 786_432) * 2 + 512 * 4 + 3_072 * 4;
    assert_eq!(b.activations, 12 * per_block + once);
    // Logits of all B·T = 256 rows (one chunk: 64 MiB holds 333 rows of V) fp32, losses fp32, input and target ids u32, the matmuls' f32 scratch,
    // the synthetic corpus's table (32² contexts × 4 u32) and one row of T + 1 u32; no
    // communication at N = 1.
    assert_eq!(
        b.buffers,
        256 * 50_257 * 4 + 3 * 256 * 4 + 4 * MATMUL_SCRATCH_F32 as u64 + SYNTHETIC_LOADER
    );
    // The CPU process planning assumes: 16 MiB at start, 12 MiB of growth, 16 threads of
    // 256 KiB stack and a 2 MiB L2 slab, one rank's GEMM workspace (4 B × 512 × 576 + 2 L2).
    assert_eq!(
        b.overhead,
        (16 << 20) + (12 << 20) + 16 * ((256 << 10) + (2 << 20)) + 4 * 512 * 576 + (4 << 20)
    );
}

#[test]
fn stage_3_gathers_units_and_keeps_only_shards() {
    let shape = Preset::Gpt2Small.shape();
    let n = 8;
    let units = Units::new(&shape, n);
    let s0 = per_rank(&setup(
        Architecture::Gpt(shape),
        Dtype::Bf16,
        adamw(),
        ZeroStage::Ddp,
        n,
    ));
    let s3 = per_rank(&setup(
        Architecture::Gpt(shape),
        Dtype::Bf16,
        adamw(),
        ZeroStage::Parameters,
        n,
    ));
    assert_eq!(s3.model_states() * n as u64, s0.model_states());
    let emb = units.embeddings().padded_len as u64;
    let block = units.largest_other_padded_len() as u64;
    let gathered = 2 * (emb + 2 * block);
    let grad_buffers = 2 * (emb + block);
    // The ring receives one chunk: bf16 at stage 0, fp32 once master weights are sharded
    // (the final export gathers them).
    let ring_chunk = 2 * units.largest_shard_len() as u64;
    assert_eq!(
        s3.buffers - s0.buffers,
        gathered + grad_buffers + ring_chunk
    );
    assert_eq!(
        s0.buffers,
        256 * 50_257 * 4
            + 3 * 256 * 4
            + 4 * MATMUL_SCRATCH_F32 as u64
            + SYNTHETIC_LOADER
            + ring_chunk
    );
    assert_eq!(s3.activations, s0.activations);
}

#[test]
fn communication_is_2_psi_for_stages_0_to_2_and_3_psi_for_stage_3() {
    let shape = Preset::Gpt2Small.shape();
    for n in [2usize, 4, 8, 64] {
        let units = Units::new(&shape, n);
        let ring = |elems: usize| 2 * elems as u64 * (n as u64 - 1) / n as u64; // bf16 bytes
        let per_pass = ring(units.padded_len());
        // Stage 3 gathers the final LayerNorm (2C elements) once: backward follows at once.
        let norm = ring(units.iter().last().unwrap().padded_len);
        for (stage, expected) in [
            (ZeroStage::Ddp, 2 * per_pass),
            (ZeroStage::Optimizer, 2 * per_pass),
            (ZeroStage::Gradients, 2 * per_pass),
            (ZeroStage::Parameters, 3 * per_pass - norm),
        ] {
            let s = setup(Architecture::Gpt(shape), Dtype::Bf16, adamw(), stage, n);
            let comm = memory::estimate(&s, DeviceKind::Cpu).comm;
            // Plus the agreement on the loss, the norm and the ignored targets: three f32s in
            // a multiple of N slots, 2·(N−1)/N of them sent.
            let slots = 3u64.next_multiple_of(n as u64);
            let agreement = 2 * slots * 4 * (n as u64 - 1) / n as u64;
            assert_eq!(comm.total(), expected + agreement, "stage {stage:?} N={n}");
        }
    }
}

#[test]
fn every_step_all_reduces_the_loss_the_norm_and_the_ignored_targets_in_three_f32s() {
    let shape = Preset::Tiny.shape();
    let pass = 2 * Units::new(&shape, 4).padded_len() as u64 * 3 / 4; // fp16 Ψ(N−1)/N
    for stage in ZeroStage::ALL {
        let comm = |n| {
            let s = setup(Architecture::Gpt(shape), Dtype::Fp16, adamw(), stage, n);
            memory::estimate(&s, DeviceKind::Cpu).comm
        };
        assert_eq!(comm(1).total(), 0, "one rank agrees with itself for free");
        let gradients = if stage == ZeroStage::Ddp { 2 * pass } else { 0 };
        // A ring all-reduce of 4 f32 slots (3 used): 2·(N−1) slots sent.
        assert_eq!(comm(4).all_reduce - gradients, 2 * 3 * 4, "stage {stage:?}");
    }
}

#[test]
fn cuda_devices_add_their_runtime_overhead() {
    let s = setup(
        Architecture::Params(1_000_000),
        Dtype::Bf16,
        adamw(),
        ZeroStage::Ddp,
        1,
    );
    let cpu = memory::estimate(&s, DeviceKind::Cpu).per_rank;
    let gpu = memory::estimate(&s, DeviceKind::Cuda).per_rank;
    assert_eq!(gpu.model_states(), cpu.model_states());
    assert_eq!(gpu.overhead, memory::CUDA_OVERHEAD_BYTES);
    assert_eq!(
        cpu.overhead,
        memory::process::CpuProcess::PLANNING.overhead_bytes()
    );
}

#[test]
fn a_gpu_holds_no_matmul_scratch_and_pays_for_its_gemm_buffers_in_overhead() {
    for (dtype, scratch) in [
        (Dtype::Fp32, 0),
        (Dtype::Bf16, 4 * MATMUL_SCRATCH_F32 as u64),
        (Dtype::Fp16, 4 * MATMUL_SCRATCH_F32 as u64),
    ] {
        let gpt = Architecture::Gpt(Preset::Tiny.shape());
        let s = setup(gpt, dtype, adamw(), ZeroStage::Ddp, 1);
        let cpu = memory::estimate(&s, DeviceKind::Cpu).per_rank;
        let gpu = memory::estimate(&s, DeviceKind::Cuda).per_rank;
        assert_eq!(cpu.buffers - gpu.buffers, scratch, "{dtype:?}");
        assert_eq!(
            memory::rank_breakdown_on(&s, 0, DeviceKind::Cuda).buffers,
            gpu.buffers
        );
        assert_eq!(
            (gpu.params, gpu.grads, gpu.optimizer, gpu.activations),
            (cpu.params, cpu.grads, cpu.optimizer, cpu.activations)
        );
    }
    assert_eq!(
        memory::CUDA_OVERHEAD_BYTES,
        memory::CUDA_CONTEXT_BYTES + CUDA_GEMM_RESIDENT_BYTES
    );
}

#[test]
fn a_cpu_process_pays_its_start_once_a_slab_and_stack_per_thread_and_a_workspace_per_rank() {
    use memory::process::{CpuProcess, GROWTH_BYTES, STACK_BYTES};
    let p = CpuProcess {
        resident_at_start: 10 << 20,
        threads: 3,
        ranks: 1,
        gemm_per_thread: 1 << 20,
        gemm_per_call: 4 << 20,
    };
    assert_eq!(
        p.overhead_bytes(),
        (10 << 20) + GROWTH_BYTES + 3 * (STACK_BYTES + (1 << 20)) + (4 << 20)
    );
    let four = CpuProcess {
        threads: 6,
        ranks: 4,
        ..p
    };
    assert_eq!(
        four.overhead_bytes() - p.overhead_bytes(),
        3 * (STACK_BYTES + (1 << 20)) + 3 * (4 << 20)
    );
}

#[test]
fn optimizers_keep_their_documented_state_per_parameter() {
    let psi = 1_000_000u64;
    let bytes = |opt, dtype| {
        per_rank(&setup(
            Architecture::Params(psi),
            dtype,
            opt,
            ZeroStage::Ddp,
            1,
        ))
        .optimizer
    };
    assert_eq!(bytes(Optimizer::Sgd(Sgd::default()), Dtype::Fp32), 0);
    assert_eq!(bytes(Optimizer::Sgd(Sgd::default()), Dtype::Bf16), 4 * psi);
    assert_eq!(
        bytes(Optimizer::Momentum(Momentum::default()), Dtype::Fp32),
        4 * psi
    );
    assert_eq!(
        bytes(Optimizer::Lion(Lion::default()), Dtype::Bf16),
        8 * psi
    );
    assert_eq!(bytes(adamw(), Dtype::Fp32), 8 * psi);
    // 8-bit Adam: two bytes of state plus two fp32 absmax per 2048-element block.
    let adam8 = Optimizer::Adam8bit(Default::default());
    assert_eq!(bytes(adam8, Dtype::Fp32), 2 * psi + 8 * psi.div_ceil(2048));
    // Adafactor: row and column statistics of one 1000×1000 matrix, their exact sums and one
    // RMS sum, each sum 12 f64 limbs.
    let ada = Optimizer::Adafactor(Default::default());
    assert_eq!(bytes(ada, Dtype::Fp32), 4 * 2000 + 8 * 12 * (2000 + 1));
}

#[test]
fn adafactor_on_gpt_keeps_factored_statistics_and_vector_moments() {
    let shape = Preset::Tiny.shape();
    let (v, t, c, l) = (512, 128, 64, 2);
    let ada = Optimizer::Adafactor(Default::default());
    let b = per_rank(&setup(
        Architecture::Gpt(shape),
        Dtype::Fp32,
        ada,
        ZeroStage::Ddp,
        1,
    ));
    let factored = (v + c) + (t + c) + l * ((c + 3 * c) + (c + c) + (c + 4 * c) + (4 * c + c));
    let vectors = l * (c + c + 3 * c + c + c + c + 4 * c + c) + 2 * c;
    let tensors = 2 + 12 * l + 2;
    assert_eq!(
        b.optimizer,
        (4 * (factored + vectors) + 8 * 12 * (factored + tensors)) as u64
    );
}

fn presets() -> impl Strategy<Value = GptShape> {
    prop_oneof![
        Just(Preset::Tiny.shape()),
        Just(Preset::Gpt2Small.shape()),
        Just(Preset::Gpt2Xl.shape()),
    ]
}

fn element_optimizers() -> impl Strategy<Value = Optimizer> {
    prop_oneof![
        Just(Optimizer::Sgd(Sgd::default())),
        Just(Optimizer::Momentum(Momentum::default())),
        Just(adamw()),
        Just(Optimizer::Lion(Lion::default())),
    ]
}

fn dtypes() -> impl Strategy<Value = Dtype> {
    prop_oneof![Just(Dtype::Fp32), Just(Dtype::Fp16), Just(Dtype::Bf16)]
}

proptest! {
    #[test]
    fn closed_form_model_states_never_grow_with_stage_or_ranks(
        psi in 1u64..2_000_000_000_000,
        n in 1usize..2048,
        dtype in dtypes(),
        opt in element_optimizers(),
    ) {
        let states = |stage, n| {
            per_rank(&setup(Architecture::Params(psi), dtype, opt, stage, n)).model_states()
        };
        for pair in ZeroStage::ALL.windows(2) {
            prop_assert!(states(pair[1], n) <= states(pair[0], n));
        }
        for stage in ZeroStage::ALL {
            prop_assert!(states(stage, n + 1) <= states(stage, n));
        }
    }

    /// Padding units to a multiple of SHARD_ALIGN × N is the only thing that can make a
    /// whole (unsharded) buffer larger at more ranks; without it, states never grow.
    #[test]
    fn gpt_model_states_never_grow_with_stage_or_ranks_beyond_padding(
        shape in presets(),
        n in 1usize..256,
        dtype in dtypes(),
        opt in element_optimizers(),
    ) {
        let states = |stage, n| {
            per_rank(&setup(Architecture::Gpt(shape), dtype, opt, stage, n)).model_states()
        };
        for pair in ZeroStage::ALL.windows(2) {
            prop_assert!(states(pair[1], n) <= states(pair[0], n));
        }
        let m = n + 1;
        let pad = (Units::new(&shape, m).padded_len() - Units::new(&shape, 1).padded_len()) as u64;
        // At most 16 bytes per element are whole: params, grads, master and Adam's m and v.
        let whole_bytes_per_elem = 16;
        for stage in ZeroStage::ALL {
            prop_assert!(states(stage, m) <= states(stage, n) + whole_bytes_per_elem * pad);
        }
        prop_assert!(states(ZeroStage::Parameters, m) <= states(ZeroStage::Parameters, n));
    }

    #[test]
    fn stage_3_times_ranks_equals_stage_0_model_states(
        shape in presets(),
        n in 1usize..512,
        dtype in dtypes(),
        opt in element_optimizers(),
    ) {
        let b = |stage| per_rank(&setup(Architecture::Gpt(shape), dtype, opt, stage, n));
        prop_assert_eq!(b(ZeroStage::Parameters).model_states() * n as u64, b(ZeroStage::Ddp).model_states());
        // …and the padding that makes it exact is less than one aligned chunk per rank per unit.
        let units = Units::new(&shape, n);
        let unpadded = shape.parameter_count() as usize;
        prop_assert!(units.padded_len() - unpadded < units.iter().count() * SHARD_ALIGN * n);
    }
}
