//! Fixed-partition parallel loops. Chunk bounds depend only on the problem size, never on the
//! pool, which is what makes every kernel deterministic.

use rayon::prelude::*;
use std::ops::Range;

/// Run `f` on `[0, n)` cut into consecutive ranges of `chunk` (the last may be shorter).
pub(crate) fn for_ranges(n: usize, chunk: usize, f: impl Fn(Range<usize>) + Sync + Send) {
    let chunk = chunk.max(1);
    (0..n.div_ceil(chunk))
        .into_par_iter()
        .for_each(|i| f(i * chunk..((i + 1) * chunk).min(n)));
}

/// A raw pointer that may be shared between tasks writing disjoint parts of one slice.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(*mut T, usize);

// SAFETY: callers only create disjoint sub-slices from different tasks (see `slice`).
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(s: &mut [T]) -> Self {
        Self(s.as_mut_ptr(), s.len())
    }

    /// # Safety
    /// No two live sub-slices obtained from this pointer may overlap, and the original
    /// borrow must outlive them (the returned lifetime is unchecked).
    pub(crate) unsafe fn slice<'a>(self, r: Range<usize>) -> &'a mut [T] {
        assert!(r.start <= r.end && r.end <= self.1, "range out of bounds");
        // SAFETY: in bounds (checked); disjointness is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(r.start), r.end - r.start) }
    }
}
