//! Helpers shared by the integration tests: patterned streams, an all-to-all exchange driven
//! through `try_send`/`try_recv`/`wait`, and launching ranks as threads.
#![allow(dead_code)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use ciera_transport::{Endpoint, PeerInfo, TransportChoice};

pub const SECRET: [u8; 32] = *b"ciera-transport-test-secret-0001";

pub fn localhost() -> IpAddr {
    IpAddr::from([127, 0, 0, 1])
}

pub fn deadline(secs: u64) -> Instant {
    Instant::now() + Duration::from_secs(secs)
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Bytes `offset..offset + out.len()` of the stream rank `from` sends to rank `to`.
pub fn pattern(from: usize, to: usize, offset: u64, out: &mut [u8]) {
    let seed = ((from as u64) << 40) ^ ((to as u64) << 20) ^ 0x5151;
    let mut i = 0;
    let mut pos = offset;
    while i < out.len() {
        let word = mix(seed ^ (pos / 8)).to_le_bytes();
        let start = (pos % 8) as usize;
        let take = (8 - start).min(out.len() - i);
        out[i..i + take].copy_from_slice(&word[start..start + take]);
        i += take;
        pos += take as u64;
    }
}

pub fn pattern_vec(from: usize, to: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    pattern(from, to, 0, &mut v);
    v
}

/// Checks received bytes against the pattern; the error names the first bad offset.
pub fn verify(
    from: usize,
    to: usize,
    offset: u64,
    got: &[u8],
    scratch: &mut Vec<u8>,
) -> Result<(), String> {
    scratch.resize(got.len(), 0);
    pattern(from, to, offset, scratch);
    if scratch[..] != got[..] {
        let i = got
            .iter()
            .zip(scratch.iter())
            .position(|(a, b)| a != b)
            .unwrap();
        return Err(format!(
            "stream {from}->{to}: byte {} is {:#04x}, expected {:#04x}",
            offset + i as u64,
            got[i],
            scratch[i]
        ));
    }
    Ok(())
}

/// Every rank sends `bytes` patterned bytes to every other rank and checks every byte it
/// receives, all links at once, sleeping in `wait` when nothing moves.
pub fn exchange(
    ep: &mut Endpoint,
    me: usize,
    world: usize,
    bytes: usize,
    limit: Duration,
) -> Result<(), String> {
    let start = Instant::now();
    let peers: Vec<usize> = (0..world).filter(|&p| p != me).collect();
    let outgoing: Vec<Vec<u8>> = peers.iter().map(|&p| pattern_vec(me, p, bytes)).collect();
    let mut sent = vec![0usize; peers.len()];
    let mut received = vec![0usize; peers.len()];
    let mut buf = vec![0u8; 1 << 20];
    let mut scratch = Vec::new();
    // Odd, changing piece sizes so reads and writes straddle the ring's end at every offset.
    const PIECES: [usize; 5] = [(1 << 20) - 1, 333_333, 1 << 20, 4097, 777_777];
    let mut turn = 0usize;
    loop {
        turn += 1;
        let piece = PIECES[turn % PIECES.len()];
        let mut progress = false;
        let mut done = true;
        for (i, &p) in peers.iter().enumerate() {
            let link = ep.link(p);
            if sent[i] < bytes {
                let end = (sent[i] + piece).min(bytes);
                let n = link
                    .try_send(&outgoing[i][sent[i]..end])
                    .map_err(|e| format!("rank {me} send to {p}: {e}"))?;
                sent[i] += n;
                progress |= n > 0;
            }
            if received[i] < bytes {
                let want = piece.min(buf.len()).min(bytes - received[i]);
                let n = link
                    .try_recv(&mut buf[..want])
                    .map_err(|e| format!("rank {me} recv from {p}: {e}"))?;
                verify(p, me, received[i] as u64, &buf[..n], &mut scratch)?;
                received[i] += n;
                progress |= n > 0;
            }
            done &= sent[i] == bytes && received[i] == bytes;
        }
        if done {
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(format!(
                "rank {me}: stuck after {limit:?}: sent {sent:?}, received {received:?} of {bytes}"
            ));
        }
        if !progress {
            ep.wait(Duration::from_millis(100))
                .map_err(|e| format!("rank {me} wait: {e}"))?;
        }
    }
}

/// Binds `world` endpoints on localhost and returns them with the peer table.
pub fn bind_all(world: usize) -> (Vec<Endpoint>, Vec<PeerInfo>) {
    let eps: Vec<Endpoint> = (0..world)
        .map(|_| Endpoint::bind(localhost()).unwrap())
        .collect();
    let infos = eps.iter().map(|e| e.local_info()).collect();
    (eps, infos)
}

/// Runs `world` ranks as threads: connect_all, then `body`. Returns each rank's result.
pub fn run_threads<F>(
    eps: Vec<Endpoint>,
    infos: Vec<PeerInfo>,
    choice: TransportChoice,
    body: F,
) -> Vec<Result<(), String>>
where
    F: Fn(usize, &mut Endpoint) -> Result<(), String> + Send + Sync + Clone + 'static,
{
    let handles: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(rank, mut ep)| {
            let infos = infos.clone();
            let body = body.clone();
            std::thread::spawn(move || {
                ep.connect_all(rank, &infos, &SECRET, choice, deadline(30))
                    .map_err(|e| format!("rank {rank} connect_all: {e}"))?;
                body(rank, &mut ep)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|_| Err("rank panicked".into())))
        .collect()
}

/// /dev/shm entries created by process `pid` (CIERA names start with `ciera-<pid>-`).
pub fn shm_entries_of(pid: u32) -> Vec<String> {
    let prefix = format!("ciera-{pid}-");
    std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}
