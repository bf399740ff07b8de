//! The GPUs an agent offers. They are found through the CUDA driver API (feature `cuda`, through
//! cudarc, which the trainer loads anyway) rather than NVML: the driver's ordinals are the ones
//! the ranks open (NVML numbers GPUs in PCI order, which `CUDA_VISIBLE_DEVICES` and the
//! driver's own order need not follow), and it gives each GPU's name, UUID and total memory
//! without another library. NVML alone would add utilization, which agents do not export.
//!
//! Each chosen GPU is registered as a `cuda` device of its total memory: the scheduler takes the
//! CUDA overhead (`scheduler::memory::CUDA_OVERHEAD_BYTES`) and the safety margin off that
//! itself, so what a rank may hold is the total less both.

use std::str::FromStr;

use scheduler::inventory::DeviceSlot;
use scheduler::memory::DeviceKind;

use crate::Error;

pub use kernels::gpu::Gpu;

/// The device the agent registers for `gpu`.
pub fn device(gpu: &Gpu) -> DeviceSlot {
    DeviceSlot {
        kind: DeviceKind::Cuda,
        memory_bytes: gpu.total_bytes,
    }
}

/// What the driver says is here: the GPUs, or why there are none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovery {
    pub gpus: Vec<Gpu>,
    /// Why no GPU was found, when none was (no driver, a build without CUDA, no device).
    pub none_because: Option<String>,
}

/// The GPUs the driver sees.
pub fn discover() -> Discovery {
    let found = kernels::cuda::gpus::discover().map_err(|e| e.to_string());
    match found {
        Ok(gpus) if gpus.is_empty() => Discovery {
            gpus,
            none_because: Some("the CUDA driver reports no device".into()),
        },
        Ok(gpus) => Discovery {
            gpus,
            none_because: None,
        },
        Err(why) => Discovery {
            gpus: Vec::new(),
            none_because: Some(why),
        },
    }
}

/// Which GPUs to offer: `all` present (the default), `none`, or ordinals `0,1,…`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Selection {
    #[default]
    All,
    None,
    Only(Vec<usize>),
}

impl FromStr for Selection {
    type Err = String;
    fn from_str(s: &str) -> Result<Selection, String> {
        match s.trim() {
            "all" => Ok(Selection::All),
            "none" => Ok(Selection::None),
            list => {
                let mut ordinals = list
                    .split(',')
                    .map(|o| o.trim().parse::<usize>())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| format!("{s:?}: expected all, none or GPU ordinals like 0,1"))?;
                ordinals.sort_unstable();
                if ordinals.windows(2).any(|w| w[0] == w[1]) {
                    return Err(format!(
                        "{s:?} names a GPU twice: two ranks never share one"
                    ));
                }
                Ok(Selection::Only(ordinals))
            }
        }
    }
}

impl Selection {
    /// The GPUs of `found` this selection offers, in ordinal order; an ordinal it names that
    /// is not there is an error (a typo must not turn a GPU node into a CPU one).
    pub fn pick(&self, found: &Discovery) -> Result<Vec<Gpu>, Error> {
        match self {
            Selection::All => Ok(found.gpus.clone()),
            Selection::None => Ok(Vec::new()),
            Selection::Only(ordinals) => ordinals
                .iter()
                .map(|&o| {
                    found
                        .gpus
                        .iter()
                        .find(|g| g.ordinal == o)
                        .cloned()
                        .ok_or_else(|| Error::Device(absent(o, found)))
                })
                .collect(),
        }
    }
}

fn absent(ordinal: usize, found: &Discovery) -> String {
    match &found.none_because {
        Some(why) => format!("--gpus names GPU {ordinal}, but no GPUs were found: {why}"),
        None => format!(
            "--gpus names GPU {ordinal}, but the driver sees only {}",
            found
                .gpus
                .iter()
                .map(|g| g.ordinal.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_gpus() -> Discovery {
        let gpu = |ordinal| Gpu {
            ordinal,
            name: "NVIDIA H200".into(),
            uuid: format!("GPU-{ordinal}"),
            total_bytes: 150_000_000_000,
        };
        Discovery {
            gpus: vec![gpu(0), gpu(1)],
            none_because: None,
        }
    }

    #[test]
    fn selections_parse_and_pick_gpus_by_ordinal() {
        let found = two_gpus();
        let pick = |s: &str| s.parse::<Selection>().unwrap().pick(&found).unwrap();
        assert_eq!(pick("all"), found.gpus);
        assert_eq!(pick("none"), vec![]);
        assert_eq!(pick("1"), vec![found.gpus[1].clone()]);
        assert_eq!(pick(" 1,0 "), found.gpus, "in ordinal order");
        assert!("0,0".parse::<Selection>().unwrap_err().contains("twice"));
        assert!("gpu0".parse::<Selection>().is_err());
        let err = "2".parse::<Selection>().unwrap().pick(&found).unwrap_err();
        assert!(err.to_string().contains("sees only 0, 1"), "{err}");
    }

    #[test]
    fn a_gpu_registers_as_a_cuda_device_of_its_total_memory() {
        let d = device(&two_gpus().gpus[0]);
        assert_eq!(d.kind, DeviceKind::Cuda);
        assert_eq!(d.memory_bytes, 150_000_000_000);
    }

    /// Without a driver (CI and the development machines) nothing is found, with the reason,
    /// built with `cuda` or not, and `all` offers nothing; on a GPU machine `all` offers what
    /// the driver sees.
    #[test]
    fn without_a_driver_no_gpus_are_found_and_none_are_offered() {
        let found = discover();
        if !found.gpus.is_empty() {
            assert_eq!(found.none_because, None);
            assert_eq!(Selection::All.pick(&found).unwrap(), found.gpus);
            return;
        }
        let why = found.none_because.clone().unwrap();
        if cfg!(feature = "cuda") {
            assert!(why.contains("no CUDA driver found"), "{why}");
        } else {
            assert!(why.contains("built without CUDA support"), "{why}");
        }
        assert_eq!(Selection::All.pick(&found).unwrap(), vec![]);
        let err = Selection::Only(vec![0]).pick(&found).unwrap_err();
        assert!(err.to_string().contains("no GPUs were found"), "{err}");
    }
}
