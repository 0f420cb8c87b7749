//! Hierarchical ("rail") allgather for ranks on several hosts, the same number on each.
//!
//! With N hosts of L ranks, the rank with local index j on host h (local index = its place
//! among its host's ranks, by rank number) is on *rail* j: the N ranks of local index j, one
//! per host. Two phases, each a pipelined ring:
//!
//! 1. **Across hosts, per rail**: a ring over the rail's N ranks, ordered by host, gathers
//!    the rail's N blocks. Every network hop carries only its rail's blocks: a host sends
//!    L(N-1) blocks out, against the flat ring's NL-1 through one hop.
//! 2. **Within a host**: a ring over the host's L ranks passes every rail's bundle of N blocks
//!    on, L-1 steps, so every rank ends with all NL blocks.
//!
//! Each rank still sends and receives exactly n-1 blocks. The phases are separate lanes (the
//! rail peers and the host peers differ), so phase 2 forwards a block while phase 1 is still
//! receiving it (cut-through): the host ring runs behind the network by a chunk, not a phase.
//! Blocks travel as they are, frames included, so a compressed call moves frames over the
//! network hops and decodes each once per rank, as the flat ring does.

use super::{sub_mod, Step, Topology, Unit};

/// The ranks of every host, in host order, each host's ranks in rank order, when every host
/// has the same number of ranks (else None: the hierarchical schedule needs rails).
pub fn layout(topology: &Topology) -> Option<Vec<Vec<usize>>> {
    let mut hosts: Vec<Vec<usize>> = vec![Vec::new(); topology.hosts()];
    for r in 0..topology.nranks() {
        hosts[topology.host_of(r)].push(r);
    }
    let l = hosts.first()?.len();
    hosts.iter().all(|h| h.len() == l).then_some(hosts)
}

/// Whether the hierarchical schedule applies and differs from a flat ring: more than one host,
/// more than one rank on each, the same number on each.
pub fn applies(topology: &Topology) -> bool {
    topology.hosts() > 1 && layout(topology).is_some_and(|h| h[0].len() > 1)
}

pub fn steps(rank: usize, topology: &Topology, nchunks: usize) -> Vec<Step> {
    let hosts = layout(topology).expect("the hierarchical schedule needs equal hosts");
    let (n, l) = (hosts.len(), hosts[0].len());
    let h = topology.host_of(rank);
    let j = hosts[h]
        .iter()
        .position(|&r| r == rank)
        .expect("rank on its host");
    // Phase 1: the rail ring across hosts, ordered by host: in step s this rank sends the
    // block of the rail member on host h-s (its own first) and receives the one on h-s-1.
    let rail: Vec<usize> = hosts.iter().map(|host| host[j]).collect();
    let mut steps = super::ring::steps_over(&rail, h, nchunks);
    // Phase 2: the host ring. In step s, pass on the bundle of local index j-s (this rank's
    // own rail first), receive that of j-s-1. A bundle's blocks go in the order its rail
    // member received them: hosts h, h-1, h-2, ...
    let (next, prev) = (hosts[h][(j + 1) % l], hosts[h][sub_mod(j, 1, l)]);
    for s in 0..l - 1 {
        let (send, recv) = (sub_mod(j, s, l), sub_mod(j, s + 1, l));
        for k in 0..n {
            let host = sub_mod(h, k, n);
            for c in 0..nchunks {
                steps.push(Step::Send {
                    peer: next,
                    unit: Unit::new(hosts[host][send], c),
                });
                steps.push(Step::Recv {
                    peer: prev,
                    unit: Unit::new(hosts[host][recv], c),
                });
            }
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_need_equal_hosts() {
        let t = Topology::new(&[0, 0, 1, 1, 2, 2], false);
        assert_eq!(layout(&t), Some(vec![vec![0, 1], vec![2, 3], vec![4, 5]]));
        assert!(applies(&t));
        // Interleaved placement: host of rank r is r % 2.
        let t = Topology::new(&[0, 1, 0, 1], false);
        assert_eq!(layout(&t), Some(vec![vec![0, 2], vec![1, 3]]));
        assert!(applies(&t));
        assert_eq!(layout(&Topology::new(&[0, 0, 1], false)), None);
        assert!(!applies(&Topology::new(&[0, 0, 1], false)));
        assert!(!applies(&Topology::single_host(4)));
        assert!(!applies(&Topology::new(&[0, 1, 2], false)));
    }

    #[test]
    fn network_hops_carry_only_their_rail() {
        // 2 hosts x 3 ranks: a rank's sends to the other host are its rail's N-1 = 1 block;
        // the rest (L-1 bundles of N = 2 blocks) stay on its host.
        let t = Topology::new(&[0, 0, 0, 1, 1, 1], false);
        for r in 0..6 {
            let s = steps(r, &t, 1);
            let (mut net, mut local) = (0, 0);
            for st in &s {
                if let Step::Send { peer, .. } = *st {
                    if t.host_of(peer) == t.host_of(r) {
                        local += 1;
                    } else {
                        net += 1;
                    }
                }
            }
            assert_eq!((net, local), (1, 4), "rank {r}: {s:?}");
        }
    }
}
