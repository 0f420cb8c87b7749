//! Direct allgather: every rank sends its own block straight to every other rank.
//!
//! Rank r, for each chunk c: for k in 1..n, send chunk c of block r to rank r+k and receive
//! chunk c of block r-k from rank r-k (mod n). Nothing is forwarded, so no rank waits for a
//! block to travel through others: all of a rank's work is available when the call starts.
//! Each rank sends n-1 copies of its block and receives n-1 blocks, the same bytes as the
//! ring. Used on one host where receivers copy straight out of the sender's memory (single-copy
//! shm): the sender then sends only addresses, and every byte is copied once, by its receiver.
//! Over a network it would put n-1 flows on every sender's link at once (incast at scale): the
//! ring is the choice there.

use super::{sub_mod, Step, Unit};

pub fn steps(rank: usize, nranks: usize, nchunks: usize) -> Vec<Step> {
    let mut steps = Vec::with_capacity(2 * nranks.saturating_sub(1) * nchunks);
    for c in 0..nchunks {
        for k in 1..nranks {
            steps.push(Step::Send {
                peer: (rank + k) % nranks,
                unit: Unit::new(rank, c),
            });
            let src = sub_mod(rank, k, nranks);
            steps.push(Step::Recv {
                peer: src,
                unit: Unit::new(src, c),
            });
        }
    }
    steps
}
