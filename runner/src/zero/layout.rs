//! Which elements of each unit's flat buffers one rank holds, decided once from the stage and
//! the world size. Each part (parameters, gradients, optimizer state) is kept either whole or
//! as the rank's shard, and the sharded parts nest: a stage that shards the parameters also
//! shards the gradients, and one that shards the gradients also shards the optimizer state.

use std::ops::Range;

use scheduler::model::Units;
use scheduler::spec::ZeroStage;

/// The per-unit buffers whose holding the stage decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The parameters in the compute dtype.
    Params,
    /// The gradients kept across micro-batches.
    Grads,
    /// fp32 master weights and optimizer states: the range this rank updates.
    State,
}

impl Part {
    const ALL: [Part; 3] = [Part::Params, Part::Grads, Part::State];

    fn sharded_at(self, stage: ZeroStage) -> bool {
        match self {
            Part::Params => stage.shards_params(),
            Part::Grads => stage.shards_grads(),
            Part::State => stage.shards_optimizer(),
        }
    }
}

/// One rank's holding of every unit: per part, sharded or not, and per unit the element range
/// of the unit each part's buffer covers.
#[derive(Debug, Clone)]
pub(crate) struct ShardLayout {
    sharded: [bool; 3],
    /// Per unit, per part (in `Part::ALL` order): the held range, in unit elements.
    held: Vec<[Range<usize>; 3]>,
}

impl ShardLayout {
    pub(crate) fn new<K>(stage: ZeroStage, units: &Units<K>, rank: usize) -> ShardLayout {
        let sharded = Part::ALL.map(|p| p.sharded_at(stage));
        let held = units
            .iter()
            .map(|u| {
                sharded.map(|s| {
                    if s {
                        u.shard_range(rank)
                    } else {
                        0..u.padded_len
                    }
                })
            })
            .collect();
        ShardLayout { sharded, held }
    }

    /// Whether `part` is this rank's shard rather than the whole unit.
    pub(crate) fn sharded(&self, part: Part) -> bool {
        self.sharded[part as usize]
    }

    /// The elements of unit `u` that `part`'s buffer holds.
    pub(crate) fn held(&self, part: Part, u: usize) -> Range<usize> {
        self.held[u][part as usize].clone()
    }

    /// The length of `part`'s buffer of each unit, in unit order.
    pub(crate) fn held_lens(&self, part: Part) -> impl Iterator<Item = usize> + '_ {
        self.held.iter().map(move |h| h[part as usize].len())
    }

    /// Where in `outer`'s buffer of unit `u` the elements `part` holds lie (`part` holds no
    /// more than `outer` does).
    pub(crate) fn held_within(&self, part: Part, outer: Part, u: usize) -> Range<usize> {
        let (inner, outer) = (self.held(part, u), self.held(outer, u));
        debug_assert!(outer.start <= inner.start && inner.end <= outer.end);
        inner.start - outer.start..inner.end - outer.start
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use scheduler::model::Preset;

    #[test]
    fn each_part_is_whole_or_split_among_the_ranks_and_the_parts_nest() {
        let world = 4;
        let units = Units::new(&Preset::Tiny.shape(), world);
        for stage in ZeroStage::ALL {
            let layouts: Vec<_> = (0..world)
                .map(|r| ShardLayout::new(stage, &units, r))
                .collect();
            for (u, unit) in units.iter().enumerate() {
                for part in Part::ALL {
                    let mut covered = vec![0usize; unit.padded_len];
                    for l in &layouts {
                        covered[l.held(part, u)].iter_mut().for_each(|c| *c += 1);
                    }
                    let holders = if part.sharded_at(stage) { 1 } else { world };
                    assert!(
                        covered.iter().all(|&c| c == holders),
                        "{stage:?} {part:?} unit {u}"
                    );
                }
                for l in &layouts {
                    let [params, grads, state] = Part::ALL.map(|p| l.held(p, u));
                    assert!(params.start <= grads.start && grads.end <= params.end);
                    assert!(grads.start <= state.start && state.end <= grads.end);
                }
            }
        }
    }
}
