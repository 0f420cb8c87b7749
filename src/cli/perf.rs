//! `ciera perf`: Allgather timings in nccl-tests' all_gather_perf conventions.
//!
//! size = total gathered bytes (all ranks), count = elements each rank sends, time = the
//! slowest rank's mean time per call, algbw = size / time, busbw = algbw * (n-1)/n.
//! Launched without a launcher and with `-n N`, it re-executes itself under `ciera launch`;
//! under mpirun / srun / torchrun / `ciera launch` it runs as one rank. Rank 0 prints.

use std::ops::DerefMut;
use std::time::Instant;

use super::args::Args;
use super::ranks;
use crate::comm::{Communicator, Config};
use crate::error::{Error, Result};
use crate::DType;

const USAGE: &str = "usage: ciera perf [options]

Allgather timings, nccl-tests all_gather_perf style.

  -n, -N, --nranks N   ranks to launch on this host (default 1). Unlike nccl-tests, -n is the
                       rank count; iterations are -i. Ignored (must match) when already
                       started by mpirun, srun, torchrun or `ciera launch`.
  -b, --minbytes SIZE  smallest total size (default 32M); K, M, G suffixes
  -e, --maxbytes SIZE  largest total size (default 32M)
  -f, --stepfactor F   multiply the size by F each step (default 2)
  -i, --iters N        timed iterations per size (default 20)
  -w, --warmup_iters N untimed iterations first (default 5)
  -c, --check 0|1      check every element after timing (default 1)
  -d, --datatype T     int8 uint8 int32 uint32 int64 uint64 half float double bfloat16
                       (default float)
      --in-place       gather in place (this rank's shard already in the output buffer)
  -R, --registered 0|1 allocate the send and receive buffers as shared buffers
                       (ciera::SharedBuffer, like nccl-tests -R with ncclMemAlloc): same-host
                       peers then copy straight out of them, no kernel copy (default 0)
      --json           one JSON object per size: size count type time_us algbw busbw wrong
      --trace DIR      replay a real training trace through the compressed Allgather instead
                       (every bit checked; `ciera perf --trace DIR --help` for its options)
  -h, --help

Environment: CIERA_TRANSPORT=auto|shm|tcp, CIERA_ALGO=auto|ring|rd|bruck,
CIERA_CHUNK_BYTES, CIERA_TIMEOUT (seconds).
Columns: size (B, all ranks), count (elements per rank), type, time (us, slowest rank's mean),
algbw = size/time (GB/s), busbw = algbw*(n-1)/n, #wrong (elements differing from the expected
pattern, summed over ranks; N/A without -c 1).
";

#[derive(Clone, Debug)]
struct Opts {
    nranks: Option<usize>,
    min_bytes: usize,
    max_bytes: usize,
    factor: f64,
    iters: usize,
    warmup: usize,
    check: bool,
    dtype: DType,
    in_place: bool,
    registered: bool,
    json: bool,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            nranks: None,
            min_bytes: 32 << 20,
            max_bytes: 32 << 20,
            factor: 2.0,
            iters: 20,
            warmup: 5,
            check: true,
            dtype: DType::F32,
            in_place: false,
            registered: false,
            json: false,
        }
    }
}

pub fn main(args: &[String]) -> i32 {
    if args.iter().any(|a| a == "--trace") {
        return super::perf_trace::main(args);
    }
    let (opts, rank_args) = match parse(args) {
        Ok(Some(x)) => x,
        Ok(None) => {
            print!("{USAGE}");
            return 0;
        }
        Err(e) => {
            eprintln!("ciera perf: {e}\n\n{USAGE}");
            return 2;
        }
    };
    ranks::run("perf", opts.nranks, &rank_args, || {
        run_rank(&opts).map(|wrong| wrong == 0)
    })
}

/// Options, and the arguments to pass on to launched ranks (everything but -n).
fn parse(args: &[String]) -> std::result::Result<Option<(Opts, Vec<String>)>, String> {
    let mut o = Opts::default();
    let mut pass = Vec::new();
    let mut a = Args::new(args);
    while let Some(flag) = a.next_flag("nNbefiwcdR") {
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "-n" | "-N" | "--nranks" => {
                let n: usize = a.value_parsed(&flag)?;
                if n == 0 {
                    return Err("-n must be at least 1".into());
                }
                o.nranks = Some(n);
                continue;
            }
            "-b" | "--minbytes" => o.min_bytes = a.value_size(&flag)?,
            "-e" | "--maxbytes" => o.max_bytes = a.value_size(&flag)?,
            "-f" | "--stepfactor" => {
                o.factor = a.value_parsed(&flag)?;
                if !(o.factor.is_finite() && o.factor > 1.0) {
                    return Err(format!("{flag}: the step factor must be > 1"));
                }
            }
            "-i" | "--iters" => o.iters = a.value_parsed::<usize>(&flag)?.max(1),
            "-w" | "--warmup_iters" | "--warmup" => o.warmup = a.value_parsed(&flag)?,
            "-c" | "--check" => o.check = a.value_parsed::<u32>(&flag)? != 0,
            "-d" | "--datatype" => {
                let v = a.value(&flag)?;
                o.dtype = DType::parse(&v).ok_or_else(|| format!("{flag}: unknown type {v:?}"))?;
            }
            "--in-place" => o.in_place = true,
            "-R" | "--registered" => o.registered = a.value_parsed::<u32>(&flag)? != 0,
            "--json" => o.json = true,
            f => return Err(format!("unknown option {f}")),
        }
        // Pass the option (normalised to "flag value") on to launched ranks.
        pass.push(flag.clone());
        match flag.as_str() {
            "--in-place" | "--json" => {}
            "-b" | "--minbytes" => pass.push(o.min_bytes.to_string()),
            "-e" | "--maxbytes" => pass.push(o.max_bytes.to_string()),
            "-f" | "--stepfactor" => pass.push(o.factor.to_string()),
            "-i" | "--iters" => pass.push(o.iters.to_string()),
            "-w" | "--warmup_iters" | "--warmup" => pass.push(o.warmup.to_string()),
            "-c" | "--check" => pass.push(u32::from(o.check).to_string()),
            "-R" | "--registered" => pass.push(u32::from(o.registered).to_string()),
            "-d" | "--datatype" => pass.push(o.dtype.name().to_string()),
            _ => {}
        }
    }
    if o.min_bytes > o.max_bytes {
        return Err(format!(
            "-b {} is larger than -e {}",
            o.min_bytes, o.max_bytes
        ));
    }
    Ok(Some((o, pass)))
}

/// The element pattern of check mode: depends on the source rank, the element index and the
/// iteration, so a stale or misplaced element is caught. (bench/mpi_allgather.c uses the same.)
pub fn pattern(rank: u64, index: u64, iter: u64) -> u64 {
    let mut x = rank.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ index.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ iter.wrapping_mul(0x1656_67B1_9E37_79F9);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    x
}

fn fill(buf: &mut [u8], ts: usize, rank: usize, iter: u64) {
    for (i, e) in buf.chunks_exact_mut(ts).enumerate() {
        e.copy_from_slice(&pattern(rank as u64, i as u64, iter).to_le_bytes()[..ts]);
    }
}

fn count_wrong(recv: &[u8], count: usize, ts: usize, nranks: usize, iter: u64) -> u64 {
    let mut wrong = 0;
    for r in 0..nranks {
        let block = &recv[r * count * ts..(r + 1) * count * ts];
        for (i, e) in block.chunks_exact(ts).enumerate() {
            if e != &pattern(r as u64, i as u64, iter).to_le_bytes()[..ts] {
                wrong += 1;
            }
        }
    }
    wrong
}

/// Run the sweep as one rank; returns the total of wrong elements.
fn run_rank(o: &Opts) -> Result<u64> {
    let config = Config::from_env()?;
    let mut comm = Communicator::from_env(config)?;
    let (rank, n) = (comm.rank(), comm.size());
    let ts = o.dtype.size();
    let max_count = o.max_bytes / ts / n;
    let mut send = alloc(max_count * ts, o.registered, "send")?;
    let mut recv = alloc(max_count * ts * n, o.registered, "receive")?;
    fill(&mut send, ts, rank, 1_000_000);
    let print = rank == 0;
    if print && !o.json {
        let c = comm.config();
        println!(
            "# ciera perf: all_gather, {n} ranks, transport {:?}, single copy {}, algo {}, chunk {} B, {}, {} buffers",
            c.transport,
            format!("{:?}", c.single_copy).to_lowercase(),
            c.algo,
            c.chunk_bytes,
            if o.in_place {
                "in place"
            } else {
                "out of place"
            },
            if o.registered { "shared" } else { "heap" }
        );
        println!(
            "#   iters {}, warmup {}, check {}, type {}",
            o.iters,
            o.warmup,
            u8::from(o.check),
            o.dtype
        );
        println!("#");
        println!(
            "# {:>10} {:>12} {:>8} {:>10} {:>12} {:>12} {:>8}  algo",
            "size", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
        );
    }
    let mut busbw_sum = 0.0;
    let mut sizes = 0usize;
    let mut wrong_total = 0u64;
    let mut bytes = o.min_bytes;
    loop {
        let count = bytes / ts / n;
        let size = count * ts * n;
        let sbytes = count * ts;
        let call = |comm: &mut Communicator, send: &[u8], recv: &mut [u8]| -> Result<()> {
            if o.in_place {
                comm.all_gather_in_place(recv, count, o.dtype)
            } else {
                comm.all_gather(send, recv, count, o.dtype)
            }
        };
        for _ in 0..o.warmup {
            call(&mut comm, &send[..sbytes], &mut recv[..size])?;
        }
        comm.barrier()?;
        let t0 = Instant::now();
        for _ in 0..o.iters {
            call(&mut comm, &send[..sbytes], &mut recv[..size])?;
        }
        let mine = t0.elapsed().as_secs_f64() / o.iters as f64;
        let slowest = gather_f64(&mut comm, mine)?.into_iter().fold(0.0, f64::max);

        let wrong = if o.check {
            let mut w = 0u64;
            for iter in 0..2u64 {
                recv[..size].fill(0xA5);
                if o.in_place {
                    fill(
                        &mut recv[rank * sbytes..(rank + 1) * sbytes],
                        ts,
                        rank,
                        iter,
                    );
                } else {
                    fill(&mut send[..sbytes], ts, rank, iter);
                }
                call(&mut comm, &send[..sbytes], &mut recv[..size])?;
                w += count_wrong(&recv[..size], count, ts, n, iter);
            }
            let all = gather_u64(&mut comm, w)?;
            Some(all.iter().sum::<u64>())
        } else {
            None
        };
        wrong_total += wrong.unwrap_or(0);
        let algbw = if slowest > 0.0 {
            size as f64 / slowest / 1e9
        } else {
            0.0
        };
        let busbw = algbw * (n - 1) as f64 / n as f64;
        busbw_sum += busbw;
        sizes += 1;
        if print {
            if o.json {
                let row = serde_json::json!({
                    "size": size, "count": count, "type": o.dtype.name(),
                    "time_us": slowest * 1e6, "algbw": algbw, "busbw": busbw, "wrong": wrong,
                    "nranks": n, "algo": comm.algo_for(count, o.dtype).name(),
                });
                println!("{row}");
            } else {
                let w = wrong.map(|w| w.to_string()).unwrap_or_else(|| "N/A".into());
                println!(
                    "  {size:>10} {count:>12} {:>8} {:>10.2} {algbw:>12.3} {busbw:>12.3} {w:>8}  {}",
                    o.dtype.name(),
                    slowest * 1e6,
                    comm.algo_for(count, o.dtype)
                );
            }
        }
        match next_size(bytes, o.factor, o.max_bytes) {
            Some(next) => bytes = next,
            None => break,
        }
    }
    if print && !o.json {
        println!(
            "# Out of bounds values : {wrong_total} {}",
            if wrong_total == 0 { "OK" } else { "FAILED" }
        );
        println!(
            "# Avg bus bandwidth    : {:.4}",
            if sizes > 0 {
                busbw_sum / sizes as f64
            } else {
                0.0
            }
        );
        println!(
            "# Sent by reference    : {} bytes (this rank; single copy over shm)",
            comm.single_copy_bytes()
        );
        println!(
            "# Read from shared     : {} bytes (this rank; copied out of peers' shared buffers)",
            comm.shared_read_bytes()
        );
        println!("#");
    }
    if wrong_total > 0 && rank == 0 {
        return Err(Error::InvalidArgument(format!(
            "{wrong_total} wrong elements"
        )));
    }
    Ok(wrong_total)
}

/// A zeroed buffer of `len` bytes: on the heap, or a shared buffer (`-R 1`). A size this
/// machine cannot hold is an error naming it, not an abort.
fn alloc(len: usize, shared: bool, what: &str) -> Result<Box<dyn DerefMut<Target = [u8]>>> {
    Ok(if shared {
        Box::new(Communicator::alloc_shared(len)?)
    } else {
        let mut v: Vec<u8> = Vec::new();
        v.try_reserve_exact(len).map_err(|e| Error::Io {
            what: format!("allocating the {what} buffer of {len} bytes"),
            source: std::io::Error::new(std::io::ErrorKind::OutOfMemory, e.to_string()),
        })?;
        v.resize(len, 0);
        Box::new(v)
    })
}

/// Every rank's value, by rank (a tiny allgather).
fn gather_u64(comm: &mut Communicator, v: u64) -> Result<Vec<u64>> {
    let n = comm.size();
    let mut out = vec![0u8; 8 * n];
    comm.all_gather(&v.to_le_bytes(), &mut out, 1, DType::U64)?;
    Ok(out
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

fn gather_f64(comm: &mut Communicator, v: f64) -> Result<Vec<f64>> {
    Ok(gather_u64(comm, v.to_bits())?
        .into_iter()
        .map(f64::from_bits)
        .collect())
}

/// The size after `bytes` in a sweep growing by `factor` (at least one byte) up to `max`.
pub(super) fn next_size(bytes: usize, factor: f64, max: usize) -> Option<usize> {
    let next = (((bytes as f64) * factor) as usize).max(bytes + 1);
    (next <= max).then_some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn acceptance_command_line_parses() {
        let (o, pass) = parse(&s(&[
            "-n", "4", "-b", "1K", "-e", "64M", "-f", "4", "-c", "1",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(o.nranks, Some(4));
        assert_eq!(
            (o.min_bytes, o.max_bytes, o.factor, o.check),
            (1024, 64 << 20, 4.0, true)
        );
        assert!(!pass.contains(&"-n".to_string()));
        assert_eq!(
            pass,
            s(&["-b", "1024", "-e", "67108864", "-f", "4", "-c", "1"])
        );
        let (o, _) = parse(&s(&["-i", "3", "-w0", "-d", "bf16", "--json"]))
            .unwrap()
            .unwrap();
        assert_eq!(
            (o.iters, o.warmup, o.dtype, o.json),
            (3, 0, DType::BF16, true)
        );
        assert!(parse(&s(&["-b", "2M", "-e", "1M"])).is_err());
        assert!(parse(&s(&["--bogus"])).is_err());
    }

    #[test]
    fn pattern_depends_on_rank_index_and_iteration() {
        assert_eq!(pattern(0, 0, 0), 0);
        assert_ne!(pattern(1, 0, 0), pattern(0, 1, 0));
        assert_ne!(pattern(0, 0, 1), pattern(0, 0, 0));
    }
}
