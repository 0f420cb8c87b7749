//! In-memory simulators that drive every schedule for ranks 1..=9 (gloo-style matrix): every
//! rank ends with every unit, no step sends a unit its rank does not hold, sends and receives
//! pair up in order, and the [`Progress`] state machine the executor uses finishes under
//! bounded links and random interleavings (cut-through included) without deadlock.

use std::collections::VecDeque;

use super::{Algo, AlgoChoice, Progress, Schedule, Step, Topology, Unit, UnitState};

fn algos_for(nranks: usize) -> Vec<Algo> {
    let mut v = vec![Algo::Ring, Algo::Bruck, Algo::Direct];
    if nranks.is_power_of_two() {
        v.push(Algo::RecursiveDoubling);
    }
    v
}

fn schedules(algo: Algo, nranks: usize, nchunks: usize) -> Vec<Schedule> {
    (0..nranks)
        .map(|r| Schedule::new(algo, r, &Topology::single_host(nranks), nchunks))
        .collect()
}

/// For each ordered pair (a, b): the units a sends to b, in order, are the units b expects
/// from a, in order.
fn check_pairing(scheds: &[Schedule]) -> Result<(), String> {
    let n = scheds.len();
    for a in 0..n {
        for b in 0..n {
            let sent: Vec<Unit> = scheds[a]
                .steps
                .iter()
                .filter_map(|s| match *s {
                    Step::Send { peer, unit } if peer == b => Some(unit),
                    _ => None,
                })
                .collect();
            let expected: Vec<Unit> = scheds[b]
                .steps
                .iter()
                .filter_map(|s| match *s {
                    Step::Recv { peer, unit } if peer == a => Some(unit),
                    _ => None,
                })
                .collect();
            if sent != expected {
                return Err(format!(
                    "rank {a} sends {sent:?} to rank {b}, which expects {expected:?}"
                ));
            }
            if a == b && !sent.is_empty() {
                return Err(format!("rank {a} sends to itself"));
            }
        }
    }
    Ok(())
}

/// Program order with eager sends: each rank runs its steps in order; a send needs the unit in
/// hand; a receive waits for the next message on its link. Returns what every rank holds.
fn run_program_order(scheds: &[Schedule]) -> Result<Vec<Vec<bool>>, String> {
    let n = scheds.len();
    let nchunks = scheds[0].nchunks;
    let mut have = vec![vec![false; n * nchunks]; n];
    for (r, h) in have.iter_mut().enumerate() {
        for c in 0..nchunks {
            h[r * nchunks + c] = true;
        }
    }
    let mut links: Vec<VecDeque<Unit>> = vec![VecDeque::new(); n * n];
    let mut pc = vec![0usize; n];
    loop {
        let mut moved = false;
        for r in 0..n {
            while let Some(step) = scheds[r].steps.get(pc[r]) {
                match *step {
                    Step::Send { peer, unit } => {
                        if !have[r][unit.src as usize * nchunks + unit.chunk as usize] {
                            return Err(format!(
                                "rank {r} step {} sends {unit:?} before holding it",
                                pc[r]
                            ));
                        }
                        links[r * n + peer].push_back(unit);
                    }
                    Step::Recv { peer, unit } => match links[peer * n + r].pop_front() {
                        Some(got) if got == unit => {
                            let i = unit.src as usize * nchunks + unit.chunk as usize;
                            if have[r][i] {
                                return Err(format!("rank {r} receives {unit:?} twice"));
                            }
                            have[r][i] = true;
                        }
                        Some(got) => {
                            return Err(format!(
                                "rank {r} expects {unit:?} from {peer}, gets {got:?}"
                            ))
                        }
                        None => break,
                    },
                }
                pc[r] += 1;
                moved = true;
            }
        }
        if pc.iter().zip(scheds).all(|(&p, s)| p == s.steps.len()) {
            break;
        }
        if !moved {
            return Err(format!("deadlock: program counters {pc:?}"));
        }
    }
    if links.iter().any(|l| !l.is_empty()) {
        return Err("messages left unreceived".into());
    }
    Ok(have)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Event {
    Header(Unit),
    Payload(Unit),
}

/// Deterministic xorshift, so a failing interleaving reproduces.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Drive the executor's state machine: each send is a header (may go once the unit is at
/// least arriving: cut-through) then a payload (once the unit is complete); every link holds at
/// most `cap` events; actions are taken in a random order. Checks it never deadlocks and every
/// rank ends with every unit.
fn run_progress(scheds: &[Schedule], cap: usize, seed: u64, own_ready: bool) -> Result<(), String> {
    let n = scheds.len();
    let mut progress: Vec<Progress> = scheds.iter().map(|s| Progress::new(s, own_ready)).collect();
    // Per rank and send lane: whether the header of the current unit went out.
    let mut header_out: Vec<Vec<bool>> = progress
        .iter()
        .map(|p| vec![false; p.send_lanes()])
        .collect();
    let mut links: Vec<VecDeque<Event>> = vec![VecDeque::new(); n * n];
    let mut rng = Rng(seed | 1);
    loop {
        // Collect every action possible now, then do one at random.
        let mut actions: Vec<(usize, bool, usize)> = Vec::new(); // (rank, is_send, lane)
        for r in 0..n {
            let p = &progress[r];
            for lane in 0..p.send_lanes() {
                let Some(u) = p.next_send(lane) else { continue };
                let room = links[r * n + p.send_peer(lane)].len() < cap;
                let st = p.state(u);
                let can = if header_out[r][lane] {
                    st == UnitState::Complete
                } else {
                    st != UnitState::Missing || u.src as usize == r
                };
                if room && can {
                    actions.push((r, true, lane));
                }
            }
            for lane in 0..p.recv_lanes() {
                if p.next_recv(lane).is_some() && !links[p.recv_peer(lane) * n + r].is_empty() {
                    actions.push((r, false, lane));
                }
            }
        }
        if actions.is_empty() {
            break;
        }
        let (r, is_send, lane) = actions[(rng.next() % actions.len() as u64) as usize];
        let p = &mut progress[r];
        if is_send {
            let u = p.next_send(lane).unwrap();
            if u.src as usize == r && p.state(u) == UnitState::Missing {
                p.produced(u); // an encoder makes own units on demand
            }
            let link = &mut links[r * n + p.send_peer(lane)];
            if header_out[r][lane] {
                link.push_back(Event::Payload(u));
                header_out[r][lane] = false;
                p.sent(lane);
            } else {
                link.push_back(Event::Header(u));
                header_out[r][lane] = true;
            }
        } else {
            let peer = p.recv_peer(lane);
            let want = p.next_recv(lane).unwrap();
            let ev = links[peer * n + r].pop_front().unwrap();
            match ev {
                Event::Header(u) if u == want && p.state(u) == UnitState::Missing => {
                    p.arriving(lane)
                }
                Event::Payload(u) if u == want && p.state(u) == UnitState::Arriving => {
                    p.received(lane)
                }
                other => {
                    return Err(format!(
                        "rank {r} lane {lane}: got {other:?}, wants {want:?}"
                    ))
                }
            }
        }
    }
    for (r, p) in progress.iter().enumerate() {
        if !p.is_done() {
            return Err(format!(
                "deadlock at rank {r}: {} sends and {} receives left",
                p.sends_left(),
                p.recvs_left()
            ));
        }
        for src in 0..n {
            for c in 0..p.nchunks() {
                // Own units are produced only when sent (a single rank sends nothing).
                let own_unsent = src == r && n == 1 && !own_ready;
                if !own_unsent && p.state(Unit::new(src, c)) != UnitState::Complete {
                    return Err(format!("rank {r} ends without chunk {c} of rank {src}"));
                }
            }
        }
    }
    Ok(())
}

#[test]
fn every_schedule_pairs_up_and_delivers_every_block() {
    for nranks in 1..=9 {
        for algo in algos_for(nranks) {
            for nchunks in 1..=3 {
                let ctx = format!("{algo} nranks={nranks} nchunks={nchunks}");
                let scheds = schedules(algo, nranks, nchunks);
                check_pairing(&scheds).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                let have = run_program_order(&scheds).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                for (r, h) in have.iter().enumerate() {
                    assert!(h.iter().all(|&x| x), "{ctx}: rank {r} misses blocks: {h:?}");
                }
            }
        }
    }
}

#[test]
fn progress_finishes_under_bounded_links_and_random_interleavings() {
    for nranks in 1..=9 {
        for algo in algos_for(nranks) {
            for nchunks in [1, 2, 5] {
                let scheds = schedules(algo, nranks, nchunks);
                for cap in [1, 2, 8] {
                    for seed in 0..20u64 {
                        let own_ready = seed % 2 == 0;
                        run_progress(&scheds, cap, seed * 7919 + 1, own_ready).unwrap_or_else(|e| {
                            panic!("{algo} nranks={nranks} nchunks={nchunks} cap={cap} seed={seed}: {e}")
                        });
                    }
                }
            }
        }
    }
}

#[test]
fn sends_per_rank_are_n_minus_one_blocks() {
    for nranks in 1..=9 {
        for algo in algos_for(nranks) {
            for s in schedules(algo, nranks, 2) {
                let (sent, recvd) = s.wire_bytes(|_| 1);
                assert_eq!(
                    recvd,
                    2 * (nranks - 1),
                    "{algo} nranks={nranks} rank {}",
                    s.rank
                );
                // Ring, doubling and Bruck all send exactly n-1 blocks per rank too.
                assert_eq!(
                    sent,
                    2 * (nranks - 1),
                    "{algo} nranks={nranks} rank {}",
                    s.rank
                );
            }
        }
    }
}

/// Host layouts for the hierarchical schedule: every N x L = nranks with N, L > 1, ranks
/// placed host by host and interleaved (rank r on host r % N).
fn hier_topologies(nranks: usize) -> Vec<Topology> {
    let mut v = Vec::new();
    for n in 2..nranks {
        if !nranks.is_multiple_of(n) || nranks / n < 2 {
            continue;
        }
        let l = nranks / n;
        let blocked: Vec<usize> = (0..nranks).map(|r| r / l).collect();
        let interleaved: Vec<usize> = (0..nranks).map(|r| r % n).collect();
        v.push(Topology::new(&blocked, false));
        v.push(Topology::new(&interleaved, true));
    }
    v
}

#[test]
fn hierarchical_schedules_pair_deliver_and_finish() {
    for nranks in 4..=12 {
        for t in hier_topologies(nranks) {
            assert_eq!(AlgoChoice::Auto.resolve(&t, 1 << 20), Algo::Hierarchical);
            for nchunks in [1, 2, 3] {
                let ctx = format!("hier {t:?} nchunks={nchunks}");
                let scheds: Vec<Schedule> = (0..nranks)
                    .map(|r| Schedule::new(Algo::Hierarchical, r, &t, nchunks))
                    .collect();
                check_pairing(&scheds).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                let have = run_program_order(&scheds).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                for (r, h) in have.iter().enumerate() {
                    assert!(h.iter().all(|&x| x), "{ctx}: rank {r} misses blocks: {h:?}");
                }
                for s in &scheds {
                    let (sent, recvd) = s.wire_bytes(|_| 1);
                    assert_eq!(
                        (sent, recvd),
                        (nchunks * (nranks - 1), nchunks * (nranks - 1))
                    );
                }
                for cap in [1, 2, 8] {
                    for seed in 0..10u64 {
                        run_progress(&scheds, cap, seed * 7919 + 3, seed % 2 == 0)
                            .unwrap_or_else(|e| panic!("{ctx} cap={cap} seed={seed}: {e}"));
                    }
                }
            }
        }
    }
    // Where it does not apply (one host, unequal hosts, one rank per host), the ring.
    for t in [
        Topology::single_host(4),
        Topology::new(&[0, 0, 1], false),
        Topology::new(&[0, 1, 2], false),
    ] {
        assert_eq!(AlgoChoice::Auto.resolve(&t, 1 << 20), Algo::Ring, "{t:?}");
        assert_eq!(
            AlgoChoice::Fixed(Algo::Hierarchical).resolve(&t, 1 << 20),
            Algo::Ring,
            "{t:?}"
        );
    }
}

#[test]
fn a_broken_schedule_is_caught() {
    // Swap two steps of rank 1's ring so it forwards a block before receiving it.
    let mut scheds = schedules(Algo::Ring, 3, 1);
    scheds[1].steps.swap(2, 1);
    assert!(run_program_order(&scheds).is_err());
    // Receive order that disagrees with the sender's order.
    let mut scheds = schedules(Algo::Bruck, 4, 2);
    let last = scheds[0].steps.len() - 1;
    scheds[0].steps.swap(last, last - 1);
    assert!(check_pairing(&scheds).is_err());
}
