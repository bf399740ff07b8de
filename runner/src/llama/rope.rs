//! Rotary position embedding tables, computed as transformers computes them (in f32:
//! `inv_freq = 1 / θ^(2i/D)`, Llama 3's frequency-dependent scaling, then `cos`/`sin` of
//! `position · inv_freq`), so a model trained here and loaded there sees the same rotations.

use scheduler::model::Rope;

/// The D/2 inverse frequencies of a head of `head_dim` channels.
pub fn inverse_frequencies(rope: &Rope, head_dim: usize) -> Vec<f32> {
    let base = rope.theta as f32;
    let plain = (0..head_dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32));
    let Some(l3) = rope.llama3 else {
        return plain.collect();
    };
    let (factor, low, high) = (
        l3.factor as f32,
        l3.low_freq_factor as f32,
        l3.high_freq_factor as f32,
    );
    let old = l3.original_max_position_embeddings as f32;
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    plain
        .map(|f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

/// `(cos, sin)`, each (T, D/2): row p holds position p's values for every frequency.
pub fn rope_tables(rope: &Rope, head_dim: usize, t: usize) -> (Vec<f32>, Vec<f32>) {
    let inv = inverse_frequencies(rope, head_dim);
    let angles = || (0..t).flat_map(|p| inv.iter().map(move |f| p as f32 * f));
    (
        angles().map(f32::cos).collect(),
        angles().map(f32::sin).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use scheduler::model::{Llama3Rope, LlamaPreset};

    #[test]
    fn llama3_scaling_divides_low_frequencies_and_keeps_high_ones() {
        let rope = LlamaPreset::Llama32_1B.shape().rope;
        let plain = inverse_frequencies(
            &Rope {
                llama3: None,
                ..rope
            },
            64,
        );
        let scaled = inverse_frequencies(&rope, 64);
        let Llama3Rope { factor, .. } = rope.llama3.unwrap();
        // The highest frequency (wavelength 2π) is kept, the lowest divided by the factor.
        assert_eq!(scaled[0], plain[0]);
        assert_eq!(scaled[31], plain[31] / factor as f32);
        // In between, the smoothed ones lie between the two.
        assert!(
            scaled
                .iter()
                .zip(&plain)
                .any(|(s, p)| *s < *p && *s > *p / factor as f32)
        );
    }

    #[test]
    fn position_zero_is_the_identity_rotation() {
        let rope = LlamaPreset::Tiny.shape().rope;
        let (cos, sin) = rope_tables(&rope, 16, 4);
        assert_eq!((cos.len(), sin.len()), (4 * 8, 4 * 8));
        assert!(cos[..8].iter().all(|&c| c == 1.0) && sin[..8].iter().all(|&s| s == 0.0));
        assert_eq!(sin[8], 1f32.sin());
    }
}
