//! The figures the memory model and admission copy from the kernels
//! (`scheduler::kernel_figures`) against the kernels' own: a tile, pack or limit changed on
//! one side only fails here, naming the figure.

use kernels::matmul;
use scheduler::kernel_figures as figures;

#[test]
fn the_schedulers_kernel_figures_are_the_kernels_own() {
    let mut differ = Vec::new();
    let mut same = |name: &str, scheduler: u64, kernels: u64| {
        if scheduler != kernels {
            differ.push(format!("{name}: scheduler {scheduler}, kernels {kernels}"));
        }
    };
    same(
        "MAX_HEAD_SIZE",
        figures::MAX_HEAD_SIZE as u64,
        kernels::attention::MAX_HEAD_SIZE as u64,
    );
    same(
        "ADAFACTOR_SUM_LIMBS",
        figures::ADAFACTOR_SUM_LIMBS as u64,
        kernels::optim::LIMBS as u64,
    );
    // Full tiles: every orientation of a product at least a tile deep and wide.
    let big = 1 << 14;
    same(
        "MATMUL_SCRATCH_F32",
        figures::MATMUL_SCRATCH_F32 as u64,
        matmul::scratch_len(big, big, big) as u64,
    );
    #[cfg(target_arch = "x86_64")]
    for depth in [1, 31, 32, 33, 576, 65_536, 65_537, 100_000, 1 << 20] {
        same(
            &format!("matmul_packs_f32({depth})"),
            figures::matmul_packs_f32(depth) as u64,
            matmul::packs_len(depth) as u64,
        );
    }
    for l2 in [256 << 10, 1 << 20, 2 << 20, 3 << 20] {
        let gemm = matmul::gemm_workspace_for(l2);
        let (per_thread, per_call) = figures::gemm_workspace(l2);
        same(
            &format!("gemm_workspace({l2}).0"),
            per_thread,
            gemm.per_thread,
        );
        same(&format!("gemm_workspace({l2}).1"), per_call, gemm.per_call);
    }
    same(
        "NF4_BLOCK",
        figures::NF4_BLOCK as u64,
        kernels::nf4::BLOCK as u64,
    );
    for n in [1, 2, 63, 64, 65, 4096 * 14336] {
        same(
            &format!("nf4_bytes({n})"),
            figures::nf4_bytes(n) as u64,
            (kernels::nf4::code_bytes(n) + 4 * kernels::nf4::blocks(n)) as u64,
        );
    }
    #[cfg(feature = "cuda")]
    {
        same(
            "CUDA_MAX_ATTENTION_HEADS",
            figures::CUDA_MAX_ATTENTION_HEADS as u64,
            u64::from(kernels::cuda::MAX_GRID.1),
        );
        same(
            "CUDA_GEMM_RESIDENT_BYTES",
            figures::CUDA_GEMM_RESIDENT_BYTES,
            kernels::cuda::matmul::resident_bytes() as u64,
        );
    }
    assert!(
        differ.is_empty(),
        "figures that differ:\n{}",
        differ.join("\n")
    );
}
