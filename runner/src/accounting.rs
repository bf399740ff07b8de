//! The accounting allocator: every byte the trainer holds is a `Buffer` drawn from a rank's
//! `Accountant`, by category, so measured peaks can be compared with the memory model and a
//! rank that would pass its device budget fails with an error instead of being killed.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use scheduler::memory::{Breakdown, Category};

use crate::Error;
use crate::device::{Cpu, Device, Elem};

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

    /// A zeroed host buffer of `len` elements charged to `category`.
    pub fn alloc<T: Copy + Default>(
        &self,
        category: Category,
        len: usize,
    ) -> Result<Buffer<T>, Error> {
        let bytes = self.charge::<T>(category, len)?;
        Ok(Buffer {
            data: vec![T::default(); len],
            bytes,
            category,
            ledger: self.clone(),
        })
    }

    /// A zeroed buffer of `len` elements on `dev`, charged to `category` as on the host.
    pub fn alloc_on<D: Device, T: Elem>(
        &self,
        dev: &D,
        category: Category,
        len: usize,
    ) -> Result<Buffer<T, D>, Error> {
        let bytes = self.charge::<T>(category, len)?;
        match dev.zeros(len) {
            Ok(data) => Ok(Buffer {
                data,
                bytes,
                category,
                ledger: self.clone(),
            }),
            Err(e) => {
                self.release(category, bytes);
                Err(e)
            }
        }
    }

    fn release(&self, category: Category, bytes: u64) {
        *self.ledger().current.get_mut(category) -= bytes;
    }

    /// Records `len` more `T`s of `category`, or refuses them past the budget.
    fn charge<T>(&self, category: Category, len: usize) -> Result<u64, Error> {
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
        Ok(bytes)
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

/// Memory charged to an `Accountant`, on the host or on device `D`; released when dropped.
pub struct Buffer<T, D: Device = Cpu> {
    data: D::Buf<T>,
    bytes: u64,
    category: Category,
    ledger: Accountant,
}

impl<T, D: Device> Buffer<T, D> {
    /// Elements held.
    #[inline]
    pub fn len(&self) -> usize {
        (self.bytes as usize)
            .checked_div(size_of::<T>())
            .unwrap_or(0)
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All of it, to read.
    #[inline]
    pub fn view(&self) -> D::View<'_, T> {
        D::view(&self.data)
    }

    /// All of it, to write.
    #[inline]
    pub fn view_mut(&mut self) -> D::ViewMut<'_, T> {
        D::view_mut(&mut self.data)
    }

    /// Elements `r`, to read.
    #[inline]
    pub fn at(&self, r: std::ops::Range<usize>) -> D::View<'_, T> {
        D::slice(D::view(&self.data), r)
    }

    /// Elements `r`, to write.
    #[inline]
    pub fn at_mut(&mut self, r: std::ops::Range<usize>) -> D::ViewMut<'_, T> {
        D::slice_mut(D::view_mut(&mut self.data), r)
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("data", &self.data)
            .field("category", &self.category)
            .finish()
    }
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

impl<T, D: Device> Drop for Buffer<T, D> {
    fn drop(&mut self) {
        self.ledger.release(self.category, self.bytes);
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
