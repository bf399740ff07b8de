//! The collectives, by the names the agent protocol and the metrics use.

use serde::{Deserialize, Serialize};

/// A collective between the data-parallel ranks, for counting what each one sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Barrier,
}

impl Op {
    pub const ALL: [Op; 5] = [
        Op::AllReduce,
        Op::ReduceScatter,
        Op::AllGather,
        Op::Broadcast,
        Op::Barrier,
    ];

    /// The name on the wire (and the `op` label of the comm-bytes counter).
    pub fn as_str(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Op;

    #[test]
    fn each_op_serializes_as_its_name() {
        for op in Op::ALL {
            let json = serde_json::to_string(&op).unwrap();
            assert_eq!(json, format!("\"{}\"", op.as_str()));
            assert_eq!(serde_json::from_str::<Op>(&json).unwrap(), op);
        }
    }
}
