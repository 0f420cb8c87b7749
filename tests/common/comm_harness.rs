//! Shared by the tests/comm_*.rs binaries: rank programs ("roles") that a test runs as real
//! processes by re-executing its own test binary (`rank_main` with CIERA_TEST_ROLE set), and
//! helpers to start them directly or under `ciera launch`.
//!
//! Every role prints one line `RESULT <what>` on stderr before it exits, so a test can check
//! what each rank saw (exact error kind and culprit), not just exit codes.
#![allow(dead_code)]

use std::io::Read;
use std::ops::DerefMut;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use ciera::algo::{Algo, AlgoChoice};
use ciera::comm::{ChunkRef, Communicator, Config, FrameCodec, FrameEncoder, UniqueId};
use ciera::{DType, Error, Result};
use ciera_transport::SingleCopy;

pub const COUNTS: [usize; 5] = [0, 1, 7, 1000, 1_000_003];

pub fn ciera_bin() -> &'static str {
    env!("CARGO_BIN_EXE_ciera")
}

/// The test binary itself, with arguments that run only `rank_main`.
pub fn self_cmd() -> Command {
    let exe = std::env::current_exe().expect("test binary path");
    let mut c = Command::new(exe);
    c.args([
        "rank_main",
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "-q",
    ]);
    c
}

pub fn self_args() -> Vec<String> {
    let exe: PathBuf = std::env::current_exe().expect("test binary path");
    vec![
        exe.to_string_lossy().into_owned(),
        "rank_main".into(),
        "--exact".into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
        "-q".into(),
    ]
}

/// `ciera launch -n N -- <this test binary> rank_main` with `role` and extra env.
pub fn launch(n: usize, role: &str, env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(ciera_bin());
    // No CPU binding: tests run several jobs at once, and bound ranks of different jobs
    // would pile onto the same CPUs.
    c.args([
        "launch",
        "-n",
        &n.to_string(),
        "--grace",
        "20",
        "--bind",
        "none",
        "--",
    ])
    .args(self_args());
    c.env("CIERA_TEST_ROLE", role);
    for (k, v) in env {
        c.env(k, v);
    }
    c.stdin(Stdio::null());
    c.output().expect("run ciera launch")
}

/// Start rank `rank` of `n` of job `id` directly (no launcher), stderr piped.
pub fn spawn_rank(id: &UniqueId, n: usize, rank: usize, role: &str, env: &[(&str, &str)]) -> Child {
    let mut c = self_cmd();
    c.env("CIERA_TEST_ROLE", role)
        .env("CIERA_TEST_ID", hex(id.as_bytes()))
        .env("CIERA_TEST_NRANKS", n.to_string())
        .env("CIERA_TEST_RANK", rank.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("spawn rank")
}

pub fn stderr_of(mut child: Child) -> (std::process::ExitStatus, String) {
    let mut s = String::new();
    child.stderr.take().unwrap().read_to_string(&mut s).unwrap();
    (child.wait().unwrap(), s)
}

/// Print `RESULT <what>` as one write (pipes keep writes under 4 KiB whole, so lines from
/// ranks sharing a stderr do not interleave).
pub fn report(what: &str) {
    let mut what = what.replace('\n', " ");
    what.truncate(3000);
    report_raw(&format!("RESULT {what}"));
}

pub fn report_raw(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// The value of `key=value` in a `RESULT` line (its words split on whitespace); panics naming
/// the line where it has none.
pub fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key} in {line}"))
}

pub fn result_lines(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("RESULT ").map(str::to_string))
        .collect()
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn env_usize(name: &str) -> usize {
    std::env::var(name)
        .unwrap_or_else(|_| panic!("{name} not set"))
        .parse()
        .unwrap()
}

/// The communicator of a directly spawned rank.
pub fn comm_from_test_env(config: Config) -> Result<Communicator> {
    let b = unhex(&std::env::var("CIERA_TEST_ID").expect("CIERA_TEST_ID"));
    let id = UniqueId::from_bytes(&b.try_into().expect("128-byte id"))?;
    Communicator::init_rank(
        &id,
        env_usize("CIERA_TEST_NRANKS"),
        env_usize("CIERA_TEST_RANK"),
        config,
    )
}

/// How a result is reported: `ok`, or the error kind with the culprit where there is one.
pub fn describe(r: &Result<()>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(Error::PeerFailed { peer, detail }) => format!("peer_failed peer={peer} :: {detail}"),
        Err(Error::Timeout { peer, op, .. }) => format!("timeout peer={peer:?} :: {op}"),
        Err(Error::CallMismatch { detail }) => format!("call_mismatch :: {detail}"),
        Err(Error::Aborted { detail }) => format!("aborted :: {detail}"),
        Err(Error::Bootstrap(d)) => format!("bootstrap :: {d}"),
        Err(e) => format!("other :: {e}"),
    }
}

/// Element `i` of rank `r`'s shard in call `call`, as bytes of `dtype`.
pub fn fill(buf: &mut [u8], dtype: DType, rank: usize, call: u64) {
    let ts = dtype.size();
    for (i, e) in buf.chunks_exact_mut(ts).enumerate() {
        let v = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (i as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
            ^ call.wrapping_mul(0x1656_67B1_9E37_79F9);
        e.copy_from_slice(&(v ^ (v >> 31)).to_le_bytes()[..ts]);
    }
}

pub fn expected(nranks: usize, count: usize, dtype: DType, call: u64) -> Vec<u8> {
    let block = count * dtype.size();
    let mut v = vec![0u8; block * nranks];
    for r in 0..nranks {
        fill(&mut v[r * block..(r + 1) * block], dtype, r, call);
    }
    v
}

/// First differing byte, for a readable failure.
pub fn check_bytes(got: &[u8], want: &[u8], ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{ctx}: byte {i} is {:#04x}, expected {:#04x}",
            got[i], want[i]
        );
    }
}

/// The configurations a matrix rank runs: every algorithm, chunk sizes that cut blocks into
/// many chunks (pipelining, odd last chunks), and the smallest output that copies with
/// non-temporal stores (0: every call streams, at every length and alignment; else the
/// default: only the 1M+3 counts do).
///
/// `CIERA_TEST_REFS=mixed`: even ranks offer every big raw segment by reference, odd ranks
/// never do (each link then carries references one way and ring bytes the other).
pub fn matrix_configs() -> Vec<Config> {
    let mut base = Config::from_env().unwrap();
    if std::env::var("CIERA_TEST_REFS").as_deref() == Ok("mixed") {
        let rank: usize = std::env::var("CIERA_RANK").unwrap().parse().unwrap();
        base.single_copy = if rank.is_multiple_of(2) {
            SingleCopy::On
        } else {
            SingleCopy::Off
        };
    }
    let cfg = |algo, chunk_bytes, stream_min_bytes| Config {
        algo,
        chunk_bytes,
        stream_min_bytes,
        ..base.clone()
    };
    vec![
        cfg(AlgoChoice::Auto, 1 << 20, None),
        cfg(AlgoChoice::Fixed(Algo::Ring), 96 * 1024 + 4, Some(0)),
        cfg(AlgoChoice::Fixed(Algo::Bruck), 256 * 1024, None),
        cfg(AlgoChoice::Fixed(Algo::RecursiveDoubling), 1000, Some(0)),
        cfg(AlgoChoice::Fixed(Algo::Direct), 200 * 1024 + 2, None),
    ]
}

/// A buffer of `len` bytes set to `byte`: a fresh [`SharedBuffer`] with
/// `CIERA_TEST_SHARED=1` (each one a new id, so receivers map new buffers all the time, and
/// descriptor numbers get reused), else on the heap.
pub fn test_buffer(len: usize, byte: u8) -> Box<dyn DerefMut<Target = [u8]>> {
    let mut b: Box<dyn DerefMut<Target = [u8]>> =
        if std::env::var("CIERA_TEST_SHARED").as_deref() == Ok("1") {
            Box::new(Communicator::alloc_shared(len).expect("shared buffer"))
        } else {
            Box::new(vec![0u8; len])
        };
    b.fill(byte);
    b
}

/// Role "matrix": every config x count x {out of place, in place}; exact bytes on every rank.
pub fn role_matrix(comm_for: &mut dyn FnMut(Config) -> Result<Communicator>) {
    let mut call = 0u64;
    let mut single_copy = 0u64;
    let mut shared_read = 0u64;
    for config in matrix_configs() {
        let (algo, chunk) = (config.algo, config.chunk_bytes);
        let config = Config {
            timeout: Duration::from_secs(120),
            ..config
        };
        let mut comm = comm_for(config).expect("communicator");
        let (rank, n) = (comm.rank(), comm.size());
        for &count in &COUNTS {
            // Odd counts in bytes too: 1-byte elements for the small odd counts.
            let dtype = if count == 7 {
                DType::U8
            } else if count == 1000 {
                DType::BF16
            } else {
                DType::F32
            };
            let block = count * dtype.size();
            for in_place in [false, true] {
                call += 1;
                let ctx = format!("rank {rank}/{n} {algo} chunk {chunk} count {count} {dtype} in_place={in_place}");
                let want = expected(n, count, dtype, call);
                let mut recv = test_buffer(block * n, 0xEE);
                if in_place {
                    fill(
                        &mut recv[rank * block..(rank + 1) * block],
                        dtype,
                        rank,
                        call,
                    );
                    comm.all_gather_in_place(&mut recv, count, dtype)
                        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
                } else {
                    let mut send = test_buffer(block, 0);
                    fill(&mut send, dtype, rank, call);
                    comm.all_gather(&send, &mut recv, count, dtype)
                        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
                }
                check_bytes(&recv, &want, &ctx);
            }
        }
        comm.barrier().expect("barrier");
        single_copy += comm.single_copy_bytes();
        shared_read += comm.shared_read_bytes();
    }
    let rank = std::env::var("CIERA_RANK").unwrap_or_default();
    report_raw(&format!("SINGLE_COPY_BYTES {rank} {single_copy}"));
    report_raw(&format!("SHARED_READ_BYTES {rank} {shared_read}"));
    report("ok");
}

/// A toy frame codec with frames of data-dependent length: a 4-byte length, the bytes XORed
/// with the source rank, and (chunk + src) % 11 bytes of padding. Decode checks everything.
pub struct ToyEncoder {
    pub rank: usize,
    pub encoded: usize,
}

impl FrameEncoder for ToyEncoder {
    fn encode(&mut self, c: &ChunkRef, raw: &[u8], out: &mut Vec<u8>) -> Result<()> {
        assert_eq!(c.src, self.rank);
        assert_eq!(raw.len(), c.elems.len() * c.dtype.size());
        out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
        out.extend(raw.iter().map(|b| b ^ (c.src as u8 + 1)));
        out.extend(std::iter::repeat_n(0xAB, (c.chunk + c.src) % 11));
        self.encoded += 1;
        Ok(())
    }
}

/// The decoding side of the toy codec.
pub struct ToyCodec {
    pub decoded: usize,
}

impl FrameCodec for ToyCodec {
    fn format(&self) -> u8 {
        0x7A
    }
    fn max_frame_len(&self, raw_len: usize) -> usize {
        raw_len + 4 + 10
    }
    fn decode(&mut self, c: &ChunkRef, frame: &[u8], out: &mut [u8]) -> Result<()> {
        let bad = |d: String| Err(Error::InvalidArgument(format!("toy frame: {d}")));
        if frame.len() < 4 {
            return bad(format!("{} bytes", frame.len()));
        }
        let n = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
        let pad = (c.chunk + c.src) % 11;
        if n != out.len() || frame.len() != 4 + n + pad {
            return bad(format!(
                "frame of {} bytes says {n}, chunk has {}",
                frame.len(),
                out.len()
            ));
        }
        for (o, f) in out.iter_mut().zip(&frame[4..4 + n]) {
            *o = f ^ (c.src as u8 + 1);
        }
        self.decoded += 1;
        Ok(())
    }
}

/// Role "framed": allgather through the toy codec (the compression hook), exact bytes.
pub fn role_framed(comm_for: &mut dyn FnMut(Config) -> Result<Communicator>) {
    let mut call = 0u64;
    for config in matrix_configs() {
        let (algo, chunk) = (config.algo, config.chunk_bytes);
        let mut comm = comm_for(config).expect("communicator");
        let (rank, n) = (comm.rank(), comm.size());
        let mut encoder = ToyEncoder { rank, encoded: 0 };
        let mut codec = ToyCodec { decoded: 0 };
        for &count in &[0usize, 7, 1000, 300_001] {
            for in_place in [false, true] {
                call += 1;
                let dtype = DType::F32;
                let block = count * 4;
                let want = expected(n, count, dtype, call);
                let mut recv = vec![0xEEu8; block * n];
                let mut send = vec![0u8; block];
                fill(&mut send, dtype, rank, call);
                let ctx = format!(
                    "framed rank {rank}/{n} {algo} chunk {chunk} count {count} in_place={in_place}"
                );
                let r = if in_place {
                    recv[rank * block..(rank + 1) * block].copy_from_slice(&send);
                    comm.all_gather_framed(None, &mut recv, count, dtype, &mut encoder, &mut codec)
                } else {
                    comm.all_gather_framed(
                        Some(&send),
                        &mut recv,
                        count,
                        dtype,
                        &mut encoder,
                        &mut codec,
                    )
                };
                r.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                check_bytes(&recv, &want, &ctx);
            }
        }
        if n > 1 {
            assert!(
                encoder.encoded > 0 && codec.decoded > 0,
                "the codec was not used"
            );
        }
    }
    report("ok");
}

/// Role "mismatch": rank `CIERA_TEST_ODD_RANK` calls with another count (or dtype); every
/// rank must fail with CallMismatch.
pub fn role_mismatch(comm: &mut Communicator) {
    let odd: usize = std::env::var("CIERA_TEST_ODD_RANK")
        .map(|v| v.parse().unwrap())
        .unwrap_or(usize::MAX);
    let what = std::env::var("CIERA_TEST_MISMATCH").unwrap_or_else(|_| "count".into());
    let rank = comm.rank();
    // One good call first: the stream must stay in step before the bad one.
    let n = comm.size();
    let mut recv = vec![0u8; 4 * 10 * n];
    comm.all_gather(&[1u8; 40], &mut recv, 10, DType::F32)
        .expect("first call");
    let (count, dtype) = match (rank == odd, what.as_str()) {
        (false, _) => (1000, DType::F32),
        (true, "count") => (1001, DType::F32),
        (true, _) => (2000, DType::BF16), // same bytes, other type
    };
    let mut send = vec![0u8; count * dtype.size()];
    fill(&mut send, dtype, rank, 1);
    let mut recv = vec![0u8; send.len() * n];
    let r = comm.all_gather(&send, &mut recv, count, dtype);
    report(&describe(&r));
    // The communicator is unusable afterwards.
    let again = comm.barrier();
    assert!(
        matches!(again, Err(Error::Aborted { .. })),
        "after a failure: {again:?}"
    );
}

/// Role "loop": large allgathers until something fails; prints READY after the first one.
pub fn role_loop(comm: &mut Communicator) {
    loop_until_failure(comm, 2_000_000);
}

/// Role "small_loop": as "loop" with 8-byte shards (the links stay nearly empty, so a notice
/// always fits).
pub fn role_small_loop(comm: &mut Communicator) {
    loop_until_failure(comm, 2);
}

fn loop_until_failure(comm: &mut Communicator, count: usize) {
    let n = comm.size();
    let send = test_buffer(count * 4, comm.rank() as u8);
    let mut recv = test_buffer(count * 4 * n, 0);
    let mut first = true;
    let r = loop {
        if let Err(e) = comm.all_gather(&send, &mut recv, count, DType::F32) {
            break Err(e);
        }
        if first {
            report_raw("READY");
            first = false;
        }
    };
    report(&describe(&r));
    std::process::exit(1);
}

/// Role "one_call": a single verified allgather, then a barrier.
pub fn role_one_call(comm: &mut Communicator) {
    let (rank, n) = (comm.rank(), comm.size());
    let count = 12345;
    let mut send = vec![0u8; count * 2];
    fill(&mut send, DType::BF16, rank, 5);
    let mut recv = vec![0u8; send.len() * n];
    let r = comm
        .all_gather(&send, &mut recv, count, DType::BF16)
        .and_then(|()| comm.barrier());
    if r.is_ok() {
        check_bytes(&recv, &expected(n, count, DType::BF16, 5), "one_call");
    }
    report(&describe(&r));
}
