//! Ranks as threads of this process, over real shm segments and real TCP sockets.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use ciera_transport::auth::{self, Role};
use ciera_transport::{Endpoint, Kind, TransportChoice, TransportError};
use common::*;

fn expect_all_ok(results: Vec<Result<(), String>>) {
    for (rank, r) in results.into_iter().enumerate() {
        if let Err(e) = r {
            panic!("rank {rank}: {e}");
        }
    }
}

fn mesh(world: usize, choice: TransportChoice, bytes: usize, want: Kind) {
    let (eps, infos) = bind_all(world);
    expect_all_ok(run_threads(eps, infos, choice, move |me, ep| {
        for p in (0..world).filter(|&p| p != me) {
            let link = ep.link(p);
            if link.kind() != want || link.peer() != p {
                return Err(format!(
                    "rank {me}: link to {p} is {:?} to {}, want {want:?}",
                    link.kind(),
                    link.peer()
                ));
            }
        }
        exchange(ep, me, world, bytes, Duration::from_secs(60))
    }));
}

#[test]
fn two_ranks_exchange_64_mib_over_shm() {
    mesh(2, TransportChoice::Auto, 64 << 20, Kind::Shm);
}

#[test]
fn two_ranks_exchange_64_mib_over_tcp() {
    mesh(2, TransportChoice::Tcp, 64 << 20, Kind::Tcp);
}

#[test]
fn four_ranks_full_mesh_over_shm() {
    mesh(4, TransportChoice::Shm, (3 << 20) + 4321, Kind::Shm);
}

#[test]
fn four_ranks_full_mesh_over_tcp() {
    mesh(4, TransportChoice::Tcp, (3 << 20) + 4321, Kind::Tcp);
}

#[test]
fn zero_and_one_byte_exchanges() {
    for bytes in [0, 1] {
        mesh(3, TransportChoice::Auto, bytes, Kind::Shm);
    }
}

#[test]
fn two_hosts_mix_shm_and_tcp_links() {
    // Pretend ranks 0,1 and 2,3 live on two machines: pairs within a "host" use shm, pairs
    // across use TCP, and every endpoint waits on both kinds at once.
    let (eps, mut infos) = bind_all(4);
    for (rank, info) in infos.iter_mut().enumerate() {
        info.host_id = if rank < 2 {
            "hostA".into()
        } else {
            "hostB".into()
        };
    }
    expect_all_ok(run_threads(eps, infos, TransportChoice::Auto, |me, ep| {
        for p in (0..4).filter(|&p| p != me) {
            let want = if (p < 2) == (me < 2) {
                Kind::Shm
            } else {
                Kind::Tcp
            };
            if ep.link(p).kind() != want {
                return Err(format!(
                    "rank {me}: link to {p} is {:?}, want {want:?}",
                    ep.link(p).kind()
                ));
            }
        }
        exchange(ep, me, 4, (2 << 20) + 77, Duration::from_secs(60))
    }));
}

#[test]
fn shm_forced_across_hosts_is_unsupported() {
    let (mut eps, mut infos) = bind_all(2);
    infos[1].host_id = "elsewhere".into();
    let err = eps[0]
        .connect_all(0, &infos, &SECRET, TransportChoice::Shm, deadline(5))
        .unwrap_err();
    assert!(matches!(err, TransportError::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("elsewhere"), "{err}");
}

#[test]
fn bad_arguments_are_named() {
    let (mut eps, infos) = bind_all(2);
    let err = eps[0]
        .connect_all(5, &infos, &SECRET, TransportChoice::Auto, deadline(5))
        .unwrap_err();
    assert!(err.to_string().contains("my_rank 5"), "{err}");
    let err = eps[0]
        .connect_all(1, &infos, &SECRET, TransportChoice::Auto, deadline(5))
        .unwrap_err();
    assert!(err.to_string().contains("peers[1]"), "{err}");
}

#[test]
fn strangers_are_refused_and_the_mesh_still_forms() {
    let (eps, infos) = bind_all(3);
    let target = infos[0].addr;
    // Connected before rank 0 even starts accepting, so they are first in its backlog.
    let rogue = std::thread::spawn(move || {
        let mut s = TcpStream::connect(target).unwrap();
        auth::handshake(
            &mut s,
            Role::Client,
            &[0xAB; 32],
            "link rank 1 of 3 pid 1",
            None,
            deadline(20),
        )
    });
    let silent = TcpStream::connect(target).unwrap();
    let mut garbage = TcpStream::connect(target).unwrap();
    garbage.write_all(&[0xFF; 200]).unwrap();

    expect_all_ok(run_threads(eps, infos, TransportChoice::Auto, |me, ep| {
        exchange(ep, me, 3, 100_000, Duration::from_secs(60))
    }));
    let r = rogue.join().unwrap();
    assert!(
        matches!(r, Err(TransportError::Auth { .. })),
        "rogue got {r:?}"
    );
    drop(silent);
}

#[test]
fn a_rank_with_another_secret_fails_auth_and_the_other_times_out_naming_it() {
    let (mut eps, infos) = bind_all(2);
    let mut ep1 = eps.pop().unwrap();
    let mut ep0 = eps.pop().unwrap();
    let infos1 = infos.clone();
    let t = std::thread::spawn(move || {
        ep1.connect_all(1, &infos1, &[0x55; 32], TransportChoice::Auto, deadline(20))
    });
    let err0 = ep0
        .connect_all(
            0,
            &infos,
            &SECRET,
            TransportChoice::Auto,
            std::time::Instant::now() + Duration::from_secs(2),
        )
        .unwrap_err();
    let err1 = t.join().unwrap().unwrap_err();
    assert!(matches!(err1, TransportError::Auth { .. }), "{err1}");
    assert!(matches!(err0, TransportError::Timeout { .. }), "{err0}");
    let text = err0.to_string();
    assert!(
        text.contains("[1]") && text.contains("failed authentication"),
        "{text}"
    );
}

#[test]
fn missing_ranks_time_out_with_names() {
    // Rank 1 never shows up: rank 0 (acceptor) names it.
    let (mut eps, infos) = bind_all(2);
    let err = eps[0].connect_all(
        0,
        &infos,
        &SECRET,
        TransportChoice::Auto,
        deadline(0) + Duration::from_millis(300),
    );
    let err = err.unwrap_err();
    assert!(
        matches!(err, TransportError::Timeout { .. }) && err.to_string().contains("[1]"),
        "{err}"
    );
    // Rank 0 never runs connect_all: rank 1's connection sits in its backlog unanswered.
    let err = eps[1].connect_all(
        1,
        &infos,
        &SECRET,
        TransportChoice::Auto,
        deadline(0) + Duration::from_millis(300),
    );
    let err = err.unwrap_err();
    assert!(matches!(err, TransportError::Timeout { .. }), "{err}");
    // A failed connect_all can be retried (rank 0 first meets rank 1's stale, dropped
    // connection from the attempt above and must shrug it off).
    expect_all_ok(run_threads(eps, infos, TransportChoice::Auto, |me, ep| {
        exchange(ep, me, 2, 1000, Duration::from_secs(60))
    }));
}

#[test]
fn single_rank_world_needs_no_links() {
    let mut ep = Endpoint::bind(localhost()).unwrap();
    let info = ep.local_info();
    ep.connect_all(0, &[info], &SECRET, TransportChoice::Auto, deadline(5))
        .unwrap();
    assert_eq!(ep.rank(), Some(0));
    assert_eq!(ep.world_size(), 1);
    ep.wait(Duration::from_millis(1)).unwrap();
}

#[test]
fn waker_interrupts_wait_with_and_without_links() {
    // No links.
    let mut ep = Endpoint::bind(localhost()).unwrap();
    let waker = ep.waker();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        waker.wake();
    });
    ep.wait(Duration::from_secs(120)).unwrap();
    t.join().unwrap();

    // A wake before wait makes the next wait return at once.
    ep.waker().wake();
    ep.wait(Duration::from_secs(120)).unwrap();

    // Shm links, TCP links.
    for choice in [TransportChoice::Shm, TransportChoice::Tcp] {
        let (eps, infos) = bind_all(2);
        expect_all_ok(run_threads(eps, infos, choice, |me, ep| {
            if me == 0 {
                let waker = ep.waker();
                let t = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(30));
                    waker.wake();
                });
                // Nothing will arrive on the link; only the waker can end this early. Loop
                // over spurious wake-ups until it has fired.
                let start = std::time::Instant::now();
                ep.wait(Duration::from_secs(120))
                    .map_err(|e| e.to_string())?;
                t.join().unwrap();
                if start.elapsed() > Duration::from_secs(100) {
                    return Err("wait ignored the waker".into());
                }
                ep.link(1).try_send(b"done").map_err(|e| e.to_string())?;
            } else {
                let mut buf = [0u8; 4];
                let mut got = 0;
                while got < 4 {
                    got += ep
                        .link(0)
                        .try_recv(&mut buf[got..])
                        .map_err(|e| e.to_string())?;
                    ep.wait(Duration::from_millis(100))
                        .map_err(|e| e.to_string())?;
                }
            }
            Ok(())
        }));
    }
}

#[test]
fn clean_close_delivers_last_bytes_then_peer_closed() {
    for choice in [TransportChoice::Shm, TransportChoice::Tcp] {
        let (eps, infos) = bind_all(2);
        expect_all_ok(run_threads(eps, infos, choice, move |me, ep| {
            if me == 1 {
                let n = ep.link(0).try_send(b"goodbye").map_err(|e| e.to_string())?;
                return if n == 7 {
                    Ok(())
                } else {
                    Err(format!("sent {n}"))
                };
            }
            let mut got = Vec::new();
            let mut buf = [0u8; 64];
            let start = std::time::Instant::now();
            loop {
                match ep.link(1).try_recv(&mut buf) {
                    Ok(0) => ep
                        .wait(Duration::from_millis(100))
                        .map_err(|e| e.to_string())?,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) if e.is_peer_closed() => break,
                    Err(e) => return Err(e.to_string()),
                }
                if start.elapsed() > Duration::from_secs(30) {
                    return Err(format!(
                        "{choice:?}: no PeerClosed after the peer dropped its endpoint"
                    ));
                }
            }
            if got != b"goodbye" {
                return Err(format!("{choice:?}: got {got:?}"));
            }
            match ep.link(1).try_send(b"x") {
                Err(e) if e.is_peer_closed() => Ok(()),
                other => Err(format!("{choice:?}: send after close gave {other:?}")),
            }
        }));
    }
}

#[test]
fn link_pair_hands_out_the_requested_links() {
    let (eps, infos) = bind_all(3);
    expect_all_ok(run_threads(eps, infos, TransportChoice::Auto, |me, ep| {
        let (left, right) = ((me + 2) % 3, (me + 1) % 3);
        let (l, r) = ep.link_pair(left, right);
        if l.peer() != left || r.peer() != right {
            return Err(format!(
                "rank {me}: link_pair({left}, {right}) gave ({}, {})",
                l.peer(),
                r.peer()
            ));
        }
        Ok(())
    }));
}

#[test]
#[should_panic(expected = "no link to itself")]
fn link_to_self_is_a_caller_bug() {
    let mut ep = Endpoint::bind(localhost()).unwrap();
    let info = ep.local_info();
    ep.connect_all(0, &[info], &SECRET, TransportChoice::Auto, deadline(5))
        .unwrap();
    ep.link(0);
}

#[test]
fn wait_notices_a_departed_peer_without_any_read() {
    // Rank 1 leaves at once; rank 0 only calls wait. The link must turn closed (so wait stops
    // watching a socket that stays readable forever) and report PeerClosed afterwards.
    for choice in [TransportChoice::Shm, TransportChoice::Tcp] {
        let (eps, infos) = bind_all(2);
        expect_all_ok(run_threads(eps, infos, choice, move |me, ep| {
            if me == 1 {
                return Ok(());
            }
            let start = std::time::Instant::now();
            while !ep.link(1).is_closed() {
                ep.wait(Duration::from_millis(100))
                    .map_err(|e| e.to_string())?;
                if start.elapsed() > Duration::from_secs(30) {
                    return Err(format!("{choice:?}: wait never noticed the peer leaving"));
                }
            }
            match ep.link(1).try_recv(&mut [0u8; 8]) {
                Err(e) if e.is_peer_closed() => Ok(()),
                other => Err(format!("{choice:?}: recv after close gave {other:?}")),
            }
        }));
    }
}

#[test]
fn handles_cross_threads() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<Endpoint>();
    send::<ciera_transport::Link>();
    send_sync::<ciera_transport::Waker>();
    send_sync::<TransportError>();
}
