//! Throughput of the two transports between two ranks (threads of this process, real shm
//! segments and real loopback TCP sockets):
//!
//! ```text
//! cargo run --release -p ciera-transport --example pingpong [-- <MiB per message> <round trips>]
//! ```
//!
//! "pingpong" sends a message and waits for the same-sized reply (bytes moved both ways / time);
//! "stream" sends messages back to back in one direction. TCP is the baseline the shm ratio is
//! measured against; a single-thread memcpy of the same size is the ceiling shm is compared to
//! (each side copies once).

use std::net::IpAddr;
use std::time::{Duration, Instant};

use ciera_transport::{Endpoint, Kind, Link, TransportChoice};

const SECRET: [u8; 32] = [0x42; 32];

fn send_all(ep: &mut Endpoint, peer: usize, data: &[u8]) {
    let mut done = 0;
    while done < data.len() {
        let n = ep.link(peer).try_send(&data[done..]).expect("send");
        if n == 0 {
            ep.wait(Duration::from_millis(100)).expect("wait");
        }
        done += n;
    }
}

fn recv_all(ep: &mut Endpoint, peer: usize, buf: &mut [u8]) {
    let mut done = 0;
    while done < buf.len() {
        let n = ep.link(peer).try_recv(&mut buf[done..]).expect("recv");
        if n == 0 {
            ep.wait(Duration::from_millis(100)).expect("wait");
        }
        done += n;
    }
}

/// Returns (pingpong GB/s, stream GB/s).
fn measure(choice: TransportChoice, bytes: usize, rounds: usize) -> (Kind, f64, f64) {
    let ip = IpAddr::from([127, 0, 0, 1]);
    let eps: Vec<Endpoint> = (0..2).map(|_| Endpoint::bind(ip).expect("bind")).collect();
    let infos: Vec<_> = eps.iter().map(|e| e.local_info()).collect();
    let threads: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(rank, mut ep)| {
            let infos = infos.clone();
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                ep.connect_all(rank, &infos, &SECRET, choice, deadline)
                    .expect("connect_all");
                let kind = Link::kind(ep.link(1 - rank));
                let peer = 1 - rank;
                let mut buf = vec![0u8; bytes];
                for (i, b) in buf.iter_mut().enumerate() {
                    *b = (i * 31 + rank) as u8;
                }
                let mut reply = vec![0u8; bytes];
                // Warm-up round trip (page faults, TCP window growth).
                let round = |ep: &mut Endpoint, buf: &mut Vec<u8>, reply: &mut Vec<u8>| {
                    if rank == 0 {
                        send_all(ep, peer, buf);
                        recv_all(ep, peer, reply);
                    } else {
                        recv_all(ep, peer, reply);
                        send_all(ep, peer, reply);
                    }
                };
                round(&mut ep, &mut buf, &mut reply);
                let start = Instant::now();
                for _ in 0..rounds {
                    round(&mut ep, &mut buf, &mut reply);
                }
                let pingpong = start.elapsed();
                if rank == 0 {
                    assert_eq!(reply, buf, "reply differs from the message");
                }
                let start = Instant::now();
                for _ in 0..rounds {
                    if rank == 0 {
                        send_all(&mut ep, peer, &buf);
                    } else {
                        recv_all(&mut ep, peer, &mut reply);
                    }
                }
                // Rank 1 has everything when its loop ends; rank 0 only knows it handed it off.
                let stream = start.elapsed();
                (kind, pingpong, stream)
            })
        })
        .collect();
    let results: Vec<_> = threads
        .into_iter()
        .map(|t| t.join().expect("rank thread"))
        .collect();
    let (kind, pingpong, _) = results[0];
    let (_, _, stream) = results[1];
    let moved = (bytes * rounds) as f64;
    (
        kind,
        2.0 * moved / pingpong.as_secs_f64() / 1e9,
        moved / stream.as_secs_f64() / 1e9,
    )
}

/// Single-thread memcpy of `bytes`, GB/s: the ceiling for a one-copy-per-side transport.
fn memcpy_gbps(bytes: usize, rounds: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    for i in 0..rounds {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst)[i % bytes] ^= 1;
    }
    (bytes * rounds) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mib: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let bytes = mib << 20;
    println!(
        "{mib} MiB messages, {rounds} round trips / messages per measurement, 2 ranks on one host"
    );
    println!(
        "{:<6} {:>16} {:>14}",
        "link", "pingpong GB/s", "stream GB/s"
    );
    let (tcp_kind, tcp_pp, tcp_st) = measure(TransportChoice::Tcp, bytes, rounds);
    println!(
        "{:<6} {:>16.2} {:>14.2}",
        tcp_kind.to_string(),
        tcp_pp,
        tcp_st
    );
    let (shm_kind, shm_pp, shm_st) = measure(TransportChoice::Shm, bytes, rounds);
    println!(
        "{:<6} {:>16.2} {:>14.2}",
        shm_kind.to_string(),
        shm_pp,
        shm_st
    );
    println!(
        "shm/tcp: pingpong {:.2}x, stream {:.2}x",
        shm_pp / tcp_pp,
        shm_st / tcp_st
    );
    let copy = memcpy_gbps(bytes, rounds);
    println!(
        "memcpy baseline {copy:.2} GB/s; shm stream at {:.0}% of it",
        100.0 * shm_st / copy
    );
}
