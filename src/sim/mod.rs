//! `ciera sim`: a model of the compressed Allgather and of FSDP training, to project CIERA to
//! clusters we do not have and to check the model against calls measured here.
//!
//! - [`net`]: the time of one Allgather (ring or hierarchical schedule, raw or with a codec) on
//!   a [`net::Cluster`], a bottleneck model per schedule step;
//! - [`train`]: one FSDP iteration (per-block units, prefetch, backward re-gather, gradient
//!   reduce-scatter) from per-unit gather and compute times;
//! - [`model`]: MoE transformer presets and their FSDP units;
//! - [`svg`]: the plot.
//!
//! This module is pure arithmetic: the codec throughputs and ratios it needs are measured or
//! read by the caller (`cli::sim`) and passed in.
#![forbid(unsafe_code)]

pub mod model;
pub mod net;
pub mod svg;
pub mod train;

use net::{Cluster, Codec, CodecHost, Compression, Hops, Link, Schedule};

/// A cluster preset: its name, the cluster of one node (nodes are set per projection point),
/// the GPU's dense bf16 peak in TFLOP/s, and a line saying where the numbers come from.
pub struct ClusterPreset {
    pub name: &'static str,
    pub cluster: Cluster,
    pub peak_tflops: f64,
    pub about: &'static str,
}

/// Efficiency assumed for NVLink (achieved / nominal per direction) and for IB / Ethernet
/// (payload over line rate).
pub const NVLINK_EFF: f64 = 0.8;
pub const NIC_EFF: f64 = 0.9;

/// The cluster presets.
pub fn cluster_presets() -> Vec<ClusterPreset> {
    let node = |name: &str, nvlink_gbs: f64, nic_gbit: f64, nics: usize, nic_lat_us: f64| Cluster {
        name: name.to_string(),
        gpus_per_node: 8,
        nodes: 1,
        intra: Link::gbytes(nvlink_gbs * NVLINK_EFF, 3.0),
        intra_shared: None,
        inter: Link::gbit(nic_gbit, NIC_EFF, nic_lat_us),
        nics_per_node: nics,
        codec: CodecHost::Gpu,
    };
    vec![
        ClusterPreset {
            name: "a100-ib200",
            cluster: node("a100-ib200", 300.0, 200.0, 8, 5.0),
            peak_tflops: 312.0,
            about: "8x A100 per node, NVLink 3 (300 GB/s per direction), 8x 200 Gbit/s HDR IB",
        },
        ClusterPreset {
            name: "a100-ib200x1",
            cluster: node("a100-ib200x1", 300.0, 200.0, 1, 5.0),
            peak_tflops: 312.0,
            about: "8x A100 per node, NVLink 3, one 200 Gbit/s IB NIC per node (the paper's testbed shape)",
        },
        ClusterPreset {
            name: "h100-ib400",
            cluster: node("h100-ib400", 450.0, 400.0, 8, 5.0),
            peak_tflops: 989.0,
            about: "8x H100 SXM per node, NVLink 4 (450 GB/s per direction), 8x 400 Gbit/s NDR IB",
        },
        ClusterPreset {
            name: "h200-ib400",
            cluster: node("h200-ib400", 450.0, 400.0, 8, 5.0),
            peak_tflops: 989.0,
            about: "8x H200 per node, NVLink 4 (450 GB/s per direction), 8x 400 Gbit/s NDR IB",
        },
        ClusterPreset {
            name: "h100-eth100",
            cluster: node("h100-eth100", 450.0, 100.0, 1, 10.0),
            peak_tflops: 989.0,
            about: "8x H100 SXM per node, NVLink 4, one 100 Gbit/s Ethernet NIC per node",
        },
    ]
}

/// The Allgather methods the projection compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Uncompressed, the faster of the multi-channel ring (NCCL) and the hierarchical schedule.
    Raw,
    /// CIERA, exponent cache.
    CieraExp,
    /// CIERA, full-value cache (Exp / Hybrid frames).
    CieraFull,
    /// CIERA, delta cache (Delta frames, #21).
    CieraDelta,
    /// The CIERA paper's scheme: blocks of 512 sent whole when any exponent changed.
    Block512,
    /// Lossy int8 weight quantization (ZeRO++ qwZ style).
    Int8,
    /// An entropy-coded lossless codec (DietGPU style).
    DietGpu,
}

impl Method {
    pub const ALL: [Method; 7] = [
        Method::Raw,
        Method::CieraExp,
        Method::CieraFull,
        Method::CieraDelta,
        Method::Block512,
        Method::Int8,
        Method::DietGpu,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::Raw => "raw",
            Method::CieraExp => "ciera-exp",
            Method::CieraFull => "ciera-full",
            Method::CieraDelta => "ciera-delta",
            Method::Block512 => "block512",
            Method::Int8 => "int8 (lossy)",
            Method::DietGpu => "dietgpu",
        }
    }
}

/// Wire ratios and GPU codec throughputs per method: what the projection assumes.
#[derive(Clone, Debug, PartialEq)]
pub struct MethodInputs {
    /// Ratio of each compressing method on the gathered bf16 weights.
    pub ratio_exp: f64,
    pub ratio_full: f64,
    pub ratio_delta: f64,
    pub ratio_block512: f64,
    pub ratio_int8: f64,
    pub ratio_dietgpu: f64,
    /// GPU codec throughput (encode = decode, raw bytes/s) per method.
    pub gpu_exp_bps: f64,
    pub gpu_full_bps: f64,
    pub gpu_delta_bps: f64,
    pub gpu_int8_bps: f64,
    pub gpu_dietgpu_bps: f64,
    pub chunk_bytes: f64,
}

impl MethodInputs {
    /// The compression a method applies (None for raw). CIERA and the others code the
    /// inter-node hops; frames are decoded where they enter a node.
    pub fn compression(&self, m: Method) -> Option<Compression> {
        let (ratio, bps) = match m {
            Method::Raw => return None,
            Method::CieraExp => (self.ratio_exp, self.gpu_exp_bps),
            Method::CieraFull => (self.ratio_full, self.gpu_full_bps),
            Method::CieraDelta => (self.ratio_delta, self.gpu_delta_bps),
            Method::Block512 => (self.ratio_block512, self.gpu_exp_bps),
            Method::Int8 => (self.ratio_int8, self.gpu_int8_bps),
            Method::DietGpu => (self.ratio_dietgpu, self.gpu_dietgpu_bps),
        };
        Some(Compression {
            codec: Codec {
                ratio,
                encode_bps: bps,
                decode_bps: bps,
            },
            hops: Hops::InterNode,
            chunk_bytes: self.chunk_bytes,
        })
    }
}

/// The time of one gather of `bytes` with method `m` on `c`: raw takes the faster of the
/// multi-channel ring and the hierarchical schedule; a compressing method takes the
/// hierarchical schedule with frames on the inter-node hops, or raw where that is faster (the
/// net-benefit choice).
pub fn gather_time(c: &Cluster, inputs: &MethodInputs, m: Method, bytes: f64) -> (f64, bool) {
    let channels = c.nics_per_node.min(c.gpus_per_node).max(1);
    let ring = net::allgather(c, Schedule::Ring { channels }, bytes, None).total_s;
    let hier = net::allgather(c, Schedule::Hierarchical, bytes, None).total_s;
    let raw = ring.min(hier);
    match inputs.compression(m) {
        None => (raw, false),
        Some(k) => {
            let z = net::allgather(c, Schedule::Hierarchical, bytes, Some(&k)).total_s;
            if z < raw {
                (z, true)
            } else {
                (raw, false)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> MethodInputs {
        MethodInputs {
            ratio_exp: 1.9,
            ratio_full: 2.1,
            ratio_delta: 4.0,
            ratio_block512: 1.0,
            ratio_int8: 1.98,
            ratio_dietgpu: 1.5,
            gpu_exp_bps: 400e9,
            gpu_full_bps: 300e9,
            gpu_delta_bps: 150e9,
            gpu_int8_bps: 1000e9,
            gpu_dietgpu_bps: 400e9,
            chunk_bytes: 1048576.0,
        }
    }

    /// Inside one node nothing is compressed (only inter-node hops carry frames); across
    /// nodes on a slow NIC the ratio shows; a ratio of 1 never beats raw.
    #[test]
    fn compression_only_pays_across_nodes() {
        let p = cluster_presets();
        let eth = &p.iter().find(|p| p.name == "h100-eth100").unwrap().cluster;
        let one = eth.clone();
        let (_, z) = gather_time(&one, &inputs(), Method::CieraDelta, 1e9);
        assert!(!z);
        let mut four = eth.clone();
        four.nodes = 4;
        let (raw, _) = gather_time(&four, &inputs(), Method::Raw, 1e9);
        let (delta, z) = gather_time(&four, &inputs(), Method::CieraDelta, 1e9);
        assert!(z);
        assert!(raw / delta > 3.0 && raw / delta < 4.0, "{}", raw / delta);
        let (b512, z) = gather_time(&four, &inputs(), Method::Block512, 1e9);
        assert!(!z);
        assert_eq!(b512, raw);
    }
}
