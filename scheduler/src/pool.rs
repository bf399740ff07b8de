//! The free devices of a scheduling pass, indexed so that placing many jobs one after another
//! makes exactly the choices [`placement::place`](crate::placement::place) makes for each job on
//! what is still free, without looking at every device for every job.
//!
//! Devices of one kind and memory are a *class*; nodes whose free devices are the same classes
//! in the same numbers share a *profile*. Whether a job fits a node, how many of its ranks fit
//! and how much memory they leave over depend only on the profile, so a job is matched against
//! the few profiles (a handful of classes, at most one more profile per free count) instead of
//! the many nodes, and only the nodes it takes are looked at.

use std::collections::BTreeSet;

use crate::inventory::{DeviceSlot, Inventory};
use crate::memory::DeviceKind;
use crate::placement::Slot;

#[derive(Debug, Clone, Default)]
pub struct Pool {
    /// The distinct devices (kind and memory) of every node.
    classes: Vec<DeviceSlot>,
    /// Per node, in the order added: each device's class and whether it is still free.
    nodes: Vec<Vec<(usize, bool)>>,
    /// Each node's profile, an index into `profiles`.
    profile_of: Vec<usize>,
    profiles: Vec<Profile>,
    free: usize,
}

#[derive(Debug, Clone)]
struct Profile {
    /// Free devices per class, by class; classes with none left out.
    counts: Vec<(usize, usize)>,
    /// The nodes with this profile, by position.
    nodes: BTreeSet<usize>,
}

/// What one job asks of a class of devices: nothing when it does not fit, or the bytes a rank
/// leaves unused on it.
type Leftover = Option<u64>;

impl Pool {
    /// Adds a node with `devices` free; its slots are `Slot { node: i, device: j }` with `i` the
    /// number of nodes added before it and `j` the position in `devices`. Nodes added earlier win
    /// ties, as earlier nodes of an inventory do.
    pub fn add_node(&mut self, devices: impl IntoIterator<Item = DeviceSlot>) -> usize {
        let node = self.nodes.len();
        let entries: Vec<(usize, bool)> =
            devices.into_iter().map(|d| (self.class(d), true)).collect();
        self.free += entries.len();
        self.nodes.push(entries);
        self.profile_of.push(usize::MAX);
        self.reprofile(node);
        node
    }

    /// Whether every device has been taken.
    pub fn is_empty(&self) -> bool {
        self.free == 0
    }

    /// Places `world_size` (≥ 1) ranks on devices of `kind` as
    /// [`place`](crate::placement::place) would on the devices still free, and takes the devices it returns out of the pool.
    pub fn place(
        &mut self,
        world_size: usize,
        margin: f64,
        kind: DeviceKind,
        need: u64,
    ) -> Option<Vec<Slot>> {
        if world_size > self.free {
            return None;
        }
        let leftover: Vec<Leftover> = self
            .classes
            .iter()
            .map(|d| {
                let usable = (d.memory_bytes as f64 * (1.0 - margin)) as u64;
                (d.kind == kind && need <= usable).then(|| d.memory_bytes - need)
            })
            .collect();
        let slots = self
            .on_one_node(world_size, &leftover)
            .or_else(|| self.on_fewest_nodes(world_size, &leftover))?;
        self.take(&slots);
        Some(slots)
    }

    /// The node that holds every rank wasting least (the first such node on a tie).
    fn on_one_node(&self, world_size: usize, leftover: &[Leftover]) -> Option<Vec<Slot>> {
        let (_, node) = self
            .profiles
            .iter()
            .filter_map(|p| {
                let first = *p.nodes.first()?;
                let mut fitting: Vec<(u64, usize)> = p
                    .counts
                    .iter()
                    .filter_map(|&(class, count)| Some((leftover[class]?, count)))
                    .collect();
                if fitting.iter().map(|&(_, n)| n).sum::<usize>() < world_size {
                    return None;
                }
                fitting.sort_unstable();
                let mut waste = 0u64;
                let mut left = world_size;
                for (bytes, count) in fitting {
                    let n = count.min(left);
                    waste += bytes * n as u64;
                    left -= n;
                }
                Some((waste, first))
            })
            .min()?;
        Some(self.best_devices(node, world_size, leftover))
    }

    /// Nodes by most fitting devices (then position), each giving as many ranks as it holds.
    fn on_fewest_nodes(&self, world_size: usize, leftover: &[Leftover]) -> Option<Vec<Slot>> {
        // Fitting devices per node of each profile.
        let fits: Vec<usize> = self
            .profiles
            .iter()
            .map(|p| {
                p.counts
                    .iter()
                    .filter(|&&(class, _)| leftover[class].is_some())
                    .map(|&(_, count)| count)
                    .sum()
            })
            .collect();
        let total: usize = fits
            .iter()
            .zip(&self.profiles)
            .map(|(fit, p)| fit * p.nodes.len())
            .sum();
        if total < world_size {
            return None;
        }
        let mut levels: Vec<usize> = fits.iter().copied().filter(|&f| f > 0).collect();
        levels.sort_unstable_by(|a, b| b.cmp(a));
        levels.dedup();
        let mut slots = Vec::with_capacity(world_size);
        for level in levels {
            let wanted = (world_size - slots.len()).div_ceil(level);
            // The first `wanted` nodes of this level, across its profiles, by position.
            let mut nodes: Vec<usize> = self
                .profiles
                .iter()
                .zip(&fits)
                .filter(|&(_, &fit)| fit == level)
                .flat_map(|(p, _)| p.nodes.iter().copied().take(wanted))
                .collect();
            nodes.sort_unstable();
            for node in nodes.into_iter().take(wanted) {
                let count = (world_size - slots.len()).min(level);
                slots.extend(self.best_devices(node, count, leftover));
            }
            if slots.len() == world_size {
                return Some(slots);
            }
        }
        None
    }

    /// The `count` free devices of `node` that fit with the least left over (then by position).
    fn best_devices(&self, node: usize, count: usize, leftover: &[Leftover]) -> Vec<Slot> {
        let mut fitting: Vec<(u64, usize)> = self.nodes[node]
            .iter()
            .enumerate()
            .filter(|(_, (_, free))| *free)
            .filter_map(|(i, &(class, _))| Some((leftover[class]?, i)))
            .collect();
        fitting.sort_unstable();
        fitting
            .into_iter()
            .take(count)
            .map(|(_, device)| Slot { node, device })
            .collect()
    }

    fn take(&mut self, slots: &[Slot]) {
        for s in slots {
            self.nodes[s.node][s.device].1 = false;
        }
        self.free -= slots.len();
        let mut nodes: Vec<usize> = slots.iter().map(|s| s.node).collect();
        nodes.dedup();
        for node in nodes {
            self.reprofile(node);
        }
    }

    fn class(&mut self, device: DeviceSlot) -> usize {
        match self.classes.iter().position(|c| *c == device) {
            Some(i) => i,
            None => {
                self.classes.push(device);
                self.classes.len() - 1
            }
        }
    }

    /// Moves `node` to the profile of its free devices now.
    fn reprofile(&mut self, node: usize) {
        let mut counts: Vec<(usize, usize)> = Vec::new();
        for &(class, free) in &self.nodes[node] {
            if !free {
                continue;
            }
            match counts.iter_mut().find(|(c, _)| *c == class) {
                Some((_, n)) => *n += 1,
                None => counts.push((class, 1)),
            }
        }
        counts.sort_unstable();
        if let Some(old) = self.profiles.get_mut(self.profile_of[node]) {
            old.nodes.remove(&node);
        }
        let profile = match self.profiles.iter().position(|p| p.counts == counts) {
            Some(p) => p,
            None => {
                self.profiles.push(Profile {
                    counts,
                    nodes: BTreeSet::new(),
                });
                self.profiles.len() - 1
            }
        };
        self.profiles[profile].nodes.insert(node);
        self.profile_of[node] = profile;
    }
}

impl From<&Inventory> for Pool {
    fn from(inventory: &Inventory) -> Pool {
        let mut pool = Pool::default();
        for node in &inventory.nodes {
            pool.add_node(node.devices.iter().copied());
        }
        pool
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::inventory::Node;
    use crate::placement::place;

    const GB: u64 = 1_000_000_000;

    /// A job as (ranks, GB per rank, kind).
    type Job = (usize, u64, DeviceKind);

    /// A node per entry, each device (kind, GB).
    fn inventory(nodes: &[Vec<(DeviceKind, u64)>]) -> Inventory {
        Inventory {
            nodes: nodes
                .iter()
                .enumerate()
                .map(|(i, devices)| Node {
                    name: format!("n{i}"),
                    devices: devices
                        .iter()
                        .map(|&(kind, gb)| DeviceSlot {
                            kind,
                            memory_bytes: gb * GB,
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    /// `place` run job after job on an inventory, taking the devices each placement uses out of
    /// it as a pass does: the slots as positions in the inventory first given.
    fn reference(inventory: &Inventory, jobs: &[Job], margin: f64) -> Vec<Option<Vec<Slot>>> {
        let mut free = inventory.clone();
        let mut original: Vec<Vec<usize>> = free
            .nodes
            .iter()
            .map(|n| (0..n.devices.len()).collect())
            .collect();
        jobs.iter()
            .map(|&(ranks, gb, kind)| {
                let slots = place(&free, ranks, margin, kind, gb * GB)?;
                let mapped: Vec<Slot> = slots
                    .iter()
                    .map(|s| Slot {
                        node: s.node,
                        device: original[s.node][s.device],
                    })
                    .collect();
                let mut taken: Vec<(usize, usize)> =
                    slots.iter().map(|s| (s.node, s.device)).collect();
                taken.sort_unstable_by(|a, b| b.cmp(a));
                for (node, device) in taken {
                    free.nodes[node].devices.remove(device);
                    original[node].remove(device);
                }
                Some(mapped)
            })
            .collect()
    }

    fn pooled(inventory: &Inventory, jobs: &[Job], margin: f64) -> Vec<Option<Vec<Slot>>> {
        let mut pool = Pool::from(inventory);
        jobs.iter()
            .map(|&(ranks, gb, kind)| pool.place(ranks, margin, kind, gb * GB))
            .collect()
    }

    #[test]
    fn a_pass_over_a_cluster_makes_the_choices_of_place() {
        let nodes: Vec<Vec<(DeviceKind, u64)>> = (0..40)
            .map(|n| match n % 4 {
                0 => vec![(DeviceKind::Cuda, 80); 8],
                1 => vec![(DeviceKind::Cuda, 40); 8],
                2 => vec![(DeviceKind::Cpu, 16), (DeviceKind::Cpu, 32)],
                _ => vec![(DeviceKind::Cuda, 80), (DeviceKind::Cuda, 40)],
            })
            .collect();
        let inventory = inventory(&nodes);
        let jobs: Vec<Job> = (0..400)
            .map(|i| {
                let kind = if i % 3 == 0 {
                    DeviceKind::Cpu
                } else {
                    DeviceKind::Cuda
                };
                (
                    [1, 2, 4, 8, 16, 3, 64][i % 7],
                    [4, 10, 30, 35, 70][i % 5],
                    kind,
                )
            })
            .collect();
        let want = reference(&inventory, &jobs, 0.05);
        assert!(want.iter().filter(|p| p.is_some()).count() > 20);
        assert_eq!(pooled(&inventory, &jobs, 0.05), want);
    }

    #[test]
    fn the_pool_empties_and_then_places_nothing() {
        let mut pool = Pool::from(&inventory(&[vec![(DeviceKind::Cpu, 16); 2]]));
        assert!(!pool.is_empty());
        assert_eq!(
            pool.place(2, 0.0, DeviceKind::Cpu, GB).map(|s| s.len()),
            Some(2)
        );
        assert!(pool.is_empty());
        assert_eq!(pool.place(1, 0.0, DeviceKind::Cpu, GB), None);
    }

    fn kind() -> impl Strategy<Value = DeviceKind> {
        prop_oneof![Just(DeviceKind::Cpu), Just(DeviceKind::Cuda)]
    }

    proptest! {
        #[test]
        fn any_pass_makes_the_choices_of_place(
            nodes in prop::collection::vec(
                prop::collection::vec((kind(), prop_oneof![Just(16u64), Just(24), Just(40)]), 0..6),
                0..12,
            ),
            jobs in prop::collection::vec((1usize..12, 1u64..40, kind()), 1..40),
            margin in prop_oneof![Just(0.0), Just(0.05), Just(0.3)],
        ) {
            let inventory = inventory(&nodes);
            prop_assert_eq!(
                pooled(&inventory, &jobs, margin),
                reference(&inventory, &jobs, margin)
            );
        }
    }
}
