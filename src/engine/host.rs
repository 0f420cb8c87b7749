//! What this host offers a rank, read from procfs and sysfs: the CPUs it may use (are the ranks
//! on this host more than the CPUs? then waiting must not spin) and the last-level cache (calls
//! bigger than it copy into their output with non-temporal stores). The figures behind the
//! defaults are in ARCHITECTURE.md, "Waiting (oversubscription) and placement".

use std::time::Duration;

use super::exec::IdlePolicy;

/// Last-level cache size assumed where sysfs does not say (see [`default_stream_min_bytes`]).
pub const DEFAULT_LLC_BYTES: usize = 32 << 20;

/// Default streaming threshold: the last-level cache divided among the ranks on this host
/// (their outputs share it), within 4 MiB to 256 MiB.
pub fn default_stream_min_bytes(local_ranks: usize) -> usize {
    static LLC: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let llc = *LLC.get_or_init(|| last_level_cache_bytes().unwrap_or(DEFAULT_LLC_BYTES));
    (llc / local_ranks.max(1)).clamp(4 << 20, 256 << 20)
}

/// The size of CPU 0's highest-level data or unified cache, from sysfs.
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let read = |p: &std::path::Path, f: &str| std::fs::read_to_string(p.join(f)).ok();
    dir.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
        .filter_map(|e| {
            let p = e.path();
            if read(&p, "type")?.trim() == "Instruction" {
                return None;
            }
            let level: u32 = read(&p, "level")?.trim().parse().ok()?;
            Some((level, crate::parse::parse_size(&read(&p, "size")?)?))
        })
        .max()
        .map(|(_, bytes)| bytes)
}

/// Spin while this host has a CPU for every local rank; when oversubscribed, never spin (a
/// spinning rank steals the CPU from the peer it waits for) but yield, which hands the CPU to
/// that peer when it shares our run queue; sleep in the transport once yielding has not helped
/// for a while (a sleep straight away is slow to wake in a VM). A rank bound to one CPU
/// (`ciera launch`, mpirun) spins without yielding: yielding there only hands the CPU to other
/// jobs. An unbound one yields every 20 µs while spinning, in case the scheduler stacked it on
/// the CPU of the peer it waits for.
pub fn idle_policy(oversubscribed: bool) -> IdlePolicy {
    if !oversubscribed {
        IdlePolicy {
            spin: Duration::from_micros(500),
            yield_while_spinning: !bound_to_one_cpu(),
            yield_for: Duration::from_millis(2),
            max_sleep: Duration::from_millis(5),
        }
    } else {
        IdlePolicy {
            spin: Duration::ZERO,
            yield_while_spinning: true,
            yield_for: Duration::from_millis(1),
            max_sleep: Duration::from_millis(5),
        }
    }
}

/// Whether this host runs more of the job's ranks than the CPUs they may use. For a rank that
/// is free to move, `available_parallelism` (its CPU set, and the container's CPU quota); for a
/// rank bound to one CPU (a launcher gave each rank a CPU of its own) that says 1, so the CPUs
/// online count instead. A job whose ranks all share one CPU by hand is the case this
/// misjudges.
pub fn oversubscribed(local_ranks: usize) -> bool {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cpus = if bound_to_one_cpu() {
        cpus_online().unwrap_or(0).max(available)
    } else {
        available
    };
    local_ranks > cpus
}

/// The CPUs a rank may use for work of its own (`CIERA_CODEC_THREADS=auto`): the CPUs it may
/// run on (`available_parallelism`: its CPU set, the container's quota), but no more than its
/// share of the host's CPUs among its `local_ranks`, so that ranks busy at once do not take
/// more CPUs than there are; at least 1 (a rank bound to one CPU, or one of more ranks than
/// CPUs).
pub fn cpu_share(local_ranks: usize) -> usize {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = cpus_online().unwrap_or(available) / local_ranks.max(1);
    available.min(share).max(1)
}

/// Whether this process may run on one CPU only.
fn bound_to_one_cpu() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("Cpus_allowed_list:")
                    .map(|v| v.trim().to_string())
            })
        })
        .is_some_and(|list| !list.contains(',') && !list.contains('-'))
}

/// The CPUs online, from sysfs (`0-1`, `0,2-5`).
fn cpus_online() -> Option<usize> {
    cpu_list_len(&std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?)
}

/// How many CPUs a kernel CPU list names.
fn cpu_list_len(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_threshold_stays_in_range_and_falls_with_more_ranks() {
        for local in [0, 1, 2, 4, 1000] {
            let d = default_stream_min_bytes(local);
            assert!((4 << 20..=256 << 20).contains(&d), "{local} ranks: {d}");
        }
        // More ranks sharing the cache: never a higher threshold.
        assert!(default_stream_min_bytes(4) <= default_stream_min_bytes(2));
    }

    #[test]
    fn a_cpu_share_is_one_to_the_cpus_available_and_falls_with_more_ranks() {
        let available = std::thread::available_parallelism().map_or(1, |n| n.get());
        let online = cpus_online().unwrap_or(available);
        for local in [0, 1, 2, 3, 1000] {
            let s = cpu_share(local);
            assert!(
                (1..=available).contains(&s),
                "{local} ranks: {s} of {available}"
            );
            assert!(
                s == 1 || s * local.max(1) <= online,
                "{local} ranks: {s} of {online}"
            );
        }
        assert!(cpu_share(4) <= cpu_share(2));
        assert_eq!(cpu_share(usize::MAX), 1);
    }

    #[test]
    fn cpu_lists_count_as_the_kernel_writes_them() {
        assert_eq!(cpu_list_len("0-1\n"), Some(2));
        assert_eq!(cpu_list_len("0,2-5,7"), Some(6));
        assert_eq!(cpu_list_len("3"), Some(1));
        assert_eq!(cpu_list_len("5-2"), None);
        assert_eq!(cpu_list_len("x"), None);
        assert!(cpus_online().is_some_and(|n| n >= 1));
    }
}
