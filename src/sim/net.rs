//! The time of one Allgather on a cluster: a bottleneck model per schedule step.
//!
//! A call gathers `S` bytes over `N = nodes x gpus_per_node` ranks; each rank owns a block
//! `b = S / N`. A schedule is a sequence of steps in which every rank sends one piece to one
//! peer (the ring and the hierarchical schedule of `crate::algo` are both such sequences). A
//! step takes as long as its most loaded resource, plus the latency of the slowest hop it uses:
//! - a GPU's (rank's) own intra-node link: the bytes it sends in the step / the link rate;
//! - a node's shared intra-node capacity, if any (a shaped loopback that all local traffic
//!   crosses): the node's intra-node bytes in the step / the capacity;
//! - a node's NICs: the bytes leaving the node in the step / (NICs used x NIC rate).
//!
//! With compression, the hops that carry frames carry `bytes / ratio`. The codec encodes a
//! rank's own block once and decodes every block it receives in frames; within a phase of the
//! schedule (the ring; the rail ring, then the host ring of the hierarchical schedule) it runs
//! pipelined with the transfers (chunk by chunk), so a phase takes `max(wire, codec)`, and the
//! call the sum over its phases plus `fill` (one chunk's encode before the first send and one
//! chunk's decode after the last receive) plus the latency. A codec on the host shares the node's
//! cores with the node's ranks. Rates are goodput: a link's line rate times its framing
//! efficiency (payload per frame over bytes per frame on the wire, e.g. 1448 / 1514 for TCP on
//! a 1500-byte MTU), so no parameter is fitted to a measurement.

/// One kind of link: goodput in bytes/s per direction and the latency of one message over it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub bytes_per_s: f64,
    pub latency_s: f64,
}

impl Link {
    /// A link of `gbit` Gbit/s line rate, `eff` framing efficiency and `lat_us` latency.
    pub fn gbit(gbit: f64, eff: f64, lat_us: f64) -> Link {
        Link {
            bytes_per_s: gbit * 1e9 / 8.0 * eff,
            latency_s: lat_us * 1e-6,
        }
    }

    /// A link of `gbs` GB/s (decimal) goodput and `lat_us` latency.
    pub fn gbytes(gbs: f64, lat_us: f64) -> Link {
        Link {
            bytes_per_s: gbs * 1e9,
            latency_s: lat_us * 1e-6,
        }
    }
}

/// Where the codec runs: one per rank on its GPU, or on the host's cores, shared by the
/// node's ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CodecHost {
    /// The codec on each rank's GPU; the transport costs no compute (DMA, RDMA, NVLink).
    Gpu,
    /// The codec and the transport's byte handling on the node's cores.
    Cpu(HostCpu),
}

/// A node's cores and what moving a byte costs them: CPU seconds per byte, charged once on the
/// sending side and once on the receiving side (a TCP send or receive through the kernel; a
/// copy into or out of a shared-memory ring).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostCpu {
    pub cores_per_node: f64,
    pub intra_s_per_byte: f64,
    pub inter_s_per_byte: f64,
}

/// A cluster: nodes of GPUs (or host ranks), their links and where the codec runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    pub name: String,
    pub gpus_per_node: usize,
    pub nodes: usize,
    /// A rank's link to the other ranks of its node (NVLink; shared memory; TCP loopback).
    pub intra: Link,
    /// Bytes/s that all of a node's intra-node traffic shares (a shaped loopback), if limited.
    pub intra_shared: Option<f64>,
    /// One NIC.
    pub inter: Link,
    pub nics_per_node: usize,
    pub codec: CodecHost,
}

impl Cluster {
    pub fn ranks(&self) -> usize {
        self.gpus_per_node * self.nodes
    }
}

/// The schedule of the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// One ring over all ranks, node by node, split in `channels` rings that each leave a node
    /// through their own NIC (NCCL's channels; CIERA's host ring is one channel).
    Ring { channels: usize },
    /// A ring per rail across the nodes (rank i of every node), then a ring inside each node
    /// forwarding what the rail brought (`crate::algo::hier`).
    Hierarchical,
}

/// Which hops carry frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hops {
    /// Every hop (what CIERA does today: frames are forwarded along the ring).
    All,
    /// Only hops between nodes; frames are decoded where they enter a node and the intra-node
    /// phase moves raw values (the hierarchical schedule only; a ring treats it as `All`).
    InterNode,
}

/// A codec: its wire ratio and its encode / decode throughput in raw bytes per second on one
/// codec unit (a GPU, or a host core).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Codec {
    pub ratio: f64,
    pub encode_bps: f64,
    pub decode_bps: f64,
}

/// Compression of a call: the codec, the hops it covers and the pipelining chunk.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Compression {
    pub codec: Codec,
    pub hops: Hops,
    pub chunk_bytes: f64,
}

/// The predicted time of one call and its parts (seconds).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallTime {
    /// Bandwidth-bound transfer time, summed over steps.
    pub wire_s: f64,
    /// Latency, summed over steps.
    pub latency_s: f64,
    /// Codec work on the critical rank (after sharing cores), 0 when raw.
    pub codec_s: f64,
    /// Pipeline fill and drain of the codec, 0 when raw.
    pub fill_s: f64,
    /// Host CPU time per node (codec and moving bytes) over its cores; 0 on GPUs when raw.
    pub cpu_s: f64,
    pub total_s: f64,
}

/// Bytes one step moves, per rank on an intra-node hop and per node across nodes.
struct Step {
    /// Bytes a rank sends to a rank of its own node in this step.
    intra_per_rank: f64,
    /// Ranks of a node sending intra-node in this step.
    intra_senders: f64,
    /// Bytes leaving a node in this step, and over how many NICs they spread.
    inter_per_node: f64,
    inter_nics: f64,
    crosses_nodes: bool,
}

fn step_time(c: &Cluster, s: &Step) -> (f64, f64) {
    let mut t = 0f64;
    if s.intra_per_rank > 0.0 {
        t = t.max(s.intra_per_rank / c.intra.bytes_per_s);
        if let Some(cap) = c.intra_shared {
            t = t.max(s.intra_per_rank * s.intra_senders / cap);
        }
    }
    if s.inter_per_node > 0.0 {
        t = t.max(s.inter_per_node / (s.inter_nics.max(1.0) * c.inter.bytes_per_s));
    }
    let lat = if s.crosses_nodes {
        c.inter.latency_s
    } else {
        c.intra.latency_s
    };
    (t, lat)
}

/// The time of one Allgather of `bytes` in all (`bytes / ranks` per rank) on `c` with `sched`,
/// raw (`comp` None) or compressed.
pub fn allgather(c: &Cluster, sched: Schedule, bytes: f64, comp: Option<&Compression>) -> CallTime {
    let n = c.ranks();
    if n <= 1 {
        return CallTime::default();
    }
    let (l, nn) = (c.gpus_per_node as f64, c.nodes as f64);
    let b = bytes / n as f64;
    let ratio = comp.map(|k| k.codec.ratio.max(1e-9)).unwrap_or(1.0);
    let inter_only =
        matches!(comp, Some(k) if k.hops == Hops::InterNode) && sched == Schedule::Hierarchical;
    let (intra_div, inter_div) = if inter_only {
        (1.0, ratio)
    } else {
        (ratio, ratio)
    };
    // Phases: their steps, how many, and the blocks a rank encodes and decodes during them.
    let mut steps: Vec<(Step, usize, f64, f64)> = Vec::new();
    match sched {
        Schedule::Ring { channels } => {
            let ch = channels.max(1) as f64;
            let step = if c.nodes == 1 {
                Step {
                    intra_per_rank: b / intra_div,
                    intra_senders: l,
                    inter_per_node: 0.0,
                    inter_nics: 1.0,
                    crosses_nodes: false,
                }
            } else {
                Step {
                    intra_per_rank: if c.gpus_per_node > 1 {
                        b / intra_div
                    } else {
                        0.0
                    },
                    intra_senders: l - 1.0,
                    // One edge of each channel leaves the node, carrying b / channels.
                    inter_per_node: b / inter_div,
                    inter_nics: ch.min(c.nics_per_node as f64),
                    crosses_nodes: true,
                }
            };
            steps.push((step, n - 1, 1.0, (n - 1) as f64));
        }
        Schedule::Hierarchical => {
            if c.nodes > 1 {
                // Rail phase: every rank sends a block to its rail peer on the next node.
                steps.push((
                    Step {
                        intra_per_rank: 0.0,
                        intra_senders: 0.0,
                        inter_per_node: l * b / inter_div,
                        inter_nics: l.min(c.nics_per_node as f64),
                        crosses_nodes: true,
                    },
                    c.nodes - 1,
                    1.0,
                    nn - 1.0,
                ));
            }
            if c.gpus_per_node > 1 {
                // Host phase: every rank forwards what its rail gathered (nodes blocks).
                steps.push((
                    Step {
                        intra_per_rank: nn * b / intra_div,
                        intra_senders: l,
                        inter_per_node: 0.0,
                        inter_nics: 1.0,
                        crosses_nodes: false,
                    },
                    c.gpus_per_node - 1,
                    if c.nodes > 1 { 0.0 } else { 1.0 },
                    if inter_only { 0.0 } else { (l - 1.0) * nn },
                ));
            }
        }
    }
    // On a GPU every rank codes on its own device; on a host the node's ranks share its cores.
    let share = match c.codec {
        CodecHost::Gpu => 1.0,
        CodecHost::Cpu(h) => (l / h.cores_per_node.max(1e-9)).max(1.0),
    };
    let mut out = CallTime::default();
    let mut phases = 0.0;
    for (s, count, enc_blocks, dec_blocks) in &steps {
        let (t, lat) = step_time(c, s);
        let wire = t * *count as f64;
        let codec = comp.map_or(0.0, |k| {
            (enc_blocks * b / k.codec.encode_bps + dec_blocks * b / k.codec.decode_bps) * share
        });
        // Host cores also move the bytes: each byte of a step is sent and received on a node.
        let moving = match c.codec {
            CodecHost::Gpu => 0.0,
            CodecHost::Cpu(h) => {
                let intra = s.intra_per_rank * s.intra_senders * 2.0 * h.intra_s_per_byte;
                let inter = s.inter_per_node * 2.0 * h.inter_s_per_byte;
                (intra + inter) * *count as f64 / h.cores_per_node.max(1e-9)
            }
        };
        out.wire_s += wire;
        out.codec_s += codec;
        out.cpu_s += codec + moving;
        out.latency_s += lat * *count as f64;
        phases += wire.max(codec + moving);
    }
    if let Some(k) = comp {
        let chunk = k.chunk_bytes.min(b);
        out.fill_s = (chunk / k.codec.encode_bps + chunk / k.codec.decode_bps) * share;
    }
    out.total_s = phases + out.fill_s + out.latency_s;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shaped_loopback(ranks: usize, gbit: f64) -> Cluster {
        Cluster {
            name: "t".into(),
            gpus_per_node: ranks,
            nodes: 1,
            intra: Link::gbytes(2.0, 0.0),
            intra_shared: Some(gbit * 1e9 / 8.0),
            inter: Link::gbytes(1.0, 0.0),
            nics_per_node: 1,
            codec: CodecHost::Cpu(HostCpu {
                cores_per_node: 2.0,
                intra_s_per_byte: 0.0,
                inter_s_per_byte: 0.0,
            }),
        }
    }

    /// One shaped loopback carries every block to every other rank: (N-1) x S bytes.
    #[test]
    fn shared_loopback_carries_n_minus_one_times_the_data() {
        let c = shaped_loopback(4, 1.0);
        let t = allgather(&c, Schedule::Ring { channels: 1 }, 16.0 * 1048576.0, None);
        let want = 3.0 * 16.0 * 1048576.0 / 125e6;
        assert!((t.total_s - want).abs() < 1e-12, "{t:?} vs {want}");
    }

    /// Compression divides the wire time by the ratio while the codec keeps up, and the codec
    /// bounds the call when it does not (then raw is faster).
    #[test]
    fn compressed_call_is_wire_or_codec_bound() {
        let c = shaped_loopback(4, 1.0);
        let s = 16.0 * 1048576.0;
        let fast = Compression {
            codec: Codec {
                ratio: 2.0,
                encode_bps: 1e12,
                decode_bps: 1e12,
            },
            hops: Hops::All,
            chunk_bytes: 1048576.0,
        };
        let raw = allgather(&c, Schedule::Ring { channels: 1 }, s, None);
        let z = allgather(&c, Schedule::Ring { channels: 1 }, s, Some(&fast));
        assert!((z.wire_s * 2.0 - raw.wire_s).abs() < 1e-12);
        let slow = Compression {
            codec: Codec {
                ratio: 2.0,
                encode_bps: 1e7,
                decode_bps: 1e7,
            },
            ..fast
        };
        let z = allgather(&c, Schedule::Ring { channels: 1 }, s, Some(&slow));
        // 4 ranks on 2 cores: each rank's codec runs at half speed; it encodes 1 block and
        // decodes 3.
        let b = s / 4.0;
        assert!((z.codec_s - 2.0 * 4.0 * b / 1e7).abs() < 1e-9);
        assert_eq!(z.total_s, z.codec_s + z.fill_s + z.latency_s);
        // Raw is faster: the net-benefit choice (`sim::gather_time`) keeps raw.
        assert!(z.total_s > raw.total_s, "{z:?} vs {raw:?}");
    }

    /// On a host, moving bytes costs the node's cores too: a call whose CPU work exceeds its
    /// wire time takes the CPU time.
    #[test]
    fn host_cpu_bounds_a_fast_link() {
        let mut c = shaped_loopback(4, 100.0);
        c.codec = CodecHost::Cpu(HostCpu {
            cores_per_node: 2.0,
            intra_s_per_byte: 1e-9,
            inter_s_per_byte: 0.0,
        });
        let s = 16.0 * 1048576.0;
        let t = allgather(&c, Schedule::Ring { channels: 1 }, s, None);
        // 3 steps, 4 senders x 4 MiB each, sent and received: 2 x 48 MiB x 1 ns over 2 cores.
        let cpu = 3.0 * 4.0 * (s / 4.0) * 2.0 * 1e-9 / 2.0;
        assert!((t.cpu_s - cpu).abs() < 1e-12, "{t:?}");
        assert!(t.wire_s < cpu);
        assert_eq!(t.total_s, cpu + t.latency_s);
    }

    /// Two nodes of two ranks, one NIC each: the flat ring sends a block over each node's NIC
    /// in every one of its 3 steps; the hierarchical schedule does it in 1 step for both rails.
    #[test]
    fn hierarchical_crosses_the_nics_less() {
        let c = Cluster {
            name: "t".into(),
            gpus_per_node: 2,
            nodes: 2,
            intra: Link::gbytes(1e3, 0.0),
            intra_shared: None,
            inter: Link::gbytes(1.0, 0.0),
            nics_per_node: 1,
            codec: CodecHost::Gpu,
        };
        let s = 4e9;
        let ring = allgather(&c, Schedule::Ring { channels: 1 }, s, None);
        let hier = allgather(&c, Schedule::Hierarchical, s, None);
        assert!((ring.wire_s - 3.0).abs() < 1e-9, "{ring:?}");
        // rail: 2 blocks of 1 GB leave each node over its one NIC; host: 2 GB over 1 TB/s.
        assert!((hier.wire_s - (2.0 + 0.002)).abs() < 1e-9, "{hier:?}");
    }

    /// Compressing only the inter-node hops decodes only the blocks that came over them.
    #[test]
    fn inter_node_only_decodes_rail_blocks() {
        let c = Cluster {
            name: "t".into(),
            gpus_per_node: 8,
            nodes: 4,
            intra: Link::gbytes(400.0, 0.0),
            intra_shared: None,
            inter: Link::gbytes(50.0, 0.0),
            nics_per_node: 8,
            codec: CodecHost::Gpu,
        };
        let k = Compression {
            codec: Codec {
                ratio: 2.0,
                encode_bps: 100e9,
                decode_bps: 100e9,
            },
            hops: Hops::InterNode,
            chunk_bytes: 1e6,
        };
        let s = 32e9;
        let t = allgather(&c, Schedule::Hierarchical, s, Some(&k));
        let b = 1e9;
        assert!((t.codec_s - (b + 3.0 * b) / 100e9).abs() < 1e-12, "{t:?}");
        // rail: 3 steps of 8 GB / 2 over 8 NICs; host: 7 steps of 4 GB raw over 400 GB/s.
        let want = 3.0 * (8e9 / 2.0) / (8.0 * 50e9) + 7.0 * 4e9 / 400e9;
        assert!((t.wire_s - want).abs() < 1e-12, "{t:?} vs {want}");
    }
}
