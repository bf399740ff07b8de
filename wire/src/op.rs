//! The collectives, by the names the agent protocol and the metrics use.

use serde::{Deserialize, Serialize};
use strum::{IntoStaticStr, VariantArray};

/// A collective between the data-parallel ranks, for counting what each one sends.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    IntoStaticStr,
    VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Barrier,
}

impl Op {
    pub const ALL: &[Op] = <Op as VariantArray>::VARIANTS;

    /// The name on the wire (and the `op` label of the comm-bytes counter).
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

#[cfg(test)]
mod tests {
    use super::Op;
    use crate::agent::RefusalReason;

    #[test]
    fn strum_names_are_serde_names() {
        for &op in Op::ALL {
            let json = serde_json::to_string(&op).unwrap();
            assert_eq!(json, format!("\"{}\"", op.as_str()));
            assert_eq!(serde_json::from_str::<Op>(&json).unwrap(), op);
        }
        for &r in RefusalReason::ALL {
            assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
        }
    }
}
