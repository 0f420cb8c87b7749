//! One training iteration under FSDP full sharding with per-block units: the schedule of
//! gathers, gradient reduce-scatters and compute, and how much of the communication hides.
//!
//! - Forward: unit `u` computes once its weights are gathered; with prefetch the gather of
//!   `u + 1` runs during the compute of `u` (FSDP2's default: one unit ahead).
//! - Backward (reverse order): weights are gathered again (resharded after forward); during the
//!   backward compute of `u`, the link carries the gather of the next unit back and the
//!   reduce-scatter of the gradients of the unit finished before (raw: compression here is for
//!   the weight gathers only). The last reduce-scatter is exposed.
//! - Without prefetch every gather is exposed.
//!
//! The compute time of a unit is its forward FLOPs (`model::ModelSpec::unit_flops_per_token`:
//! 2 per parameter a token multiplies by, plus attention; none for the embedding lookup) at
//! the GPU's peak rate times an MFU, and twice that for its backward.

/// Per unit: bytes gathered, forward compute seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct UnitCost {
    pub name: String,
    pub gather_bytes: f64,
    pub forward_s: f64,
}

/// What one iteration took, and its communication parts (seconds).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Iteration {
    pub total_s: f64,
    pub compute_s: f64,
    /// Sum of all weight gathers (forward and backward), exposed or not.
    pub gathers_s: f64,
    /// Sum of all gradient reduce-scatters.
    pub reduce_scatters_s: f64,
    /// Time the GPU waited for communication.
    pub exposed_s: f64,
}

/// Simulates one iteration. `gather(u)` and `reduce_scatter(u)` give the call times of unit
/// `u`'s weight gather and gradient reduce-scatter.
pub fn iteration(
    units: &[UnitCost],
    prefetch: bool,
    gather: impl Fn(usize) -> f64,
    reduce_scatter: impl Fn(usize) -> f64,
) -> Iteration {
    let n = units.len();
    if n == 0 {
        return Iteration::default();
    }
    let ag: Vec<f64> = (0..n).map(&gather).collect();
    let rs: Vec<f64> = (0..n).map(&reduce_scatter).collect();
    let fwd: Vec<f64> = units.iter().map(|u| u.forward_s).collect();
    let bwd: Vec<f64> = fwd.iter().map(|f| 2.0 * f).collect();
    let compute: f64 = fwd.iter().sum::<f64>() + bwd.iter().sum::<f64>();
    let mut t = 0.0;
    if prefetch {
        // Forward: gather 0 exposed, then compute u while gathering u + 1.
        t += ag[0];
        for u in 0..n {
            let next = if u + 1 < n { ag[u + 1] } else { 0.0 };
            t += fwd[u].max(next);
        }
        // Backward from the last unit: gather it (exposed), then compute u while the link
        // gathers u - 1 and reduce-scatters u + 1 (finished just before).
        t += ag[n - 1];
        for u in (0..n).rev() {
            let next = if u > 0 { ag[u - 1] } else { 0.0 };
            let prev_rs = if u + 1 < n { rs[u + 1] } else { 0.0 };
            t += bwd[u].max(next + prev_rs);
        }
        t += rs[0];
    } else {
        t += ag.iter().sum::<f64>() * 2.0 + compute + rs.iter().sum::<f64>();
    }
    Iteration {
        total_s: t,
        compute_s: compute,
        gathers_s: ag.iter().sum::<f64>() * 2.0,
        reduce_scatters_s: rs.iter().sum(),
        exposed_s: t - compute,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(f: &[f64]) -> Vec<UnitCost> {
        f.iter()
            .enumerate()
            .map(|(i, &s)| UnitCost {
                name: format!("u{i}"),
                gather_bytes: 1.0,
                forward_s: s,
            })
            .collect()
    }

    /// Communication that fits under compute hides except the first gather of each pass and
    /// the last reduce-scatter.
    #[test]
    fn prefetch_hides_what_fits() {
        let u = units(&[1.0, 1.0, 1.0]);
        let it = iteration(&u, true, |_| 0.5, |_| 0.25);
        // forward 0.5 + 3 x 1; backward 0.5 + 3 x 2; last reduce-scatter 0.25.
        assert_eq!(it.total_s, 0.5 + 3.0 + 0.5 + 6.0 + 0.25);
        assert_eq!(it.compute_s, 9.0);
        assert_eq!(it.exposed_s, 1.25);
    }

    /// Communication longer than compute sets the pace.
    #[test]
    fn slow_gathers_set_the_pace() {
        let u = units(&[0.1, 0.1]);
        let it = iteration(&u, true, |_| 1.0, |_| 0.5);
        // forward: 1 + max(0.1, 1) + 0.1; backward: 1 + max(0.2, 1 + 0.5)... u=1 first:
        // next = ag[0] = 1, prev_rs = 0 -> max(0.2, 1) = 1; u=0: next 0, prev_rs rs[1] = 0.5
        // -> max(0.2, 0.5); then rs[0].
        assert_eq!(it.total_s, 1.0 + 1.0 + 0.1 + 1.0 + 1.0 + 0.5 + 0.5);
        let no = iteration(&u, false, |_| 1.0, |_| 0.5);
        assert_eq!(no.total_s, 4.0 + 0.6 + 1.0);
    }
}
