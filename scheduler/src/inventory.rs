//! The devices jobs can be placed on: nodes, each with devices of some kind and free memory.

use serde::{Deserialize, Serialize};

use crate::memory::DeviceKind;

/// One device of a node as the planner sees it: its kind and the memory a rank may use there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSlot {
    pub kind: DeviceKind,
    /// Memory a rank may use on this device.
    pub memory_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    pub devices: Vec<DeviceSlot>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Inventory {
    pub nodes: Vec<Node>,
}

impl Inventory {
    /// One node with `count` identical devices.
    pub fn uniform(count: usize, memory_bytes: u64, kind: DeviceKind) -> Inventory {
        Inventory {
            nodes: vec![Node {
                name: "node-0".into(),
                devices: vec![DeviceSlot { kind, memory_bytes }; count],
            }],
        }
    }

    pub fn devices(&self) -> impl Iterator<Item = &DeviceSlot> {
        self.nodes.iter().flat_map(|n| &n.devices)
    }
}
