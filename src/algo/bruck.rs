//! Bruck allgather (any rank count).
//!
//! Rank r holds blocks r, r+1, ..., r+h-1 (mod n), h doubling each round. In round k
//! (distance d = 2^k, while d < n) it sends the first min(d, n-d) of them to r-d and receives
//! blocks r+d .. r+d+min(d, n-d)-1 from r+d. After ceil(log2 n) rounds it holds all n.
//! Blocks are written straight to their final place (block b at offset b), so the final
//! rotation of the textbook version is not needed. Each rank sends and receives n-1 blocks.

use super::{Step, Unit};

pub fn steps(rank: usize, nranks: usize, nchunks: usize) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut d = 1;
    while d < nranks {
        let cnt = d.min(nranks - d);
        let to = (rank + nranks - d) % nranks;
        let from = (rank + d) % nranks;
        for j in 0..cnt {
            for c in 0..nchunks {
                steps.push(Step::Send {
                    peer: to,
                    unit: Unit::new((rank + j) % nranks, c),
                });
            }
        }
        for j in 0..cnt {
            for c in 0..nchunks {
                steps.push(Step::Recv {
                    peer: from,
                    unit: Unit::new((from + j) % nranks, c),
                });
            }
        }
        d *= 2;
    }
    steps
}
