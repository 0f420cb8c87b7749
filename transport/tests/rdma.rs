//! RDMA links for real (feature `rdma`): ranks as threads of this process, each with its own
//! endpoint, connected with `TransportChoice::Rdma` over whatever RDMA device the host has
//! (`CIERA_IB_HCA` picks one). On a host without one every test says so and returns, unless
//! `CIERA_REQUIRE_RDMA=1` (set by bench/rxe_guest.sh inside its soft-RoCE guest) makes that a
//! failure. Checked: every byte of streams several rings long, in both directions between
//! every pair, at 2 and 3 ranks, pieces of odd sizes; a peer that goes away mid-transfer is
//! reported as `PeerClosed` naming its rank; and after teardown no queue pair or memory
//! registration is left (`rdma_live_resources`, checked against the kernel's count from
//! `rdma resource show` where iproute2's `rdma` is installed); and `CIERA_TRANSPORT=auto`
//! picks shm within a host and RDMA between hosts. Send buffers that are `SharedBuffer`s are
//! written from where they lie (registered once per link, counted with the other
//! registrations, `rdma_zero_copy_bytes` says how many bytes went so); and registering a
//! dma-buf device buffer on a device without dma-buf support (soft-RoCE) is a clear error;
//! registrations of freed SharedBuffers are dropped, and plain memory still goes through staging.
#![cfg(feature = "rdma")]

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Barrier, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ciera_transport::{
    rdma_live_resources, rdma_unavailable_reason, rdma_zero_copy_bytes, DmaBuf, Endpoint, Kind,
    PeerInfo, SharedBuffer, TransportChoice,
};

/// The leak counters are per process: one test at a time.
fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether RDMA is usable here; prints why not (or fails under CIERA_REQUIRE_RDMA=1).
fn usable(test: &str) -> bool {
    match rdma_unavailable_reason() {
        None => true,
        Some(why) if std::env::var("CIERA_REQUIRE_RDMA").as_deref() == Ok("1") => {
            panic!("{test}: CIERA_REQUIRE_RDMA=1 but {why}")
        }
        Some(why) => {
            // Through the stderr handle: libtest does not capture it, so the reason shows.
            let line = format!("SKIPPED {test}: skipped: {why}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            false
        }
    }
}

/// Byte `i` of the stream from `src` to `dst`.
fn pattern(src: usize, dst: usize, i: usize) -> u8 {
    let x = (i as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((src * 31 + dst) as u64 * 0x1234_5677);
    (x >> 29) as u8 ^ (i >> 13) as u8
}

/// Endpoints for `n` ranks, bound on loopback, and the peer table.
fn endpoints(n: usize) -> (Vec<Endpoint>, Vec<PeerInfo>) {
    let eps: Vec<Endpoint> = (0..n)
        .map(|_| Endpoint::bind(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap())
        .collect();
    let infos = eps.iter().map(Endpoint::local_info).collect();
    (eps, infos)
}

/// Every rank sends `len` bytes to every other in pieces of odd sizes and checks every byte
/// it receives.
/// Receive what rank `p` has sent so far (`got` bytes already), checking every byte against
/// `pattern`; whether anything came.
fn recv_checked(ep: &mut Endpoint, me: usize, p: usize, got: &mut usize, inb: &mut [u8]) -> bool {
    let k = ep.link(p).try_recv(inb).unwrap();
    for (j, &b) in inb[..k].iter().enumerate() {
        assert_eq!(
            b,
            pattern(p, me, *got + j),
            "rank {me}: byte {} from rank {p}",
            *got + j
        );
    }
    *got += k;
    k > 0
}

fn exchange(ep: &mut Endpoint, me: usize, n: usize, len: usize) {
    let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
    let mut sent = vec![0usize; n];
    let mut got = vec![0usize; n];
    let mut out = vec![0u8; 300_000];
    let mut inb = vec![0u8; 77_777];
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut round = 0usize;
    while peers.iter().any(|&p| sent[p] < len || got[p] < len) {
        assert!(
            Instant::now() < deadline,
            "rank {me}: exchange stuck: sent {sent:?} got {got:?}"
        );
        let mut progress = false;
        for &p in &peers {
            assert_eq!(ep.link(p).kind(), Kind::Rdma);
            if sent[p] < len {
                round += 1;
                let piece = [1, 7, 4096, 65_537, 300_000][round % 5].min(len - sent[p]);
                for (k, b) in out[..piece].iter_mut().enumerate() {
                    *b = pattern(me, p, sent[p] + k);
                }
                let k = ep.link(p).try_send(&out[..piece]).unwrap();
                sent[p] += k;
                progress |= k > 0;
            }
            if got[p] < len {
                progress |= recv_checked(ep, me, p, &mut got[p], &mut inb);
            }
        }
        if !progress {
            ep.wait(Duration::from_millis(20)).unwrap();
        }
    }
}

/// Queue pairs and memory registrations on all RDMA devices as the kernel counts them
/// (`rdma resource show`, iproute2: "0: rxe0: pd 1 cq 2 qp 3 cm_id 0 mr 4 ctx 1 srq 0"),
/// with the tool's output; `None` without the tool. System-wide, so compared as differences
/// from a baseline taken before the test (the kernel keeps QPs of its own).
fn kernel_counts() -> Option<((usize, usize), String)> {
    let o = std::process::Command::new("rdma")
        .args(["resource", "show"])
        .output()
        .ok()?;
    if !o.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let sum = |what: &str| -> usize {
        text.lines()
            .map(|l| {
                let words: Vec<&str> = l.split_whitespace().collect();
                words
                    .windows(2)
                    .filter(|w| w[0] == what)
                    .filter_map(|w| w[1].parse::<usize>().ok())
                    .sum::<usize>()
            })
            .sum()
    };
    Some(((sum("qp"), sum("mr")), text))
}

/// Our counters, and the kernel's above `base`, against the expected QPs and MRs: what is
/// wrong, if anything. Never panics, so that it can run between two barriers.
fn kernel_disagrees(
    base: Option<(usize, usize)>,
    qps: usize,
    mrs: usize,
    when: &str,
) -> Option<String> {
    let ours = rdma_live_resources();
    if ours != (qps, mrs) {
        return Some(format!(
            "{when}: our counters say {ours:?}, expected {:?}",
            (qps, mrs)
        ));
    }
    if let (Some((bq, bm)), Some(((kq, km), text))) = (base, kernel_counts()) {
        let (dq, dm) = (kq.wrapping_sub(bq), km.wrapping_sub(bm));
        if (dq, dm) != (qps, mrs) {
            return Some(format!(
                "{when}: the kernel counts {kq} QPs and {km} MRs, {bq} and {bm} before the test, \
                 expected {qps} and {mrs} more:\n{text}"
            ));
        }
        let line = format!(
            "rdma: {when}: {qps} queue pairs and {mrs} memory registrations (our counters and the kernel's agree)\n"
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
    None
}

fn check_kernel_agrees(base: Option<(usize, usize)>, qps: usize, mrs: usize, when: &str) {
    if let Some(why) = kernel_disagrees(base, qps, mrs, when) {
        panic!("{why}");
    }
}

fn run_ranks(n: usize, len: usize, base: Option<(usize, usize)>) {
    let (eps, infos) = endpoints(n);
    let secret = [9u8; 32];
    let barrier = Barrier::new(n);
    let mid = Mutex::new(None);
    std::thread::scope(|s| {
        for (me, mut ep) in eps.into_iter().enumerate() {
            let (infos, barrier, mid) = (&infos, &barrier, &mid);
            s.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                ep.connect_all(me, infos, &secret, TransportChoice::Rdma, deadline)
                    .unwrap_or_else(|e| panic!("rank {me}: connect_all: {e}"));
                exchange(&mut ep, me, n, len);
                // Nobody drops its links before everyone has all its bytes.
                barrier.wait();
                if me == 0 {
                    // One QP and two MRs (ring, staging) per link, n - 1 links per rank.
                    let links = n * (n - 1);
                    *mid.lock().unwrap() =
                        kernel_disagrees(base, links, 2 * links, &format!("{n} ranks connected"));
                }
                barrier.wait();
                drop(ep);
            });
        }
    });
    if let Some(why) = mid.into_inner().unwrap() {
        panic!("{why}");
    }
}

#[test]
fn rdma_links_deliver_every_byte_at_2_and_3_ranks_and_leak_nothing() {
    if !usable("rdma_links_deliver_every_byte_at_2_and_3_ranks_and_leak_nothing") {
        return;
    }
    let _x = exclusive();
    let base = kernel_counts().map(|(counts, _)| counts);
    for n in [2, 3] {
        // Three rings' worth per direction: the ring wraps and credits cycle.
        run_ranks(n, 3 << 20, base);
        check_kernel_agrees(base, 0, 0, &format!("{n} ranks torn down"));
        let line = format!("rdma: {n} ranks exact, 0 queue pairs and 0 registrations left\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
}

#[test]
fn a_peer_that_goes_away_mid_transfer_is_reported_by_rank() {
    if !usable("a_peer_that_goes_away_mid_transfer_is_reported_by_rank") {
        return;
    }
    let _x = exclusive();
    let base = kernel_counts().map(|(counts, _)| counts);
    let (eps, infos) = endpoints(2);
    let secret = [3u8; 32];
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::scope(|s| {
        for (me, mut ep) in eps.into_iter().enumerate() {
            let (infos, tx) = (&infos, tx.clone());
            s.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                ep.connect_all(me, infos, &secret, TransportChoice::Rdma, deadline)
                    .unwrap();
                if me == 1 {
                    // Take a little, then vanish with the sender mid-stream.
                    let mut buf = vec![0u8; 4096];
                    let mut got = 0;
                    while got < 100_000 {
                        got += ep.link(0).try_recv(&mut buf).unwrap();
                        ep.wait(Duration::from_millis(5)).unwrap();
                    }
                    drop(ep);
                    return;
                }
                let data = vec![0x5au8; 1 << 20];
                let limit = Instant::now() + Duration::from_secs(60);
                loop {
                    assert!(
                        Instant::now() < limit,
                        "rank 0 never noticed rank 1 leaving"
                    );
                    match ep.link(1).try_send(&data) {
                        Ok(0) => ep.wait(Duration::from_millis(20)).unwrap(),
                        Ok(_) => {}
                        Err(e) => {
                            assert!(e.is_peer_closed(), "{e}");
                            tx.send(e.to_string()).unwrap();
                            break;
                        }
                    }
                }
            });
        }
    });
    let message = rx.recv().unwrap();
    assert!(message.contains("rank 1"), "{message}");
    let line = format!("rdma: rank 0 says: {message}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    check_kernel_agrees(base, 0, 0, "after a peer went away");
}

#[test]
fn forcing_rdma_names_the_missing_device() {
    // Runs everywhere: with a device it must connect, without one it must say why.
    let _x = exclusive();
    let (mut eps, infos) = endpoints(2);
    let mut ep = eps.remove(0);
    match rdma_unavailable_reason() {
        Some(why) => {
            let e = ep
                .connect_all(
                    0,
                    &infos,
                    &[1; 32],
                    TransportChoice::Rdma,
                    Instant::now() + Duration::from_secs(5),
                )
                .unwrap_err();
            assert!(e.to_string().contains("CIERA_TRANSPORT=rdma"), "{e}");
            assert!(e.to_string().contains(&why), "{e}");
        }
        None => eprintln!("forcing_rdma_names_the_missing_device: a device is present"),
    }
}

#[test]
fn auto_picks_rdma_for_peers_on_other_hosts_only() {
    if !usable("auto_picks_rdma_for_peers_on_other_hosts_only") {
        return;
    }
    let _x = exclusive();
    // Ranks 0 and 1 claim one host, rank 2 another (host ids are what the choice reads).
    let (eps, mut infos) = endpoints(3);
    for (r, info) in infos.iter_mut().enumerate() {
        assert!(info.rdma, "rank {r} did not publish its RDMA device");
        info.host_id = format!("{}/test-host-{}", info.host_id, r / 2);
    }
    let secret = [5u8; 32];
    std::thread::scope(|s| {
        for (me, mut ep) in eps.into_iter().enumerate() {
            let infos = &infos;
            s.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                ep.connect_all(me, infos, &secret, TransportChoice::Auto, deadline)
                    .unwrap_or_else(|e| panic!("rank {me}: {e}"));
                for p in (0..3).filter(|&p| p != me) {
                    let want = if p / 2 == me / 2 {
                        Kind::Shm
                    } else {
                        Kind::Rdma
                    };
                    assert_eq!(ep.link(p).kind(), want, "rank {me} to rank {p}");
                }
            });
        }
    });
    let line = "rdma: auto: shm within a host, RDMA between hosts\n";
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
}

/// Every rank sends `len` bytes to every other straight out of one `SharedBuffer` (pieces of
/// odd sizes, at odd offsets) and checks every byte it receives.
fn exchange_from_shared(ep: &mut Endpoint, me: usize, n: usize, len: usize) {
    let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
    // One buffer per destination, alive for the whole exchange: each link registers one.
    let mut bufs: Vec<Option<SharedBuffer>> = (0..n).map(|_| None).collect();
    for &p in &peers {
        let mut b = SharedBuffer::new(len).unwrap();
        for (i, x) in b.iter_mut().enumerate() {
            *x = pattern(me, p, i);
        }
        bufs[p] = Some(b);
    }
    let mut sent = vec![0usize; n];
    let mut got = vec![0usize; n];
    let mut inb = vec![0u8; 77_777];
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut round = 0usize;
    while peers.iter().any(|&p| sent[p] < len || got[p] < len) {
        assert!(
            Instant::now() < deadline,
            "rank {me}: exchange from shared buffers stuck: sent {sent:?} got {got:?}"
        );
        let mut progress = false;
        for &p in &peers {
            if sent[p] < len {
                round += 1;
                let piece = [1, 7, 4096, 65_537, 300_000, 1 << 20][round % 6].min(len - sent[p]);
                let b = bufs[p].as_ref().unwrap();
                let k = ep.link(p).try_send(&b[sent[p]..sent[p] + piece]).unwrap();
                sent[p] += k;
                progress |= k > 0;
            }
            if got[p] < len {
                progress |= recv_checked(ep, me, p, &mut got[p], &mut inb);
            }
        }
        if !progress {
            ep.wait(Duration::from_millis(20)).unwrap();
        }
    }
}

#[test]
fn shared_buffers_are_sent_without_staging_and_registrations_are_released() {
    if !usable("shared_buffers_are_sent_without_staging_and_registrations_are_released") {
        return;
    }
    let _x = exclusive();
    let base = kernel_counts().map(|(counts, _)| counts);
    for n in [2, 3] {
        let len = 3 << 20;
        let before = rdma_zero_copy_bytes();
        let (eps, infos) = endpoints(n);
        let secret = [7u8; 32];
        let barrier = Barrier::new(n);
        let mid = Mutex::new(None);
        std::thread::scope(|s| {
            for (me, mut ep) in eps.into_iter().enumerate() {
                let (infos, barrier, mid) = (&infos, &barrier, &mid);
                s.spawn(move || {
                    let deadline = Instant::now() + Duration::from_secs(60);
                    ep.connect_all(me, infos, &secret, TransportChoice::Rdma, deadline)
                        .unwrap_or_else(|e| panic!("rank {me}: connect_all: {e}"));
                    exchange_from_shared(&mut ep, me, n, len);
                    barrier.wait();
                    if me == 0 {
                        // Ring and staging per link, and the one user buffer it sent from.
                        let links = n * (n - 1);
                        *mid.lock().unwrap() = kernel_disagrees(
                            base,
                            links,
                            3 * links,
                            &format!("{n} ranks sent from shared buffers"),
                        );
                    }
                    barrier.wait();
                    drop(ep);
                });
            }
        });
        if let Some(why) = mid.into_inner().unwrap() {
            panic!("{why}");
        }
        let direct = rdma_zero_copy_bytes() - before;
        let total = (n * (n - 1) * len) as u64;
        assert_eq!(direct, total, "bytes written without staging at {n} ranks");
        check_kernel_agrees(
            base,
            0,
            0,
            &format!("{n} ranks torn down after shared buffers"),
        );
        let line = format!(
            "rdma: {n} ranks exact from shared buffers, {direct} of {total} bytes sent without staging, 0 queue pairs and 0 registrations left\n"
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
}

#[test]
fn a_device_buffer_without_dmabuf_support_is_a_clear_error() {
    if !usable("a_device_buffer_without_dmabuf_support_is_a_clear_error") {
        return;
    }
    let _x = exclusive();
    // Not a dma-buf at all: a provider with the verb would refuse the descriptor, one
    // without it (soft-RoCE) says so first. Either way an error, never a crash.
    let not_dmabuf = std::fs::File::open("/proc/self/exe").unwrap();
    let buf = DmaBuf {
        fd: std::os::fd::AsRawFd::as_raw_fd(&not_dmabuf),
        offset: 0,
        len: 4096,
        iova: 0,
    };
    let (mut eps, infos) = endpoints(2);
    // Before connecting no link runs over RDMA.
    let e = eps[0].register_dmabuf(&buf).unwrap_err();
    assert!(e.to_string().contains("ibv_reg_dmabuf_mr"), "{e}");
    assert!(e.to_string().contains("no RDMA device"), "{e}");
    let secret = [4u8; 32];
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::scope(|s| {
        for (me, mut ep) in eps.into_iter().enumerate() {
            let (infos, tx) = (&infos, tx.clone());
            s.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                ep.connect_all(me, infos, &secret, TransportChoice::Rdma, deadline)
                    .unwrap_or_else(|e| panic!("rank {me}: connect_all: {e}"));
                match ep.register_dmabuf(&buf) {
                    Ok(k) => tx.send(format!("OK {k}")).unwrap(),
                    Err(e) => {
                        assert!(
                            matches!(e, ciera_transport::TransportError::Unsupported { .. }),
                            "{e}"
                        );
                        tx.send(e.to_string()).unwrap();
                    }
                }
            });
        }
    });
    drop(tx);
    let device = std::env::var("CIERA_IB_HCA").unwrap_or_default();
    for message in rx {
        assert!(
            !message.starts_with("OK"),
            "a non-dma-buf descriptor was registered: {message}"
        );
        assert!(
            message.contains("device buffers need dma-buf support (ibv_reg_dmabuf_mr)"),
            "{message}"
        );
        assert!(message.contains(&device), "{message}");
        let line = format!("rdma: dma-buf: {message}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
    assert_eq!(rdma_live_resources(), (0, 0));
}

#[test]
fn freed_shared_buffers_are_deregistered_and_plain_memory_is_staged() {
    if !usable("freed_shared_buffers_are_deregistered_and_plain_memory_is_staged") {
        return;
    }
    let _x = exclusive();
    let base = kernel_counts().map(|(counts, _)| counts);
    let piece = 512 << 10;
    let rounds = 3;
    let before = rdma_zero_copy_bytes();
    let (eps, infos) = endpoints(2);
    let secret = [8u8; 32];
    let barrier = Barrier::new(2);
    let mid = Mutex::new(None);
    std::thread::scope(|s| {
        for (me, mut ep) in eps.into_iter().enumerate() {
            let (infos, barrier, mid) = (&infos, &barrier, &mid);
            s.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                ep.connect_all(me, infos, &secret, TransportChoice::Rdma, deadline)
                    .unwrap_or_else(|e| panic!("rank {me}: connect_all: {e}"));
                let total = (rounds + 1) * piece;
                let limit = Instant::now() + Duration::from_secs(120);
                if me == 0 {
                    // A fresh SharedBuffer per round, freed after it, then plain memory.
                    for r in 0..=rounds {
                        let fill = |b: &mut [u8]| {
                            for (i, x) in b.iter_mut().enumerate() {
                                *x = pattern(0, 1, r * piece + i);
                            }
                        };
                        let mut shared;
                        let mut plain;
                        let bytes: &[u8] = if r < rounds {
                            shared = SharedBuffer::new(piece).unwrap();
                            fill(&mut shared);
                            &shared
                        } else {
                            plain = vec![0u8; piece];
                            fill(&mut plain);
                            &plain
                        };
                        let mut sent = 0;
                        while sent < piece {
                            assert!(Instant::now() < limit, "rank 0 stuck sending round {r}");
                            let k = ep.link(1).try_send(&bytes[sent..]).unwrap();
                            sent += k;
                            if k == 0 {
                                ep.wait(Duration::from_millis(20)).unwrap();
                            }
                        }
                    }
                } else {
                    let mut inb = vec![0u8; 65_536];
                    let mut got = 0;
                    while got < total {
                        assert!(Instant::now() < limit, "rank 1 stuck at {got} bytes");
                        let k = ep.link(0).try_recv(&mut inb).unwrap();
                        for (j, &b) in inb[..k].iter().enumerate() {
                            assert_eq!(b, pattern(0, 1, got + j), "byte {}", got + j);
                        }
                        got += k;
                        if k == 0 {
                            ep.wait(Duration::from_millis(20)).unwrap();
                        }
                    }
                }
                barrier.wait();
                if me == 0 {
                    // Ring and staging on both links; of the three user buffers, the last
                    // is still registered (freed, but no newer one replaced it), the first
                    // two were dropped when the next was registered.
                    *mid.lock().unwrap() =
                        kernel_disagrees(base, 2, 5, "after three freed shared buffers");
                }
                barrier.wait();
                drop(ep);
            });
        }
    });
    if let Some(why) = mid.into_inner().unwrap() {
        panic!("{why}");
    }
    let direct = rdma_zero_copy_bytes() - before;
    assert_eq!(
        direct,
        (rounds * piece) as u64,
        "only the shared rounds skip staging"
    );
    check_kernel_agrees(base, 0, 0, "torn down after freed shared buffers");
    let line = format!(
        "rdma: {rounds} freed shared buffers: {direct} bytes without staging, plain memory staged, registrations back to 0\n"
    );
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
}
