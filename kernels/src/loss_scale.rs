//! Overflow detection for dynamic loss scaling.

use crate::Float;
use rayon::prelude::*;

/// True if any element is infinite or NaN.
pub fn found_nonfinite<X: Float>(x: &[X]) -> bool {
    // A fold without early exit vectorises; the result does not depend on order.
    x.par_chunks(1 << 16)
        .any(|c| c.iter().fold(false, |bad, x| bad | !x.is_finite()))
}
