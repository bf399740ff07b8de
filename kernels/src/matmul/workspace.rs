//! A home for the `gemm` crate's per-call packing buffer on threads that run product after
//! product (a rank's).
//!
//! `gemm` allocates its packed operand on the calling thread at every call and frees it before
//! it returns. The trainer fixes glibc's mmap threshold at 128 KiB, so that the resident set
//! follows what the accountant frees (`runner::process`); each such buffer was therefore
//! mapped, zeroed page by page as gemm first wrote it, and unmapped with a TLB shootdown to
//! every core of the process, call after call. A thread that holds a [`Workspace`] instead
//! keeps one block of [`GemmWorkspace::per_call`](super::GemmWorkspace) bytes (what the process
//! model counts per rank for that buffer) and lends it to every gemm call it makes; the pages
//! gemm touches stay resident until the workspace is dropped. Every other allocation, and
//! every thread without a workspace, goes to the system allocator as before.
//!
//! [`Allocator`] does this only as the process's allocator, which a binary declares (zerotrain's
//! `cli/src/process.rs`); a library never does. Until a thread first keeps a [`Workspace`], it
//! sends every request straight to the system, so a process that never trains (`zerotrain
//! serve`) allocates as if it were not there.
//!
//! gemm also keeps one buffer for the life of the thread (`gemm_common::gemm::L2_SLAB`, first
//! allocated inside a call); [`Workspace::keep`] allocates it first, from the system, so that
//! it never takes the block. Should anything else keep the block past its call, the block
//! stays with its holder until freed, and is freed then if the workspace is gone.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};

/// Smaller requests stay in glibc's heap anyway.
const MIN_BYTES: usize = 128 << 10;
/// The block's alignment: a page, past anything gemm asks for (a cache line).
const ALIGN: usize = 4096;

/// This thread's block and what it is doing.
#[derive(Clone, Copy)]
struct Slot {
    /// Bytes a [`Workspace`] lets the block have; 0 before the first.
    cap: usize,
    /// The block (allocated at its first loan, `cap` bytes), or null.
    block: *mut u8,
    /// A [`Workspace`] is alive on this thread.
    kept: bool,
    /// Inside a gemm call of this thread.
    in_gemm: bool,
    /// The block is out on loan.
    lent: bool,
}

impl Slot {
    const NONE: Slot = Slot {
        cap: 0,
        block: std::ptr::null_mut(),
        kept: false,
        in_gemm: false,
        lent: false,
    };

    fn layout(&self) -> Layout {
        Layout::from_size_align(self.cap, ALIGN).expect("a page-aligned block")
    }
}

/// Whether any thread has kept a [`Workspace`]: until then every request goes to the system.
static LENDING: AtomicBool = AtomicBool::new(false);

thread_local! {
    // Const-initialised and without a destructor: safe to reach from inside the allocator.
    static SLOT: Cell<Slot> = const { Cell::new(Slot::NONE) };
}

/// An allocator for a binary to declare (`#[global_allocator]`): the system's, but for gemm's
/// packing buffer on threads with a [`Workspace`].
pub struct Allocator;

/// The thread's block for a request of `layout`, if the request is gemm's and the block free.
fn lend(layout: Layout) -> Option<*mut u8> {
    if !LENDING.load(Ordering::Relaxed) {
        return None;
    }
    SLOT.with(|s| {
        let mut slot = s.get();
        if !slot.kept
            || !slot.in_gemm
            || slot.lent
            || layout.size() < MIN_BYTES
            || layout.size() > slot.cap
            || layout.align() > ALIGN
        {
            return None;
        }
        if slot.block.is_null() {
            // SAFETY: the layout has a non-zero size (cap ≥ MIN_BYTES).
            slot.block = unsafe { System.alloc(slot.layout()) };
            if slot.block.is_null() {
                return None;
            }
        }
        slot.lent = true;
        s.set(slot);
        Some(slot.block)
    })
}

/// Takes `ptr` back if it is this thread's lent block (freeing it if the workspace is gone).
fn take_back(ptr: *mut u8) -> bool {
    if !LENDING.load(Ordering::Relaxed) {
        return false;
    }
    SLOT.with(|s| {
        let mut slot = s.get();
        let ours = slot.lent && ptr == slot.block;
        if ours {
            slot.lent = false;
            if !slot.kept {
                // SAFETY: the block came from the system allocator with this layout.
                unsafe { System.dealloc(slot.block, slot.layout()) };
                slot = Slot::NONE;
            }
            s.set(slot);
        }
        ours
    })
}

// SAFETY: every pointer handed out is either the system allocator's, for the same layout, or
// the thread's block, which is at least `layout.size()` bytes at `ALIGN` ≥ `layout.align()`
// and is lent to one allocation at a time; each pointer goes back to where it came from.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout contract is passed on.
        lend(layout).unwrap_or_else(|| unsafe { System.alloc(layout) })
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match lend(layout) {
            Some(p) => {
                // SAFETY: the block holds at least `layout.size()` bytes.
                unsafe { p.write_bytes(0, layout.size()) };
                p
            }
            // SAFETY: the caller's layout contract is passed on.
            None => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !take_back(ptr) {
            // SAFETY: not the block, so the system allocated it with this layout.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !LENDING.load(Ordering::Relaxed)
            || !SLOT.with(|s| {
                let slot = s.get();
                slot.lent && ptr == slot.block
            })
        {
            // SAFETY: not the block, so the system allocated it with this layout.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // The block grows out of its loan: copy into a system allocation and take it back.
        // SAFETY: `new_size` with the old alignment is a valid layout (the caller's contract).
        let new =
            unsafe { System.alloc(Layout::from_size_align_unchecked(new_size, layout.align())) };
        if !new.is_null() {
            // SAFETY: both hold at least the smaller size; they do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size)) };
            take_back(ptr);
        }
        new
    }
}

/// While alive, this thread keeps a block for gemm's packing buffer (see the module notes);
/// dropping it frees the block, or leaves it to whatever still holds it. Create it on a thread
/// that runs many products, once.
pub struct Workspace(PhantomData<*const ()>);

impl Workspace {
    /// Keep a block of `super::gemm_workspace().per_call` bytes for this thread's gemm calls.
    pub fn keep() -> Self {
        let cap = usize::try_from(super::gemm_workspace().per_call).expect("a block in memory");
        gemm_common::gemm::L2_SLAB.with(|_| ());
        LENDING.store(true, Ordering::Relaxed);
        SLOT.with(|s| {
            let slot = s.get();
            assert!(!slot.kept, "one workspace a thread");
            // A block still out from an earlier workspace was allocated at this same size.
            s.set(Slot {
                cap: cap.max(MIN_BYTES),
                kept: true,
                ..slot
            });
        });
        Workspace(PhantomData)
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        SLOT.with(|s| {
            let slot = s.get();
            if slot.lent {
                // Its holder frees it (`take_back`).
                s.set(Slot {
                    kept: false,
                    ..slot
                });
                return;
            }
            if !slot.block.is_null() {
                // SAFETY: the block came from the system allocator with this layout.
                unsafe { System.dealloc(slot.block, slot.layout()) };
            }
            s.set(Slot::NONE);
        });
    }
}

/// Runs `f` (one gemm call) with this thread's block on offer.
pub(super) fn in_gemm<R>(f: impl FnOnce() -> R) -> R {
    struct Leave(bool);
    impl Drop for Leave {
        fn drop(&mut self) {
            let was = self.0;
            SLOT.with(|s| {
                let mut slot = s.get();
                slot.in_gemm = was;
                s.set(slot);
            });
        }
    }
    let _leave = Leave(SLOT.with(|s| {
        let mut slot = s.get();
        let was = slot.in_gemm;
        slot.in_gemm = true;
        s.set(slot);
        was
    }));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    // This test binary's allocator, as zerotrain's binary declares it: the loans below go
    // through it.
    #[global_allocator]
    static ALLOCATOR: Allocator = Allocator;

    /// Inside gemm, a thread with a workspace lends its one block to each large request in
    /// turn and takes it back; small requests, a second request while the block is out, and
    /// requests outside gemm go to the system.
    #[test]
    fn lends_one_block_to_gemm_calls_only() {
        on_a_fresh_thread(|| {
            let big = Layout::from_size_align(MIN_BYTES, 128).unwrap();
            let outside = lend(big);
            assert!(outside.is_none(), "no workspace yet");
            let ws = Workspace::keep();
            assert!(lend(big).is_none(), "outside gemm");
            let (first, second) = in_gemm(|| {
                let small = Layout::from_size_align(MIN_BYTES - 1, 8).unwrap();
                assert!(lend(small).is_none(), "small requests stay in the heap");
                let a = lend(big).expect("the block");
                assert!(lend(big).is_none(), "the block is out");
                assert!(take_back(a));
                let b = lend(big).expect("the block again");
                assert!(take_back(b));
                assert!(!take_back(b), "not lent twice");
                (a, b)
            });
            assert_eq!(first, second, "the same block, call after call");
            assert!(holds_block());
            drop(ws);
            assert!(!holds_block());
        });
    }

    /// A buffer that outlives its gemm call keeps the block: no loan until it is freed, and
    /// freeing it after the workspace is gone frees the block.
    #[test]
    fn a_block_kept_past_its_call_goes_back_when_freed() {
        on_a_fresh_thread(|| {
            let ws = Workspace::keep();
            let held: Vec<u8> = in_gemm(|| Vec::with_capacity(MIN_BYTES));
            assert!(lent(), "the vector has the block");
            assert!(in_gemm(|| lend(Layout::from_size_align(MIN_BYTES, 8).unwrap())).is_none());
            drop(ws);
            assert!(holds_block(), "still the vector's");
            drop(held);
            assert!(!holds_block(), "freed with the vector");
            let _again = Workspace::keep();
        });
    }

    /// gemm's own long-lived buffer (its L2 slab, allocated inside the first call on a thread
    /// that runs a product alone) never takes the block.
    #[test]
    fn products_leave_the_block_free() {
        on_a_fresh_thread(|| {
            let _ws = Workspace::keep();
            for s in [16, 96, 320] {
                let a: Vec<f32> = (0..s * s).map(|i| (i % 7) as f32).collect();
                let mut c = vec![0f32; s * s];
                super::super::product(
                    &mut c,
                    // A column-major A is what gemm runs on its slab rather than a pack.
                    super::super::Operand::new(&a[..], s, true),
                    super::super::Operand::new(&a[..], s, false),
                    (s, s, s),
                    super::super::Init::<f32>::Zero,
                    &mut [],
                );
                assert!(!lent(), "{s}³: the block is back after the call");
            }
        });
    }

    /// A thread of its own: a slot no other test has touched.
    fn on_a_fresh_thread(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(f).join().unwrap();
    }

    fn lent() -> bool {
        SLOT.with(|s| s.get().lent)
    }

    /// Whether this thread has its block (allocated at the first loan).
    fn holds_block() -> bool {
        SLOT.with(|s| !s.get().block.is_null())
    }
}
