//! Dropout's masks: drawn at the rate asked for, the same for the same (key, offset) whatever
//! the slice a call covers, different for another key, and backward's forward's.

use crate::common::*;
use kernels::dropout::{Mask, dropout_backward, dropout_forward};

const N: usize = 1 << 17;

fn mask(p: f32, key: u64) -> Mask {
    Mask { p, key, offset: 0 }
}

#[test]
fn a_mask_drops_at_its_rate_and_scales_what_it_keeps() {
    for p in [0.05f32, 0.1, 0.5] {
        let ones = vec![1f32; N];
        let mut out = vec![f32::NAN; N];
        dropout_forward(&mut out, &ones, mask(p, 7));
        let dropped = out.iter().filter(|&&v| v == 0.0).count() as f64;
        let kept = out.iter().filter(|&&v| v == 1.0 / (1.0 - p)).count() as f64;
        assert_eq!(
            dropped + kept,
            N as f64,
            "p {p}: every element dropped or scaled"
        );
        // Binomial: within 5 standard deviations of N·p.
        let (mean, sd) = (
            N as f64 * f64::from(p),
            (N as f64 * f64::from(p * (1.0 - p))).sqrt(),
        );
        assert!(
            (dropped - mean).abs() < 5.0 * sd,
            "p {p}: {dropped} dropped of {N}"
        );
    }
}

#[test]
fn a_mask_is_a_function_of_its_key_and_each_element_s_offset() {
    let mut rng = Rng::new(3);
    let x = random::<f32>(&mut rng, N, 1.0);
    let mut whole = vec![0f32; N];
    dropout_forward(&mut whole, &x, mask(0.3, 11));
    // The tail as a call of its own, from its offset: the same values.
    let at = 12_345;
    let mut tail = vec![0f32; N - at];
    let shifted = Mask {
        offset: at as u64,
        ..mask(0.3, 11)
    };
    dropout_forward(&mut tail, &x[at..], shifted);
    assert_eq!(tail, whole[at..]);
    let mut other = vec![0f32; N];
    dropout_forward(&mut other, &x, mask(0.3, 12));
    let same = whole.iter().zip(&other).filter(|(a, b)| a == b).count();
    // Both keep an element with probability 0.49, both drop it with 0.09.
    assert!(same < N * 6 / 10, "another key drew {same} of {N} alike");
}

#[test]
fn backward_adds_the_gradient_through_forward_s_mask() {
    let mut rng = Rng::new(4);
    let (acc, dout) = (
        random::<f32>(&mut rng, N, 1.0),
        random::<f32>(&mut rng, N, 1.0),
    );
    let m = mask(0.2, 5);
    let mut dinp = acc.clone();
    dropout_backward(&mut dinp, &dout, m);
    let mut through = vec![0f32; N];
    dropout_forward(&mut through, &dout, m);
    for i in 0..N {
        assert_eq!(dinp[i], acc[i] + through[i], "element {i}");
    }
}
