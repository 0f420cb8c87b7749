//! Pipelined ring allgather.
//!
//! Rank r sends to r+1 and receives from r-1 (mod n). In step s (0..n-1) it sends block r-s
//! (its own first, then each block it received in the step before) and receives block r-s-1.
//! Blocks are cut in chunks, and the schedule interleaves per chunk — "send chunk c of block
//! r-s, receive chunk c of block r-s-1" — so a chunk received from the left can go on to the
//! right as soon as it is here, while later chunks of the same block are still arriving.
//! Each rank sends and receives (n-1) blocks: the minimum, so this is the algorithm for
//! large calls; its latency is n-1 hops (plus one chunk per hop of pipeline fill).

use super::{sub_mod, Step, Unit};

pub fn steps(rank: usize, nranks: usize, nchunks: usize) -> Vec<Step> {
    let all: Vec<usize> = (0..nranks).collect();
    steps_over(&all, rank, nchunks)
}

/// The ring over `members` (ranks, in ring order) of the member at `pos`, gathering the
/// members' own blocks: the flat ring is the ring over every rank; the hierarchical schedule
/// runs one over each rail.
pub fn steps_over(members: &[usize], pos: usize, nchunks: usize) -> Vec<Step> {
    let n = members.len();
    let right = members[(pos + 1) % n];
    let left = members[sub_mod(pos, 1, n)];
    let mut steps = Vec::with_capacity(2 * n.saturating_sub(1) * nchunks);
    for s in 0..n.saturating_sub(1) {
        let send_block = members[sub_mod(pos, s, n)];
        let recv_block = members[sub_mod(pos, s + 1, n)];
        for c in 0..nchunks {
            steps.push(Step::Send {
                peer: right,
                unit: Unit::new(send_block, c),
            });
            steps.push(Step::Recv {
                peer: left,
                unit: Unit::new(recv_block, c),
            });
        }
    }
    steps
}
