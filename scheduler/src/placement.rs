//! Gang placement: all ranks of a job at once, or none, on devices of one kind (the plan's:
//! NCCL and the ring cannot join a GPU rank with a CPU one, and the plan's bytes are that
//! kind's). Fewest nodes first (a ring that stays inside a node is cheapest), then best fit:
//! the devices whose free memory exceeds the need by the least, so large devices stay free for
//! large jobs. Consecutive ranks share a node.
//! `place` is the plain statement of the rule, for one job; a scheduling pass places job after
//! job with [`Pool`](crate::pool::Pool), which makes the same choices faster.

use serde::Serialize;

use crate::inventory::{DeviceSlot, Inventory};
use crate::memory::DeviceKind;

/// Where one rank runs: indices into the inventory's nodes and that node's devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Slot {
    pub node: usize,
    pub device: usize,
}

/// Places `world_size` ranks on devices of `kind` in `free` (devices not running anything)
/// that hold `need` bytes plus `margin` of their memory; `None` when they do not all fit now.
/// `margin` is a fraction (0.05 keeps 5% of each device free).
pub fn place(
    free: &Inventory,
    world_size: usize,
    margin: f64,
    kind: DeviceKind,
    need: u64,
) -> Option<Vec<Slot>> {
    let fits = |d: &DeviceSlot| {
        let usable = (d.memory_bytes as f64 * (1.0 - margin)) as u64;
        d.kind == kind && need <= usable
    };
    let leftover = |d: &DeviceSlot| d.memory_bytes - need;
    // Per node, its devices that fit, best fit first.
    let mut nodes: Vec<(usize, Vec<usize>)> = free
        .nodes
        .iter()
        .enumerate()
        .map(|(n, node)| {
            let mut devices: Vec<usize> = (0..node.devices.len())
                .filter(|&i| fits(&node.devices[i]))
                .collect();
            devices.sort_by_key(|&i| (leftover(&node.devices[i]), i));
            (n, devices)
        })
        .filter(|(_, devices)| !devices.is_empty())
        .collect();
    let take = |(n, devices): &(usize, Vec<usize>), count: usize| {
        devices[..count]
            .iter()
            .map(|&device| Slot { node: *n, device })
            .collect::<Vec<_>>()
    };
    let waste = |(n, devices): &(usize, Vec<usize>), count: usize| -> u64 {
        devices[..count]
            .iter()
            .map(|&i| leftover(&free.nodes[*n].devices[i]))
            .sum()
    };
    // One node if any can hold every rank: the one that wastes least.
    if let Some(best) = nodes
        .iter()
        .filter(|(_, d)| d.len() >= world_size)
        .min_by_key(|node| (waste(node, world_size), node.0))
    {
        return Some(take(best, world_size));
    }
    // Otherwise the fewest nodes: those with the most fitting devices first.
    nodes.sort_by_key(|(n, d)| (std::cmp::Reverse(d.len()), *n));
    let mut slots = Vec::with_capacity(world_size);
    for node in &nodes {
        let count = (world_size - slots.len()).min(node.1.len());
        slots.extend(take(node, count));
        if slots.len() == world_size {
            return Some(slots);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Node;

    const GB: u64 = 1_000_000_000;

    fn node(name: &str, sizes: &[u64]) -> Node {
        Node {
            name: name.into(),
            devices: sizes
                .iter()
                .map(|&gb| DeviceSlot {
                    kind: DeviceKind::Cpu,
                    memory_bytes: gb * GB,
                })
                .collect(),
        }
    }

    fn inv(nodes: Vec<Node>) -> Inventory {
        Inventory { nodes }
    }

    #[test]
    fn keeps_a_job_on_one_node_when_one_can_hold_it() {
        let free = inv(vec![node("a", &[80, 80]), node("b", &[40, 40, 40, 40])]);
        let slots = place(&free, 4, 0.0, DeviceKind::Cpu, 30 * GB).unwrap();
        assert!(slots.iter().all(|s| s.node == 1), "{slots:?}");
    }

    #[test]
    fn prefers_the_node_that_wastes_least() {
        let free = inv(vec![node("big", &[80, 80]), node("snug", &[32, 32])]);
        let slots = place(&free, 2, 0.0, DeviceKind::Cpu, 30 * GB).unwrap();
        assert_eq!(
            slots,
            vec![Slot { node: 1, device: 0 }, Slot { node: 1, device: 1 }]
        );
    }

    #[test]
    fn spans_the_fewest_nodes_with_consecutive_ranks_together() {
        let free = inv(vec![
            node("a", &[40]),
            node("b", &[40, 40, 40]),
            node("c", &[40, 40]),
        ]);
        let slots = place(&free, 5, 0.0, DeviceKind::Cpu, 30 * GB).unwrap();
        let nodes: Vec<usize> = slots.iter().map(|s| s.node).collect();
        assert_eq!(nodes, vec![1, 1, 1, 2, 2]);
    }

    #[test]
    fn places_nothing_unless_every_rank_fits() {
        let free = inv(vec![node("a", &[40, 20]), node("b", &[20])]);
        assert!(place(&free, 2, 0.0, DeviceKind::Cpu, 30 * GB).is_none());
        assert_eq!(
            place(&free, 1, 0.0, DeviceKind::Cpu, 30 * GB).unwrap(),
            vec![Slot { node: 0, device: 0 }]
        );
    }

    #[test]
    fn the_safety_margin_keeps_part_of_each_device_free() {
        let free = inv(vec![node("a", &[32])]);
        assert!(place(&free, 1, 0.0, DeviceKind::Cpu, 30 * GB).is_some());
        assert!(
            place(&free, 1, 0.1, DeviceKind::Cpu, 30 * GB).is_none(),
            "30 GB > 90% of 32 GB"
        );
    }

    /// A node whose devices are (kind, GB) pairs.
    fn mixed(name: &str, devices: &[(DeviceKind, u64)]) -> Node {
        Node {
            name: name.into(),
            devices: devices
                .iter()
                .map(|&(kind, gb)| DeviceSlot {
                    kind,
                    memory_bytes: gb * GB,
                })
                .collect(),
        }
    }

    fn gpus(name: &str, sizes: &[u64]) -> Node {
        let devices: Vec<_> = sizes.iter().map(|&gb| (DeviceKind::Cuda, gb)).collect();
        mixed(name, &devices)
    }

    /// `place` for `kind`, checking that every slot it returns is a device of that kind; the
    /// slots as (node name, device index).
    fn placed(
        free: &Inventory,
        ranks: usize,
        kind: DeviceKind,
        gb: u64,
    ) -> Option<Vec<(&str, usize)>> {
        let slots = place(free, ranks, 0.0, kind, gb * GB)?;
        assert_eq!(slots.len(), ranks);
        for s in &slots {
            assert_eq!(free.nodes[s.node].devices[s.device].kind, kind, "{s:?}");
        }
        Some(
            slots
                .iter()
                .map(|s| (free.nodes[s.node].name.as_str(), s.device))
                .collect(),
        )
    }

    use DeviceKind::{Cpu, Cuda};

    #[test]
    fn a_cpu_node_beside_a_gpu_node_each_kind_takes_only_its_own() {
        let free = inv(vec![node("c", &[64, 64, 64, 64]), gpus("g", &[80, 80])]);
        assert_eq!(placed(&free, 2, Cuda, 30), Some(vec![("g", 0), ("g", 1)]));
        assert_eq!(
            placed(&free, 4, Cpu, 30),
            Some(vec![("c", 0), ("c", 1), ("c", 2), ("c", 3)])
        );
        assert_eq!(
            placed(&free, 3, Cuda, 30),
            None,
            "two GPUs, however many CPU devices would fit"
        );
    }

    #[test]
    fn a_node_with_both_kinds_gives_each_job_the_devices_of_its_kind() {
        let free = inv(vec![mixed(
            "m",
            &[(Cpu, 64), (Cuda, 80), (Cpu, 64), (Cuda, 80)],
        )]);
        assert_eq!(placed(&free, 2, Cuda, 30), Some(vec![("m", 1), ("m", 3)]));
        assert_eq!(placed(&free, 2, Cpu, 30), Some(vec![("m", 0), ("m", 2)]));
        assert_eq!(placed(&free, 3, Cuda, 30), None);
        assert_eq!(placed(&free, 3, Cpu, 30), None);
    }

    #[test]
    fn fewest_nodes_counts_only_devices_of_the_kind() {
        // The CPU node alone could hold three ranks; the GPU job spans the two GPU nodes,
        // the larger first.
        let free = inv(vec![
            gpus("g1", &[80]),
            node("c", &[200, 200, 200]),
            gpus("g2", &[80, 80]),
        ]);
        assert_eq!(
            placed(&free, 3, Cuda, 30),
            Some(vec![("g2", 0), ("g2", 1), ("g1", 0)])
        );
        assert_eq!(
            placed(&free, 3, Cpu, 30),
            Some(vec![("c", 0), ("c", 1), ("c", 2)])
        );
    }

    #[test]
    fn gpus_too_small_refuse_a_gpu_job_that_large_cpu_devices_would_hold() {
        let free = inv(vec![gpus("g", &[40, 40]), node("c", &[200, 200])]);
        assert_eq!(placed(&free, 2, Cuda, 50), None);
        assert_eq!(placed(&free, 2, Cpu, 50), Some(vec![("c", 0), ("c", 1)]));
        assert_eq!(placed(&free, 1, Cuda, 35), Some(vec![("g", 0)]));
    }

    #[test]
    fn best_fit_is_chosen_among_devices_of_the_kind() {
        // 41 GB of CPU would waste least for 35 GB, but the job is a GPU job: the 40 GB GPU.
        let free = inv(vec![
            mixed("m", &[(Cuda, 80), (Cpu, 41), (Cuda, 40)]),
            gpus("g", &[80]),
        ]);
        assert_eq!(placed(&free, 1, Cuda, 35), Some(vec![("m", 2)]));
        assert_eq!(placed(&free, 1, Cpu, 35), Some(vec![("m", 1)]));
    }

    #[test]
    fn a_job_spans_a_mixed_node_and_a_gpu_node_only_through_their_gpus() {
        let free = inv(vec![
            mixed("m", &[(Cpu, 64), (Cuda, 80), (Cpu, 64)]),
            gpus("g", &[80]),
        ]);
        assert_eq!(placed(&free, 2, Cuda, 30), Some(vec![("m", 1), ("g", 0)]));
        assert_eq!(placed(&free, 2, Cpu, 30), Some(vec![("m", 0), ("m", 2)]));
    }

    #[test]
    fn a_kind_absent_from_the_cluster_places_nothing() {
        let cpus_only = inv(vec![node("a", &[64, 64]), node("b", &[64])]);
        assert_eq!(placed(&cpus_only, 1, Cuda, 1), None);
        let gpus_only = inv(vec![gpus("a", &[80, 80]), gpus("b", &[80])]);
        assert_eq!(placed(&gpus_only, 1, Cpu, 1), None);
        assert_eq!(placed(&gpus_only, 3, Cuda, 1).map(|s| s.len()), Some(3));
    }

    #[test]
    fn the_margin_applies_to_the_devices_of_the_kind() {
        let free = inv(vec![mixed("m", &[(Cuda, 32), (Cpu, 100)])]);
        assert!(place(&free, 1, 0.0, Cuda, 30 * GB).is_some());
        assert!(
            place(&free, 1, 0.1, Cuda, 30 * GB).is_none(),
            "30 GB > 90% of the 32 GB GPU; the CPU device is no substitute"
        );
    }
}
