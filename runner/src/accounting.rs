//! The accounting allocator: every byte the trainer holds is a `Buffer` drawn from a rank's
//! `Accountant`, by category, so measured peaks can be compared with the memory model and a
//! rank that would pass its device budget fails with an error instead of being killed.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use scheduler::memory::{Breakdown, Category};

use crate::Error;

/// One rank's ledger of live and peak bytes per category. Cloning shares the ledger.
#[derive(Clone, Debug, Default)]
pub struct Accountant(Arc<Mutex<Ledger>>);

#[derive(Debug, Default)]
struct Ledger {
    current: Breakdown,
    peak: Breakdown,
    budget: Option<u64>,
}

impl Accountant {
    /// A ledger that refuses allocations past `budget` bytes in total, if given.
    pub fn new(budget: Option<u64>) -> Accountant {
        Accountant(Arc::new(Mutex::new(Ledger {
            budget,
            ..Ledger::default()
        })))
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        // A panic while holding the lock leaves the counters consistent (they are updated
        // after the checks), so a poisoned ledger is still a correct one.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A zeroed buffer of `len` elements charged to `category`.
    pub fn alloc<T: Copy + Default>(
        &self,
        category: Category,
        len: usize,
    ) -> Result<Buffer<T>, Error> {
        let bytes = (len * size_of::<T>()) as u64;
        {
            let mut l = self.ledger();
            if let Some(budget) = l.budget {
                let in_use = l.current.total();
                if in_use + bytes > budget {
                    return Err(Error::OutOfMemory {
                        category,
                        requested: bytes,
                        in_use,
                        budget,
                    });
                }
            }
            *l.current.get_mut(category) += bytes;
            let now = l.current.get(category);
            let peak = l.peak.get_mut(category);
            *peak = (*peak).max(now);
        }
        Ok(Buffer {
            data: vec![T::default(); len],
            category,
            ledger: self.clone(),
        })
    }

    /// Bytes live now, by category.
    pub fn current(&self) -> Breakdown {
        self.ledger().current
    }

    /// The most bytes each category has held at once.
    pub fn peak(&self) -> Breakdown {
        self.ledger().peak
    }
}

/// Memory charged to an `Accountant`; released when dropped.
#[derive(Debug)]
pub struct Buffer<T> {
    data: Vec<T>,
    category: Category,
    ledger: Accountant,
}

impl<T> Deref for Buffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<T> DerefMut for Buffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}

impl<T> Drop for Buffer<T> {
    fn drop(&mut self) {
        let bytes = (self.data.len() * size_of::<T>()) as u64;
        *self.ledger.ledger().current.get_mut(self.category) -= bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_live_and_peak_bytes_per_category() {
        let acct = Accountant::new(None);
        let a = acct.alloc::<f32>(Category::Params, 10).unwrap();
        let b = acct.alloc::<u8>(Category::Buffers, 7).unwrap();
        assert_eq!(acct.current().params, 40);
        drop(a);
        let _c = acct.alloc::<u16>(Category::Params, 4).unwrap();
        assert_eq!(acct.current().params, 8);
        assert_eq!(acct.peak().params, 40);
        assert_eq!(acct.peak().buffers, 7);
        drop(b);
        assert_eq!(acct.current().buffers, 0);
    }

    #[test]
    fn refuses_an_allocation_past_the_budget_naming_the_category() {
        let acct = Accountant::new(Some(100));
        let _a = acct.alloc::<f32>(Category::Grads, 20).unwrap();
        let err = acct.alloc::<f32>(Category::Optimizer, 6).unwrap_err();
        assert!(matches!(
            err,
            Error::OutOfMemory {
                category: Category::Optimizer,
                requested: 24,
                in_use: 80,
                budget: 100
            }
        ));
        assert!(err.to_string().contains("optimizer"), "{err}");
        assert_eq!(
            acct.current().optimizer,
            0,
            "a refused allocation charges nothing"
        );
    }
}
