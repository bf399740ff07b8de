//! The trainer's process as the operating system sees it: its peak resident set, to set beside
//! the memory model's prediction for every rank it runs plus the process overhead. (The heap
//! setting that lets the resident set follow what the accountant frees is the binary's:
//! zerotrain's `cli/src/process.rs`.)

/// The most bytes this process has had resident at once (`VmHWM`), if the system says.
pub fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM:").or_else(max_rss_bytes)
}

/// The bytes this process has resident now (`VmRSS`), if the system says.
pub fn rss_bytes() -> Option<u64> {
    status_bytes("VmRSS:")
}

/// A `/proc/self/status` line's value in bytes.
fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_line(&status, key)
}

/// `VmHWM:   2193408 kB` → bytes, for `key` `VmHWM:`.
fn kib_line(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line
        .trim_start_matches(key)
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// `getrusage`'s `ru_maxrss`: KiB on Linux and the BSDs, bytes on macOS.
fn max_rss_bytes() -> Option<u64> {
    #[cfg(unix)]
    {
        // SAFETY: getrusage writes one rusage into the zeroed struct it is given.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
            return None;
        }
        let max = u64::try_from(usage.ru_maxrss).ok()?;
        Some(if cfg!(target_os = "macos") {
            max
        } else {
            max * 1024
        })
    }
    #[cfg(not(unix))]
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_high_water_mark_in_bytes() {
        let status =
            "Name:\tzerotrain\nVmPeak:\t 3000000 kB\nVmHWM:\t 2193408 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(kib_line(status, "VmHWM:"), Some(2_193_408 * 1024));
        assert_eq!(kib_line(status, "VmRSS:"), Some(1000 * 1024));
        assert_eq!(kib_line("Name:\tx\n", "VmHWM:"), None);
    }

    #[test]
    fn the_peak_covers_memory_this_process_touched() {
        let before = peak_rss_bytes().expect("a peak on this system");
        let mut block = vec![0u8; 64 << 20];
        block.iter_mut().step_by(4096).for_each(|b| *b = 1);
        let after = peak_rss_bytes().unwrap();
        assert!(std::hint::black_box(&block)[4096] == 1);
        assert!(after >= before.max(64 << 20), "{before} → {after}");
    }
}
