//! Recursive-doubling allgather (power-of-two rank counts).
//!
//! In round k (distance d = 2^k) rank r exchanges with r xor d: it sends the d blocks of the
//! aligned group of d ranks it belongs to (all of which it holds after round k-1) and receives
//! the d blocks of its partner's group. After log2(n) rounds every rank holds all n blocks.
//! Each rank sends and receives n-1 blocks in log2(n) rounds: the fewest rounds a
//! pairwise algorithm can do, so this is the small-call algorithm when n is a power of two.

use super::{Step, Unit};

pub fn steps(rank: usize, nranks: usize, nchunks: usize) -> Vec<Step> {
    assert!(
        nranks.is_power_of_two(),
        "recursive doubling needs a power of two, got {nranks}"
    );
    let mut steps = Vec::new();
    let mut d = 1;
    while d < nranks {
        let peer = rank ^ d;
        let mine = rank & !(d - 1);
        let theirs = peer & !(d - 1);
        for b in mine..mine + d {
            for c in 0..nchunks {
                steps.push(Step::Send {
                    peer,
                    unit: Unit::new(b, c),
                });
            }
        }
        for b in theirs..theirs + d {
            for c in 0..nchunks {
                steps.push(Step::Recv {
                    peer,
                    unit: Unit::new(b, c),
                });
            }
        }
        d *= 2;
    }
    steps
}
