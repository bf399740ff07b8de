//! The memory of a GPU GRES type: `--slurm-gpu-memory TYPE=SIZE`, else a built-in table of the
//! GPUs Slurm sites commonly name (`gpu:h100:8`). The table gives each product's memory as its
//! name announces it, in GB (10^9 bytes), and the smallest variant where one name covers
//! several (`a100`: 40 GB): never more than the driver reports (an H100 80GB reports 81,559
//! MiB), so a job admitted against the table fits the GPUs the agents then register.

const GB: u64 = 1_000_000_000;

/// GRES type (lower case) and bytes.
const TABLE: [(&str, u64); 16] = [
    ("a10", 24 * GB),
    ("a100", 40 * GB),
    ("a100_80gb", 80 * GB),
    ("a40", 48 * GB),
    ("a6000", 48 * GB),
    ("gh200", 96 * GB),
    ("h100", 80 * GB),
    ("h200", 141 * GB),
    ("l4", 24 * GB),
    ("l40", 48 * GB),
    ("l40s", 48 * GB),
    ("rtx4090", 24 * GB),
    ("rtx6000", 24 * GB),
    ("t4", 16 * GB),
    ("v100", 16 * GB),
    ("v100_32gb", 32 * GB),
];

/// The memory of GPUs of GRES type `kind` (any case): the operator's figure, else the table's.
pub fn memory(kind: &str, configured: &[(String, u64)]) -> Option<u64> {
    let kind = kind.to_ascii_lowercase();
    let known = configured.iter().find(|(k, _)| *k == kind).map(|(_, b)| *b);
    known.or_else(|| TABLE.iter().find(|(k, _)| *k == kind).map(|(_, b)| *b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operators_figure_wins_over_the_table() {
        assert_eq!(memory("H100", &[]), Some(80 * GB));
        let mine = [("h100".to_string(), 94 * GB)];
        assert_eq!(memory("h100", &mine), Some(94 * GB));
        assert_eq!(memory("mystery", &[]), None);
    }

    #[test]
    fn the_table_is_sorted_and_never_above_what_drivers_report() {
        assert!(TABLE.windows(2).all(|w| w[0].0 < w[1].0));
        // nvidia-smi's memory.total for H100 80GB HBM3 and A100-SXM4-40GB, in MiB.
        assert!(memory("h100", &[]).unwrap() <= 81_559 << 20);
        assert!(memory("a100", &[]).unwrap() <= 40_960 << 20);
    }
}
