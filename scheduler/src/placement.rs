//! Gang placement: all ranks of a job at once, or none. Fewest nodes first (a ring that stays
//! inside a node is cheapest), then best fit: the devices whose free memory exceeds the need
//! by the least, so large devices stay free for large jobs. Consecutive ranks share a node.
//! `place` is the plain statement of the rule, for one job; a scheduling pass places job after
//! job with [`Pool`](crate::pool::Pool), which makes the same choices faster.

use serde::Serialize;

use crate::inventory::{Device, Inventory};
use crate::memory::DeviceKind;

/// Where one rank runs: indices into the inventory's nodes and that node's devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Slot {
    pub node: usize,
    pub device: usize,
}

/// Places `world_size` ranks on devices of `free` (devices not running anything) that hold
/// `need(kind)` bytes plus `margin` of their memory; `None` when they do not all fit now.
/// `margin` is a fraction (0.05 keeps 5% of each device free).
pub fn place(
    free: &Inventory,
    world_size: usize,
    margin: f64,
    need: impl Fn(DeviceKind) -> u64,
) -> Option<Vec<Slot>> {
    let fits = |d: &Device| {
        let usable = (d.memory_bytes as f64 * (1.0 - margin)) as u64;
        need(d.kind) <= usable
    };
    let leftover = |d: &Device| d.memory_bytes - need(d.kind);
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
                .map(|&gb| Device {
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
        let slots = place(&free, 4, 0.0, |_| 30 * GB).unwrap();
        assert!(slots.iter().all(|s| s.node == 1), "{slots:?}");
    }

    #[test]
    fn prefers_the_node_that_wastes_least() {
        let free = inv(vec![node("big", &[80, 80]), node("snug", &[32, 32])]);
        let slots = place(&free, 2, 0.0, |_| 30 * GB).unwrap();
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
        let slots = place(&free, 5, 0.0, |_| 30 * GB).unwrap();
        let nodes: Vec<usize> = slots.iter().map(|s| s.node).collect();
        assert_eq!(nodes, vec![1, 1, 1, 2, 2]);
    }

    #[test]
    fn places_nothing_unless_every_rank_fits() {
        let free = inv(vec![node("a", &[40, 20]), node("b", &[20])]);
        assert!(place(&free, 2, 0.0, |_| 30 * GB).is_none());
        assert_eq!(
            place(&free, 1, 0.0, |_| 30 * GB).unwrap(),
            vec![Slot { node: 0, device: 0 }]
        );
    }

    #[test]
    fn the_safety_margin_keeps_part_of_each_device_free() {
        let free = inv(vec![node("a", &[32])]);
        assert!(place(&free, 1, 0.0, |_| 30 * GB).is_some());
        assert!(
            place(&free, 1, 0.1, |_| 30 * GB).is_none(),
            "30 GB > 90% of 32 GB"
        );
    }

    #[test]
    fn device_kinds_pay_their_own_overhead() {
        let mut gpu = node("gpu", &[31]);
        gpu.devices[0].kind = DeviceKind::Cuda;
        let free = inv(vec![gpu, node("cpu", &[31])]);
        let slots = place(&free, 1, 0.0, |k| 30 * GB + k.overhead_bytes()).unwrap();
        assert_eq!(slots[0].node, 1, "the GPU loses 1 GiB to its runtime");
    }
}
