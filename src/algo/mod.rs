//! Allgather schedules as pure state machines: no sockets, threads or clocks.
//!
//! Every rank starts with one *block* (its own shard) and must end with all `nranks` blocks.
//! A block is split into `nchunks` *chunks* (the pipelining unit; one chunk for small calls); a
//! [`Unit`] names chunk `chunk` of source rank `src`'s block. A [`Schedule`] is one rank's list of
//! [`Step`]s in program order: "send unit u to peer p" / "receive unit u from peer q". What a unit
//! *is* on the wire (raw bytes of the user's buffer, or a compressed frame) and where its bytes
//! live is not the schedule's business: the executor in [`crate::comm`] decides, and a GPU path
//! can drive the same schedules.
//!
//! [`Progress`] is the state machine an executor drives: it turns the program-order steps into
//! per-peer FIFO lanes (a byte stream per peer keeps messages in order), says which send may
//! start next on each lane (the unit must have arrived, or be arriving for cut-through
//! forwarding) and which unit the next message from each peer must carry.
//!
//! Algorithms (steps and bytes on the wire are in ARCHITECTURE.md, "Allgather algorithms"):
//! - [`ring`]: n-1 steps, each block travels n-1 hops; bandwidth-optimal, latency n-1 hops.
//! - [`doubling`] (recursive doubling): log2(n) rounds of pairwise exchange; powers of two.
//! - [`bruck`]: ceil(log2 n) rounds for any n; each round ships min(2^k, n-2^k) blocks.
//! - [`direct`]: every rank sends its block straight to every other; nothing is forwarded
//!   (for one host with single-copy shm, where receivers copy out of the sender's memory).
//! - [`hier`]: for several hosts with equal rank counts, a ring per rail across hosts, then a
//!   ring within each host; every network hop carries only its rail's blocks.

#![forbid(unsafe_code)]

pub mod bruck;
pub mod direct;
pub mod doubling;
pub mod hier;
pub mod ring;
pub mod topology;

#[cfg(test)]
mod sim;

use std::fmt;

use crate::coded_enum::coded_enum;
pub use topology::{LinkClass, Topology};

coded_enum! {
    #[repr(u8)]
    /// An allgather algorithm. The number is its code in the message header.
    pub enum Algo {
        Ring = 1,
        RecursiveDoubling = 2,
        Bruck = 3,
        Direct = 4,
        Hierarchical = 5,
    }
}

impl Algo {
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::RecursiveDoubling => "rd",
            Algo::Bruck => "bruck",
            Algo::Direct => "direct",
            Algo::Hierarchical => "hier",
        }
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which algorithm to use: a fixed one or chosen per call by size and rank count
/// (`CIERA_ALGO=ring|rd|bruck|auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AlgoChoice {
    #[default]
    Auto,
    Fixed(Algo),
}

/// Below this many gathered bytes (all ranks together) `Auto` uses a logarithmic algorithm
/// (recursive doubling or Bruck); from there on the pipelined ring, which moves each block over
/// every link once and forwards chunks as they arrive. Over shared memory the ring wins from a
/// lower size (ARCHITECTURE.md, "Allgather algorithms", has the crossover measurements).
pub const SMALL_CALL_BYTES: usize = 64 * 1024;
/// The same limit when every link of the communicator is shared memory.
pub const SMALL_CALL_BYTES_SHM: usize = 16 * 1024;

impl AlgoChoice {
    /// Parse `ring`, `rd` (or `recursive-doubling`), `bruck`, `auto`.
    pub fn parse(s: &str) -> Option<AlgoChoice> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => AlgoChoice::Auto,
            "ring" => AlgoChoice::Fixed(Algo::Ring),
            "rd" | "recursive-doubling" | "recursive_doubling" | "doubling" => {
                AlgoChoice::Fixed(Algo::RecursiveDoubling)
            }
            "bruck" => AlgoChoice::Fixed(Algo::Bruck),
            "direct" => AlgoChoice::Fixed(Algo::Direct),
            "hier" | "hierarchical" => AlgoChoice::Fixed(Algo::Hierarchical),
            _ => return None,
        })
    }

    /// How the choices are spelled, for messages.
    pub const SPELLINGS: &'static str = "auto, ring, rd, bruck, direct or hier";

    /// The algorithm for a call gathering `total_bytes` (all ranks together) over the ranks of
    /// `topology`. Recursive doubling needs a power of two; asked for with another rank count
    /// it falls back to Bruck (which does the same number of rounds rounded up). `Auto` takes
    /// a logarithmic algorithm below [`SMALL_CALL_BYTES`] ([`SMALL_CALL_BYTES_SHM`] when every
    /// link is shared memory), from there the hierarchical schedule where it applies (several
    /// hosts with equal rank counts: [`hier::applies`]), else the ring; `hier` asked for where
    /// it does not apply is the ring too. Every rank computes the same answer from
    /// the same arguments; the message header carries it so a rank configured differently is
    /// caught.
    pub fn resolve(self, topology: &Topology, total_bytes: usize) -> Algo {
        let nranks = topology.nranks();
        let small_call_bytes = if topology.all_shared_memory() {
            SMALL_CALL_BYTES_SHM
        } else {
            SMALL_CALL_BYTES
        };
        let log_algo = if nranks.is_power_of_two() {
            Algo::RecursiveDoubling
        } else {
            Algo::Bruck
        };
        // Hierarchical where it applies (several hosts, equal rank counts), else the ring.
        let large = if hier::applies(topology) {
            Algo::Hierarchical
        } else {
            Algo::Ring
        };
        match self {
            AlgoChoice::Fixed(Algo::RecursiveDoubling) => log_algo,
            AlgoChoice::Fixed(Algo::Hierarchical) => large,
            AlgoChoice::Fixed(a) => a,
            AlgoChoice::Auto if total_bytes < small_call_bytes => log_algo,
            AlgoChoice::Auto => large,
        }
    }
}

impl fmt::Display for AlgoChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AlgoChoice::Auto => f.write_str("auto"),
            AlgoChoice::Fixed(a) => a.fmt(f),
        }
    }
}

/// Chunk `chunk` of source rank `src`'s block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Unit {
    pub src: u32,
    pub chunk: u32,
}

impl Unit {
    pub fn new(src: usize, chunk: usize) -> Unit {
        Unit {
            src: src as u32,
            chunk: chunk as u32,
        }
    }
}

/// One step of a rank's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send `unit` to `peer`. The unit must be this rank's own or already received.
    Send { peer: usize, unit: Unit },
    /// Receive `unit` from `peer`.
    Recv { peer: usize, unit: Unit },
}

/// One rank's allgather schedule, in program order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub algo: Algo,
    pub rank: usize,
    pub nranks: usize,
    pub nchunks: usize,
    pub steps: Vec<Step>,
}

impl Schedule {
    /// The steps of `algo` for `rank` of the ranks of `topology`, each block split in
    /// `nchunks` chunks. Panics if `rank` is not in the topology, `nchunks == 0`, or recursive
    /// doubling is asked for a rank count that is not a power of two (callers resolve that
    /// with [`AlgoChoice::resolve`]). The flat algorithms order ranks by number; the
    /// hierarchical one reads the hosts from the topology.
    pub fn new(algo: Algo, rank: usize, topology: &Topology, nchunks: usize) -> Schedule {
        let nranks = topology.nranks();
        assert!(rank < nranks, "rank {rank} out of range for {nranks} ranks");
        assert!(nchunks > 0, "a block has at least one chunk");
        let steps = match algo {
            Algo::Ring => ring::steps(rank, nranks, nchunks),
            Algo::RecursiveDoubling => doubling::steps(rank, nranks, nchunks),
            Algo::Bruck => bruck::steps(rank, nranks, nchunks),
            Algo::Direct => direct::steps(rank, nranks, nchunks),
            Algo::Hierarchical if hier::layout(topology).is_some() => {
                hier::steps(rank, topology, nchunks)
            }
            // Callers resolve first ([`AlgoChoice::resolve`]); asked for on hosts of unequal
            // sizes anyway, the ring (what resolve would have chosen).
            Algo::Hierarchical => ring::steps(rank, nranks, nchunks),
        };
        Schedule {
            algo,
            rank,
            nranks,
            nchunks,
            steps,
        }
    }

    /// Bytes this rank sends and receives, given every chunk's payload length.
    pub fn wire_bytes(&self, chunk_len: impl Fn(Unit) -> usize) -> (usize, usize) {
        let mut sent = 0;
        let mut received = 0;
        for step in &self.steps {
            match *step {
                Step::Send { unit, .. } => sent += chunk_len(unit),
                Step::Recv { unit, .. } => received += chunk_len(unit),
            }
        }
        (sent, received)
    }
}

/// Where a unit stands on this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitState {
    /// Not here yet.
    Missing,
    /// Its message header has arrived (its length is known) and its payload is arriving: a
    /// send of it may start and forward bytes as they come (cut-through).
    Arriving,
    /// All of it is here (or it is this rank's own and has been produced).
    Complete,
}

/// A lane: the ordered units exchanged with one peer in one direction.
#[derive(Clone, Debug, Default)]
struct Lane {
    peer: usize,
    units: Vec<Unit>,
    next: usize,
}

/// The executor's view of a schedule: per-peer send and receive lanes and the state of every
/// unit. Pure bookkeeping; the executor moves the bytes and reports back.
#[derive(Clone, Debug)]
pub struct Progress {
    rank: usize,
    nranks: usize,
    nchunks: usize,
    send_lanes: Vec<Lane>,
    recv_lanes: Vec<Lane>,
    state: Vec<UnitState>,
    /// How many sends of each unit the schedule has (unit index order).
    sends_of: Vec<u32>,
    sends_left: usize,
    recvs_left: usize,
}

impl Progress {
    /// Bookkeeping for `schedule`. This rank's own units start `Missing` when `own_ready`
    /// is false (an encoder makes them on demand) and `Complete` otherwise (raw bytes).
    pub fn new(schedule: &Schedule, own_ready: bool) -> Progress {
        let mut send_lanes: Vec<Lane> = Vec::new();
        let mut recv_lanes: Vec<Lane> = Vec::new();
        fn lane_for(lanes: &mut Vec<Lane>, peer: usize) -> &mut Lane {
            let i = match lanes.iter().position(|l| l.peer == peer) {
                Some(i) => i,
                None => {
                    lanes.push(Lane {
                        peer,
                        units: Vec::new(),
                        next: 0,
                    });
                    lanes.len() - 1
                }
            };
            &mut lanes[i]
        }
        for step in &schedule.steps {
            match *step {
                Step::Send { peer, unit } => lane_for(&mut send_lanes, peer).units.push(unit),
                Step::Recv { peer, unit } => lane_for(&mut recv_lanes, peer).units.push(unit),
            }
        }
        let mut sends_of = vec![0u32; schedule.nranks * schedule.nchunks];
        for l in &send_lanes {
            for u in &l.units {
                sends_of[u.src as usize * schedule.nchunks + u.chunk as usize] += 1;
            }
        }
        let mut p = Progress {
            sends_of,
            rank: schedule.rank,
            nranks: schedule.nranks,
            nchunks: schedule.nchunks,
            sends_left: send_lanes.iter().map(|l| l.units.len()).sum(),
            recvs_left: recv_lanes.iter().map(|l| l.units.len()).sum(),
            send_lanes,
            recv_lanes,
            state: Vec::new(),
        };
        p.reset(own_ready);
        p
    }

    /// Rewind to the start, for the next call with the same schedule.
    pub fn reset(&mut self, own_ready: bool) {
        self.state.clear();
        self.state
            .resize(self.nranks * self.nchunks, UnitState::Missing);
        if own_ready {
            for c in 0..self.nchunks {
                self.state[self.rank * self.nchunks + c] = UnitState::Complete;
            }
        }
        for l in self.send_lanes.iter_mut().chain(self.recv_lanes.iter_mut()) {
            l.next = 0;
        }
        self.sends_left = self.send_lanes.iter().map(|l| l.units.len()).sum();
        self.recvs_left = self.recv_lanes.iter().map(|l| l.units.len()).sum();
    }

    pub fn nchunks(&self) -> usize {
        self.nchunks
    }

    /// Number of send lanes; lane `i` goes to `send_peer(i)`.
    pub fn send_lanes(&self) -> usize {
        self.send_lanes.len()
    }

    pub fn recv_lanes(&self) -> usize {
        self.recv_lanes.len()
    }

    pub fn send_peer(&self, lane: usize) -> usize {
        self.send_lanes[lane].peer
    }

    pub fn recv_peer(&self, lane: usize) -> usize {
        self.recv_lanes[lane].peer
    }

    pub fn state(&self, unit: Unit) -> UnitState {
        self.state[self.index(unit)]
    }

    fn index(&self, unit: Unit) -> usize {
        unit.src as usize * self.nchunks + unit.chunk as usize
    }

    /// The unit lane `lane` must send next, whatever its state (None when the lane is done).
    pub fn next_send(&self, lane: usize) -> Option<Unit> {
        let l = &self.send_lanes[lane];
        l.units.get(l.next).copied()
    }

    /// The next unit of lane `lane` if a send of it may start now (it is not `Missing`).
    pub fn ready_send(&self, lane: usize) -> Option<Unit> {
        self.next_send(lane)
            .filter(|&u| self.state(u) != UnitState::Missing)
    }

    /// The unit the next message from lane `lane`'s peer must carry.
    pub fn next_recv(&self, lane: usize) -> Option<Unit> {
        let l = &self.recv_lanes[lane];
        l.units.get(l.next).copied()
    }

    /// Lane `lane` handed its current unit to the transport in full; returns that unit.
    pub fn sent(&mut self, lane: usize) -> Unit {
        let l = &mut self.send_lanes[lane];
        debug_assert!(l.next < l.units.len());
        let u = l.units[l.next];
        l.next += 1;
        self.sends_left -= 1;
        u
    }

    /// How many times this rank's schedule sends `unit` (to how many peers it goes).
    pub fn sends_of(&self, unit: Unit) -> usize {
        self.sends_of[self.index(unit)] as usize
    }

    /// This rank's own unit `unit` has been produced (encoded) and may be sent.
    pub fn produced(&mut self, unit: Unit) {
        debug_assert_eq!(unit.src as usize, self.rank);
        let i = self.index(unit);
        self.state[i] = UnitState::Complete;
    }

    /// The header of lane `lane`'s next unit arrived: its payload is on its way.
    pub fn arriving(&mut self, lane: usize) {
        let u = self.next_recv(lane).expect("arriving on a finished lane");
        let i = self.index(u);
        self.state[i] = UnitState::Arriving;
    }

    /// Lane `lane`'s current unit arrived in full.
    pub fn received(&mut self, lane: usize) {
        let u = self.next_recv(lane).expect("received on a finished lane");
        let i = self.index(u);
        self.state[i] = UnitState::Complete;
        self.recv_lanes[lane].next += 1;
        self.recvs_left -= 1;
    }

    pub fn sends_left(&self) -> usize {
        self.sends_left
    }

    pub fn recvs_left(&self) -> usize {
        self.recvs_left
    }

    pub fn is_done(&self) -> bool {
        self.sends_left == 0 && self.recvs_left == 0
    }
}

/// `(a - b) mod n` for ring arithmetic on ranks.
pub(crate) fn sub_mod(a: usize, b: usize, n: usize) -> usize {
    (a + n - b % n) % n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_log_algorithms_for_small_calls_and_ring_for_large() {
        let net = |n: usize| Topology::new(&(0..n).collect::<Vec<_>>(), true);
        assert_eq!(
            AlgoChoice::Auto.resolve(&net(4), 8),
            Algo::RecursiveDoubling
        );
        assert_eq!(AlgoChoice::Auto.resolve(&net(5), 8), Algo::Bruck);
        assert_eq!(AlgoChoice::Auto.resolve(&net(4), 64 << 20), Algo::Ring);
        assert_eq!(
            AlgoChoice::Fixed(Algo::RecursiveDoubling).resolve(&net(6), 8),
            Algo::Bruck
        );
        assert_eq!(
            AlgoChoice::Fixed(Algo::Ring).resolve(&net(6), 8),
            Algo::Ring
        );
        // One host, shared memory everywhere: the ring from 16 KiB on.
        let shm = Topology::single_host(4);
        assert_eq!(AlgoChoice::Auto.resolve(&shm, 32 << 10), Algo::Ring);
        assert_eq!(
            AlgoChoice::Auto.resolve(&shm, 8 << 10),
            Algo::RecursiveDoubling
        );
        // One host but TCP links (CIERA_TRANSPORT=tcp): the network limit.
        let tcp = Topology::new(&[1, 1, 1, 1], false);
        assert_eq!(
            AlgoChoice::Auto.resolve(&tcp, 32 << 10),
            Algo::RecursiveDoubling
        );
    }

    #[test]
    fn parse_names() {
        assert_eq!(
            AlgoChoice::parse("ring"),
            Some(AlgoChoice::Fixed(Algo::Ring))
        );
        assert_eq!(
            AlgoChoice::parse("RD"),
            Some(AlgoChoice::Fixed(Algo::RecursiveDoubling))
        );
        assert_eq!(
            AlgoChoice::parse("bruck"),
            Some(AlgoChoice::Fixed(Algo::Bruck))
        );
        assert_eq!(AlgoChoice::parse("auto"), Some(AlgoChoice::Auto));
        assert_eq!(AlgoChoice::parse("tree"), None);
        assert_eq!(
            AlgoChoice::parse("direct"),
            Some(AlgoChoice::Fixed(Algo::Direct))
        );
        for a in [
            Algo::Ring,
            Algo::RecursiveDoubling,
            Algo::Bruck,
            Algo::Direct,
        ] {
            assert_eq!(Algo::from_code(a.code()), Some(a));
        }
    }

    #[test]
    fn ring_and_direct_wire_bytes_are_n_minus_one_blocks_each_way() {
        for algo in [Algo::Ring, Algo::Direct] {
            for n in 1..=9 {
                let s = Schedule::new(algo, 0, &Topology::single_host(n), 3);
                assert_eq!(s.wire_bytes(|_| 10), (30 * (n - 1), 30 * (n - 1)), "{algo}");
            }
        }
    }
}
