//! Rings or references: per call size, whether this rank offers its large raw segments to shm
//! peers by reference (single copy: the peer copies them out of this process with
//! process_vm_readv) or writes them into the rings (two copies, the second from cache).
//!
//! Which is faster depends on where the hypervisor or scheduler put the ranks, and that can
//! change while a job runs: while two ranks share a cache the rings win; while they do not,
//! every line a sender writes costs a cache-line round trip and references win by 2x
//! (ARCHITECTURE.md, "Single copy over shm", has the figures). So
//! `CIERA_SHM_SINGLE_COPY=auto` (the default) measures: each
//! size class (power of two of the bytes gathered) tries both ways twice, then uses the one
//! whose recent calls were faster, tries the other again at doubling gaps while it is within
//! 1.5x of it, and in any case once it has not for [`REPROBE`], so a change of placement
//! is noticed within a fraction of a second.
//!
//! Each rank decides for what it sends; a receiver handles references and ring bytes alike
//! (the segment tag says which), so ranks need not agree and nothing is exchanged. Ranks do
//! measure nearly the same thing (in an allgather the call ends about together everywhere), so
//! they usually pick alike.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ciera_transport::SingleCopy;

/// Calls per way before the estimates are trusted (the first calls of a size may fault in
/// fresh pages, so the fastest of these samples is the starting estimate).
const WARM_UP: u32 = 2;
/// After the warm-up the slower way is tried again after this many calls, then after twice as
/// many each time it is still slower (so a wrong start is corrected within a few calls and
/// the cost of checking fades), as long as its estimate is within [`CLOSE`] times the
/// faster's (noise could have put it there; a way much slower than that is not worth a call
/// until something changes); and in any case once per [`REPROBE`]. The limit is below the
/// 2x by which the rings lose while the ranks share no cache, so that phase does not pay for
/// checks of a way it knows to be slow.
const GAP_MIN: u32 = 16;
const CLOSE: f64 = 1.5;
const GAP_MAX: u32 = 1024;
/// A way not used for this long is tried again once.
pub const REPROBE: Duration = Duration::from_millis(250);
/// Weight of a new sample in a way's running estimate.
const ALPHA: f64 = 0.25;

#[derive(Clone, Copy, Debug, Default)]
struct Way {
    tries: u32,
    /// Running estimate of a call's time, seconds.
    est: f64,
    last: Option<Instant>,
}

/// The two ways for one size class: index 0 rings, 1 references.
#[derive(Clone, Copy, Debug)]
struct SizeClass {
    ways: [Way; 2],
    /// Calls since the slower way was last tried, and how many to wait before the next try.
    since_other: u32,
    gap: u32,
}

impl Default for SizeClass {
    fn default() -> Self {
        SizeClass {
            ways: [Way::default(); 2],
            since_other: 0,
            gap: GAP_MIN,
        }
    }
}

impl SizeClass {
    fn warming_up(&self) -> bool {
        self.ways.iter().any(|w| w.tries < WARM_UP)
    }

    /// The way with the lower estimate (1 = references).
    fn best(&self) -> usize {
        usize::from(self.ways[1].est < self.ways[0].est)
    }
}

/// Chooses, per call, whether raw segments go by reference; see the module docs.
#[derive(Debug)]
pub struct RefChooser {
    policy: SingleCopy,
    classes: HashMap<u32, SizeClass>,
}

fn class_of(total_bytes: usize) -> u32 {
    usize::BITS - total_bytes.leading_zeros()
}

impl RefChooser {
    pub fn new(policy: SingleCopy) -> RefChooser {
        RefChooser {
            policy,
            classes: HashMap::new(),
        }
    }

    /// Whether a call gathering `total_bytes` should offer its segments by reference.
    pub fn pick(&mut self, total_bytes: usize, now: Instant) -> bool {
        match self.policy {
            SingleCopy::Off => false,
            SingleCopy::On => true,
            SingleCopy::Auto => {
                let c = self.classes.entry(class_of(total_bytes)).or_default();
                if c.warming_up() {
                    // Alternate, rings first.
                    return c.ways[1].tries < c.ways[0].tries;
                }
                let best = c.best();
                let other = 1 - best;
                let stale = c.ways[other]
                    .last
                    .is_none_or(|t| now.saturating_duration_since(t) >= REPROBE);
                let close = c.ways[other].est < CLOSE * c.ways[best].est;
                let way = if stale || (close && c.since_other >= c.gap) {
                    other
                } else {
                    best
                };
                way == 1
            }
        }
    }

    /// A call of `total_bytes` that used references (`refs`) or not took `took`, ending `now`.
    /// Only calls whose segments could have gone either way should be recorded.
    pub fn record(&mut self, total_bytes: usize, refs: bool, took: Duration, now: Instant) {
        if self.policy != SingleCopy::Auto {
            return;
        }
        let c = self.classes.entry(class_of(total_bytes)).or_default();
        let way = usize::from(refs);
        let warm = c.warming_up();
        let explored = !warm && way != c.best();
        // A way that was not used since the other one last was has a stale estimate: the new
        // sample is the best information there is.
        let stale = c.ways[way].last < c.ways[1 - way].last;
        let t = took.as_secs_f64();
        let w = &mut c.ways[way];
        w.est = if w.tries == 0 {
            t
        } else if w.tries < WARM_UP {
            w.est.min(t)
        } else if stale {
            t
        } else {
            w.est + ALPHA * (t - w.est)
        };
        w.tries += 1;
        w.last = Some(now);
        if explored {
            c.since_other = 0;
            c.gap = if c.best() == way {
                GAP_MIN // it is faster now: the other way gets checked soon
            } else {
                (c.gap * 2).min(GAP_MAX)
            };
        } else if !warm {
            c.since_other += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// Run `calls` calls of `bytes` at `step` intervals, each taking what `cost` says for the
    /// way picked; return how many used references.
    fn drive(
        ch: &mut RefChooser,
        t: &mut Instant,
        bytes: usize,
        calls: usize,
        step: Duration,
        mut cost: impl FnMut(bool) -> Duration,
    ) -> usize {
        let mut refs = 0;
        for _ in 0..calls {
            let r = ch.pick(bytes, *t);
            *t += step;
            ch.record(bytes, r, cost(r), *t);
            refs += usize::from(r);
        }
        refs
    }

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn fixed_policies_do_not_measure() {
        let now = Instant::now();
        let mut on = RefChooser::new(SingleCopy::On);
        let mut off = RefChooser::new(SingleCopy::Off);
        for _ in 0..10 {
            assert!(on.pick(MIB, now));
            assert!(!off.pick(MIB, now));
            on.record(MIB, true, us(1), now);
            off.record(MIB, false, us(1), now);
        }
        assert!(on.classes.is_empty() && off.classes.is_empty());
    }

    /// Most calls that may try the slower way in `calls` calls `step` apart once the warm-up
    /// is over: a gap doubling from GAP_MIN, plus one per REPROBE.
    fn explore_bound(calls: usize, step: Duration) -> usize {
        let (mut n, mut at, mut gap) = (0, 0usize, GAP_MIN as usize);
        while at + gap < calls {
            at += gap + 1;
            n += 1;
            gap = (gap * 2).min(GAP_MAX as usize);
        }
        let span = step.as_micros() * calls as u128;
        n + (span / REPROBE.as_micros()) as usize + 1
    }

    #[test]
    fn tries_both_then_keeps_the_faster() {
        let mut ch = RefChooser::new(SingleCopy::Auto);
        let mut t = Instant::now();
        let cost = |r: bool| us(if r { 100 } else { 200 });
        // Warm-up: rings, refs, rings, refs.
        let firsts: Vec<bool> = (0..4)
            .map(|_| {
                let r = ch.pick(MIB, t);
                ch.record(MIB, r, cost(r), t);
                r
            })
            .collect();
        assert_eq!(firsts, [false, true, false, true]);
        // References 2x faster, beyond CLOSE: none of the next 1000 calls (100 ms, less than
        // REPROBE) tries the rings again.
        assert_eq!(drive(&mut ch, &mut t, MIB, 1000, us(100), cost), 1000);
        // Rings faster instead (another size class starts fresh): only the 2 warm-up calls use
        // references.
        let refs = drive(&mut ch, &mut t, 4 * MIB, 1004, us(100), |r| {
            us(if r { 400 } else { 200 })
        });
        assert_eq!(refs, 2);
    }

    #[test]
    fn a_close_second_is_checked_at_doubling_gaps() {
        let mut ch = RefChooser::new(SingleCopy::Auto);
        let mut t = Instant::now();
        // References 1.3x slower: within CLOSE. 2000 calls in 200 ms (< REPROBE): the warm-up
        // (2) and checks after 16, 32, 64, 128, 256, 512 and 1024 calls (1+16+1+32+...).
        let refs = drive(&mut ch, &mut t, MIB, 2000, us(100), |r| {
            us(if r { 130 } else { 100 })
        });
        let mut checks = 0;
        let (mut at, mut gap) = (4, GAP_MIN as usize);
        while at + gap < 2000 {
            at += gap + 1;
            gap *= 2;
            checks += 1;
        }
        assert_eq!(refs, 2 + checks);
    }

    #[test]
    fn slow_first_calls_are_corrected_by_the_reprobe() {
        let mut ch = RefChooser::new(SingleCopy::Auto);
        let mut t = Instant::now();
        // Both warm-up calls of the rings cost 50x (say, fresh pages); from then on the rings
        // are faster. References win until the rings are tried again, at REPROBE at the
        // latest; then the rings keep the lead.
        let mut rings_calls = 0;
        let refs = drive(&mut ch, &mut t, MIB, 5000, us(100), |r| {
            if r {
                us(150)
            } else {
                rings_calls += 1;
                us(if rings_calls <= 2 { 5000 } else { 100 })
            }
        });
        let until_reprobe = (REPROBE.as_micros() / 100) as usize;
        let bound = 2 + until_reprobe + explore_bound(5000, us(100));
        assert!(
            (until_reprobe / 2..=bound).contains(&refs),
            "{refs} calls used references (at most {bound})"
        );
        assert!(rings_calls >= 5000 - bound);
    }

    #[test]
    fn follows_a_change_of_placement() {
        let mut ch = RefChooser::new(SingleCopy::Auto);
        let mut t = Instant::now();
        // Phase 1 (1 s): rings faster.
        let refs = drive(&mut ch, &mut t, MIB, 10_000, us(100), |r| {
            us(if r { 150 } else { 100 })
        });
        let bound = explore_bound(10_000, us(100));
        assert!(
            (2..=2 + bound).contains(&refs),
            "{refs} calls used references"
        );
        // Phase 2 (1 s): rings now 2x slower. The running estimate of the rings passes that of
        // references within a few calls; from then on only checks use the rings.
        let rings = 10_000
            - drive(&mut ch, &mut t, MIB, 10_000, us(100), |r| {
                us(if r { 150 } else { 300 })
            });
        assert!(
            rings <= 5 + bound,
            "{rings} calls still used the rings (at most {})",
            5 + bound
        );
        // Phase 3: back to rings faster, with the references' estimate fresh: the next check
        // of the rings (within the current gap, at most GAP_MAX calls or REPROBE) switches back.
        let refs = drive(&mut ch, &mut t, MIB, 10_000, us(100), |r| {
            us(if r { 150 } else { 100 })
        });
        let worst = (REPROBE.as_micros() / 100) as usize + bound;
        assert!(
            refs <= worst,
            "{refs} calls still used references (at most {worst})"
        );
    }

    #[test]
    fn a_much_slower_way_is_checked_once_per_reprobe() {
        let mut ch = RefChooser::new(SingleCopy::Auto);
        let mut t = Instant::now();
        let cost = |r: bool| us(if r { 100 } else { 300 });
        // 2000 calls in 200 ms (< REPROBE), 3x slower is beyond CLOSE: only the warm-up (2).
        let rings = 2000 - drive(&mut ch, &mut t, MIB, 2000, us(100), cost);
        assert_eq!(rings, 2);
        // The next 3000 (300 ms): one more, once REPROBE has passed since the warm-up.
        let rings = 3000 - drive(&mut ch, &mut t, MIB, 3000, us(100), cost);
        assert_eq!(rings, 1);
    }

    #[test]
    fn size_classes_are_separate() {
        assert_eq!(class_of(MIB), class_of(2 * MIB - 1));
        assert_ne!(class_of(MIB), class_of(2 * MIB));
        assert_eq!(class_of(0), 0);
    }
}
