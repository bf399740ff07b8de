//! Low-rank adapters (LoRA, QLoRA) as PEFT defines them: each adapted linear projection
//! `y = x·Wᵀ` becomes `y = x·Wᵀ + (alpha/rank)·dropout(x)·Aᵀ·Bᵀ`, with A `[rank, in]` and
//! B `[out, rank]` trainable and W frozen. This module lays out what such a job holds, for the
//! memory model and the trainer alike: the adapters as trainable units (one per block, sharded
//! as any unit), the frozen base as units that hold weights only, and, for QLoRA, the adapted
//! projections' weights in bitsandbytes' NF4 form.
//!
//! What a step keeps beyond full fine-tuning's tensors (whose saved projection inputs are the
//! adapters' inputs too): per adapted projection the rank-sized `dropout(x)·Aᵀ` that B's
//! gradient reads; one rank-sized gradient scratch; with dropout, one scratch for the dropped
//! input of the widest projection, which backward also uses for that input's gradient before
//! the mask (drawn again from the seed, never stored); with NF4, one projection's dequantized
//! weight.

use super::params::{TensorDims, TensorInit, UnitKind, Units};
use super::{ModelShape, ModelTensor};
use crate::kernel_figures::NF4_BLOCK;
use crate::model::{LlamaTensor, TensorKind};

/// A linear projection of a block that an adapter can attach to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Projection {
    /// PEFT's module name (`q_proj`, `c_attn`).
    pub name: &'static str,
    /// The module's path within a block (`self_attn.q_proj`, `mlp.c_proj`): what tells
    /// GPT-2's two `c_proj` apart.
    pub path: &'static str,
    /// The frozen weight.
    pub weight: ModelTensor,
    pub in_features: usize,
    pub out_features: usize,
}

impl ModelShape {
    /// Every linear projection of a block, in state-dict order: PEFT's `"all-linear"` (the LM
    /// head, the output layer, is never adapted).
    pub fn projections(&self) -> Vec<Projection> {
        let matrix = |t: ModelTensor, d: TensorDims| match d {
            TensorDims::Matrix(r, c) => (t, r, c),
            TensorDims::Vector(_) => unreachable!("{t:?} is a matrix"),
        };
        match self {
            // GPT-2's Conv1D weights are (in, out) (PEFT's `fan_in_fan_out`).
            ModelShape::Gpt2(s) => [
                ("c_attn", "attn.c_attn", TensorKind::AttnWeight),
                ("c_proj", "attn.c_proj", TensorKind::AttnProjWeight),
                ("c_fc", "mlp.c_fc", TensorKind::FcWeight),
                ("c_proj", "mlp.c_proj", TensorKind::FcProjWeight),
            ]
            .into_iter()
            .map(|(name, path, k)| {
                let (weight, rows, cols) = matrix(ModelTensor::Gpt2(k), k.dims(s));
                Projection {
                    name,
                    path,
                    weight,
                    in_features: rows,
                    out_features: cols,
                }
            })
            .collect(),
            ModelShape::Llama(s) => [
                ("q_proj", "self_attn.q_proj", LlamaTensor::QProj),
                ("k_proj", "self_attn.k_proj", LlamaTensor::KProj),
                ("v_proj", "self_attn.v_proj", LlamaTensor::VProj),
                ("o_proj", "self_attn.o_proj", LlamaTensor::OProj),
                ("gate_proj", "mlp.gate_proj", LlamaTensor::GateProj),
                ("up_proj", "mlp.up_proj", LlamaTensor::UpProj),
                ("down_proj", "mlp.down_proj", LlamaTensor::DownProj),
            ]
            .into_iter()
            .map(|(name, path, k)| {
                let (weight, rows, cols) = matrix(ModelTensor::Llama(k), k.dims(s));
                Projection {
                    name,
                    path,
                    weight,
                    in_features: cols,
                    out_features: rows,
                }
            })
            .collect(),
        }
    }

    /// PEFT's `target_modules` when a config names none
    /// (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
    pub fn default_lora_targets(&self) -> &'static [&'static str] {
        match self {
            ModelShape::Gpt2(_) => &["c_attn"],
            ModelShape::Llama(_) => &["q_proj", "v_proj"],
        }
    }
}

/// Which of a model's [`ModelShape::projections`] carry adapters: bit `i` for the `i`-th.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Targets(u8);

impl Targets {
    pub fn all(model: &ModelShape) -> Targets {
        Targets((1u8 << model.projections().len()) - 1)
    }

    /// The projections any of PEFT `target_modules` `entries` selects in some layer: PEFT
    /// targets a module whose full name is the entry or ends with `.` and the entry, so `c_proj`
    /// is both of GPT-2's, `mlp.c_proj` one of them, and `model.layers.0.self_attn.q_proj` (as
    /// PEFT saves an expanded `"all-linear"`) layer 0's queries.
    pub fn matching(model: &ModelShape, entries: &[&str]) -> Targets {
        let bits = model
            .projections()
            .iter()
            .enumerate()
            .filter(|(_, p)| p.layers_matching(model, entries).contains(&true))
            .fold(0u8, |bits, (i, _)| bits | 1 << i);
        Targets(bits)
    }

    /// The projections that `entries` together select in some layers but not in all (an
    /// adapter is held for every layer or none), with the layers they do select.
    pub fn partial(model: &ModelShape, entries: &[&str]) -> Vec<(&'static str, Vec<usize>)> {
        model
            .projections()
            .iter()
            .filter_map(|p| {
                let hits = p.layers_matching(model, entries);
                let some: Vec<usize> = (0..hits.len()).filter(|&l| hits[l]).collect();
                (!some.is_empty() && some.len() < hits.len()).then_some((p.path, some))
            })
            .collect()
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The selected projections of `model`, in state-dict order.
    pub fn of(self, model: &ModelShape) -> Vec<Projection> {
        model
            .projections()
            .into_iter()
            .enumerate()
            .filter(|(i, _)| self.0 & (1 << i) != 0)
            .map(|(_, p)| p)
            .collect()
    }
}

/// How a frozen projection weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BaseStorage {
    /// In the compute dtype, as the rest of the base.
    Compute,
    /// bitsandbytes' NF4 (`kernel_figures::nf4_bytes`).
    Nf4,
}

/// A resolved `lora` block: what the layout, the memory model and the trainer need of it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adapters {
    pub rank: usize,
    /// PEFT's `scaling`, `alpha / rank`: what the adapters' product is multiplied by.
    pub scaling: f32,
    pub targets: Targets,
    /// The probability that dropout zeroes an element of the adapters' input (0: none).
    pub dropout: f32,
    pub base: BaseStorage,
}

/// One adapter matrix: A `[rank, in]` or B `[out, rank]` of the projection whose frozen weight
/// is `weight`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AdapterTensor {
    pub weight: ModelTensor,
    pub part: AdapterPart,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AdapterPart {
    A,
    B,
}

impl AdapterTensor {
    /// The tensor's name in PEFT's `adapter_model.safetensors` for layer `layer`
    /// (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`).
    pub fn peft_name(self, layer: usize) -> String {
        let module = module_name(self.weight, layer);
        format!("base_model.model.{module}.{}.weight", self.part.peft_name())
    }

    /// PEFT's initialisation (`init_lora_weights=True`): A Kaiming-uniform with `a = √5`,
    /// which is uniform in ±1/√in; B zero, so that training starts from the base model.
    pub fn init(self, model: &ModelShape) -> TensorInit {
        match self.part {
            AdapterPart::B => TensorInit::Zeros,
            AdapterPart::A => {
                let p = model
                    .projections()
                    .into_iter()
                    .find(|p| p.weight == self.weight);
                let inputs = p
                    .expect("an adapter's projection is the model's")
                    .in_features;
                TensorInit::Uniform {
                    bound: 1.0 / (inputs as f64).sqrt(),
                }
            }
        }
    }
}

impl AdapterPart {
    /// PEFT's name of the matrix (`lora_A`, `lora_B`).
    pub fn peft_name(self) -> &'static str {
        match self {
            AdapterPart::A => "lora_A",
            AdapterPart::B => "lora_B",
        }
    }
}

/// A part of a block's NF4 store, whose elements are bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Nf4Part {
    /// Two 4-bit codes a byte.
    Codes(ModelTensor),
    /// One fp32 absmax per [`NF4_BLOCK`] values, as 4 bytes each.
    Absmax(ModelTensor),
}

/// Everything a LoRA job holds of its model, laid out for `world_size` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraLayout {
    /// Trainable: one unit per block with A and B of each adapted projection.
    pub adapters: Units<AdapterTensor>,
    /// Frozen, in the compute dtype: every tensor of the model but NF4-stored weights.
    pub base: Units<ModelTensor>,
    /// Frozen NF4 weights, one unit of bytes per block (every adapted projection's absmax,
    /// then their codes); empty unless `BaseStorage::Nf4`.
    pub nf4: Units<Nf4Part>,
}

impl Adapters {
    /// Trainable parameters: `rank·(in + out)` per adapted projection and layer, as PEFT's
    /// `print_trainable_parameters` counts them.
    pub fn parameter_count(&self, model: &ModelShape) -> u64 {
        let per_block: usize = self
            .targets
            .of(model)
            .iter()
            .map(|p| self.rank * (p.in_features + p.out_features))
            .sum();
        (per_block * model.summary().layers) as u64
    }

    pub fn layout(&self, model: &ModelShape, world_size: usize) -> LoraLayout {
        let targets = self.targets.of(model);
        let layers = model.summary().layers;
        let adapters = (0..layers)
            .map(|l| {
                let tensors = targets
                    .iter()
                    .flat_map(|p| {
                        [
                            (AdapterPart::A, TensorDims::Matrix(self.rank, p.in_features)),
                            (
                                AdapterPart::B,
                                TensorDims::Matrix(p.out_features, self.rank),
                            ),
                        ]
                        .map(|(part, dims)| {
                            let weight = p.weight;
                            (AdapterTensor { weight, part }, dims)
                        })
                    })
                    .collect();
                (UnitKind::Block(l), tensors)
            })
            .collect();
        let quantized: Vec<ModelTensor> = match self.base {
            BaseStorage::Compute => Vec::new(),
            BaseStorage::Nf4 => targets.iter().map(|p| p.weight).collect(),
        };
        let full = model.units(world_size);
        let base = full
            .iter()
            .map(|u| {
                let kept = u
                    .tensors
                    .iter()
                    .filter(|t| !quantized.contains(&t.kind))
                    .map(|t| (t.kind, t.dims))
                    .collect();
                (u.kind, kept)
            })
            .collect();
        let nf4 = match self.base {
            BaseStorage::Compute => Vec::new(),
            BaseStorage::Nf4 => (0..layers)
                .map(|l| {
                    let bytes = |numel: usize| TensorDims::Vector(numel);
                    // Absmax first: every one starts 4-byte aligned in the unit.
                    let parts = targets
                        .iter()
                        .map(|p| {
                            let blocks = p.numel().div_ceil(NF4_BLOCK);
                            (Nf4Part::Absmax(p.weight), bytes(4 * blocks))
                        })
                        .chain(
                            targets
                                .iter()
                                .map(|p| (Nf4Part::Codes(p.weight), bytes(p.numel().div_ceil(2)))),
                        )
                        .collect();
                    (UnitKind::Block(l), parts)
                })
                .collect(),
        };
        LoraLayout {
            adapters: Units::lay_out(adapters, false, world_size),
            base: Units::lay_out(base, full.tied(), world_size),
            nf4: Units::lay_out(nf4, false, world_size),
        }
    }

    /// Bytes a micro-batch of `b` × `t` tokens keeps for the adapters, beside full
    /// fine-tuning's activations, in a compute dtype of `x` bytes: each adapted projection's
    /// `dropout(x)·Aᵀ` per layer (one block's worth under activation checkpointing, which
    /// recomputes it), the gradient of the widest of those, and, with dropout, the widest
    /// dropped input.
    pub fn activation_bytes(
        &self,
        model: &ModelShape,
        (b, t): (usize, usize),
        checkpointing: bool,
        x: u64,
    ) -> u64 {
        let tokens = b * t;
        let targets = self.targets.of(model);
        let layers = if checkpointing {
            1
        } else {
            model.summary().layers
        };
        let saved = targets.len() * layers * tokens * self.rank;
        let scratch = tokens * self.rank;
        let dropped = if self.dropout > 0.0 {
            tokens * targets.iter().map(|p| p.in_features).max().unwrap_or(0)
        } else {
            0
        };
        (saved + scratch + dropped) as u64 * x
    }

    /// Bytes of the one projection weight NF4 jobs dequantize at a time, in the compute dtype
    /// of `x` bytes; 0 without NF4.
    pub fn dequantize_scratch_bytes(&self, model: &ModelShape, x: u64) -> u64 {
        match self.base {
            BaseStorage::Compute => 0,
            BaseStorage::Nf4 => {
                let widest = self.targets.of(model).iter().map(Projection::numel).max();
                widest.unwrap_or(0) as u64 * x
            }
        }
    }
}

impl Projection {
    pub fn numel(&self) -> usize {
        self.in_features * self.out_features
    }

    /// The module's full name in layer `layer` (`model.layers.3.self_attn.q_proj`,
    /// `transformer.h.3.attn.c_attn`), as PEFT matches `target_modules` against it.
    pub fn module_name(&self, layer: usize) -> String {
        module_name(self.weight, layer)
    }

    /// Per layer, whether any of `entries` targets this projection there (PEFT's rule).
    fn layers_matching(&self, model: &ModelShape, entries: &[&str]) -> Vec<bool> {
        (0..model.summary().layers)
            .map(|l| {
                let module = self.module_name(l);
                entries
                    .iter()
                    .any(|e| module == *e || module.ends_with(&format!(".{e}")))
            })
            .collect()
    }
}

/// The full name in layer `layer` of the module whose weight is `weight`.
fn module_name(weight: ModelTensor, layer: usize) -> String {
    let name = weight.state_dict_name(Some(layer));
    name.strip_suffix(".weight")
        .expect("a projection's weight ends in .weight")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel_figures::nf4_bytes;
    use crate::model::LlamaPreset;

    #[test]
    fn peft_counts_llama_adapters_by_rank_and_width() {
        let model = ModelShape::Llama(LlamaPreset::Tiny.shape());
        let all = Adapters {
            rank: 4,
            scaling: 2.0,
            targets: Targets::all(&model),
            dropout: 0.0,
            base: BaseStorage::Compute,
        };
        let s = model.summary();
        let (c, i, kv) = (
            s.hidden_size,
            s.intermediate_size,
            s.key_value_heads * s.head_dim,
        );
        let q = s.attention_heads * s.head_dim;
        let per_layer = 4 * ((c + q) + 2 * (c + kv) + (q + c) + 3 * (c + i));
        assert_eq!(all.parameter_count(&model), (per_layer * s.layers) as u64);
        let layout = all.layout(&model, 2);
        assert_eq!(layout.adapters.len() as u64, all.parameter_count(&model));
        assert_eq!(layout.base.len() as u64, model.parameter_count());
        assert!(layout.nf4.is_empty());
    }

    #[test]
    fn nf4_moves_adapted_weights_out_of_the_base() {
        let model = ModelShape::Llama(LlamaPreset::Tiny.shape());
        let q_and_v = Targets::matching(&model, &["q_proj", "v_proj"]);
        let adapters = Adapters {
            rank: 8,
            scaling: 1.0,
            targets: q_and_v,
            dropout: 0.1,
            base: BaseStorage::Nf4,
        };
        let layout = adapters.layout(&model, 1);
        let quantized: usize = q_and_v.of(&model).iter().map(Projection::numel).sum();
        let layers = model.summary().layers;
        assert_eq!(
            layout.base.len() + layers * quantized,
            model.parameter_count() as usize
        );
        let per_layer: usize = q_and_v
            .of(&model)
            .iter()
            .map(|p| nf4_bytes(p.numel()))
            .sum();
        assert_eq!(layout.nf4.len(), layers * per_layer);
    }

    #[test]
    fn c_proj_is_both_of_gpt2s_and_a_path_picks_one() {
        let model = ModelShape::Gpt2(crate::model::Preset::Tiny.shape());
        let paths = |t: Targets| t.of(&model).iter().map(|p| p.path).collect::<Vec<_>>();
        assert_eq!(
            paths(Targets::matching(&model, &["c_proj"])),
            ["attn.c_proj", "mlp.c_proj"]
        );
        assert_eq!(
            paths(Targets::matching(&model, &["mlp.c_proj"])),
            ["mlp.c_proj"]
        );
        assert!(Targets::matching(&model, &["q_proj"]).is_empty());
        assert!(Targets::matching(&model, &["proj"]).is_empty());
        // PEFT's saved form of "all-linear": every layer's module by its full name.
        let layer0 = "transformer.h.0.attn.c_attn";
        assert_eq!(paths(Targets::matching(&model, &[layer0])), ["attn.c_attn"]);
        assert_eq!(
            Targets::partial(&model, &[layer0]),
            [("attn.c_attn", vec![0])]
        );
        let every: Vec<String> = (0..model.summary().layers)
            .map(|l| format!("transformer.h.{l}.attn.c_attn"))
            .collect();
        let every: Vec<&str> = every.iter().map(String::as_str).collect();
        assert!(Targets::partial(&model, &every).is_empty());
    }
}
