//! Where the ranks are: which host each rank runs on, and the class of link between any two
//! ranks. Every rank builds the same [`Topology`] from the bootstrap's peer table (each rank's
//! host id) and the job's transport setting, so every decision read from it (the algorithm of a
//! call, later which hops compress) comes out the same on every rank without a message.

/// The kind of link between two ranks, as every rank can tell from the table alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkClass {
    /// A rank and itself.
    Local,
    /// Two processes on one host connected through shared memory.
    SharedMemory,
    /// A network link: ranks on different hosts, or on one host when the job asked for TCP.
    Network,
}

/// The hosts of a job and the link classes between its ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Host index (0.., in order of first appearance) of every rank.
    host_of: Vec<usize>,
    /// Whether ranks on one host talk through shared memory (else over the network).
    shm_within_host: bool,
}

impl Topology {
    /// A topology from every rank's host identifier (any values; equal means same host), in
    /// rank order. `shm_within_host`: ranks on one host use shared memory (false when the job
    /// forces TCP).
    pub fn new<H: PartialEq>(hosts: &[H], shm_within_host: bool) -> Topology {
        let mut seen: Vec<&H> = Vec::new();
        let host_of = hosts
            .iter()
            .map(|h| match seen.iter().position(|s| *s == h) {
                Some(i) => i,
                None => {
                    seen.push(h);
                    seen.len() - 1
                }
            })
            .collect();
        Topology {
            host_of,
            shm_within_host,
        }
    }

    /// `nranks` ranks on one host, connected through shared memory.
    pub fn single_host(nranks: usize) -> Topology {
        Topology {
            host_of: vec![0; nranks],
            shm_within_host: true,
        }
    }

    pub fn nranks(&self) -> usize {
        self.host_of.len()
    }

    /// The host index of `rank` (hosts are numbered 0.. in order of their first rank).
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// Number of distinct hosts.
    pub fn hosts(&self) -> usize {
        self.host_of.iter().max().map_or(0, |&h| h + 1)
    }

    /// The ranks on `rank`'s host, `rank` included.
    pub fn ranks_on_host_of(&self, rank: usize) -> usize {
        let h = self.host_of[rank];
        self.host_of.iter().filter(|&&x| x == h).count()
    }

    /// The class of the link between ranks `a` and `b`.
    pub fn link(&self, a: usize, b: usize) -> LinkClass {
        if a == b {
            LinkClass::Local
        } else if self.shm_within_host && self.host_of[a] == self.host_of[b] {
            LinkClass::SharedMemory
        } else {
            LinkClass::Network
        }
    }

    /// Whether every link between two different ranks is shared memory.
    pub fn all_shared_memory(&self) -> bool {
        self.nranks() > 1 && self.hosts() == 1 && self.shm_within_host
    }
}

/// "2 hosts x 2 ranks (host 0: ranks 0 1; host 1: ranks 2 3), shared memory within hosts".
impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hosts = self.hosts();
        let mut per: Vec<Vec<usize>> = vec![Vec::new(); hosts];
        for (r, &h) in self.host_of.iter().enumerate() {
            per[h].push(r);
        }
        let sizes: Vec<usize> = per.iter().map(Vec::len).collect();
        if sizes.iter().all(|&s| s == sizes[0]) {
            write!(
                f,
                "{hosts} host(s) x {} rank(s) (",
                sizes.first().unwrap_or(&0)
            )?;
        } else {
            write!(f, "{hosts} hosts of {sizes:?} ranks (")?;
        }
        for (h, ranks) in per.iter().enumerate() {
            let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
            write!(
                f,
                "{}host {h}: ranks {}",
                if h > 0 { "; " } else { "" },
                list.join(" ")
            )?;
        }
        let within = if self.shm_within_host {
            "shared memory"
        } else {
            "TCP"
        };
        write!(f, "), {within} within hosts")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_by_host() {
        let t = Topology::new(&["a", "a", "b", "b"], true);
        assert_eq!(
            t.to_string(),
            "2 host(s) x 2 rank(s) (host 0: ranks 0 1; host 1: ranks 2 3), shared memory within hosts"
        );
        let t = Topology::new(&[1, 0, 1], false);
        assert_eq!(
            t.to_string(),
            "2 hosts of [2, 1] ranks (host 0: ranks 0 2; host 1: ranks 1), TCP within hosts"
        );
    }

    #[test]
    fn hosts_are_numbered_by_first_rank_and_links_classified() {
        let t = Topology::new(&["b", "a", "b", "c", "a"], true);
        assert_eq!(t.nranks(), 5);
        assert_eq!(t.hosts(), 3);
        assert_eq!(
            (0..5).map(|r| t.host_of(r)).collect::<Vec<_>>(),
            [0, 1, 0, 2, 1]
        );
        assert_eq!(t.ranks_on_host_of(0), 2);
        assert_eq!(t.ranks_on_host_of(3), 1);
        assert_eq!(t.link(0, 0), LinkClass::Local);
        assert_eq!(t.link(0, 2), LinkClass::SharedMemory);
        assert_eq!(t.link(0, 1), LinkClass::Network);
        assert!(!t.all_shared_memory());
        let tcp = Topology::new(&[7, 7], false);
        assert_eq!(tcp.link(0, 1), LinkClass::Network);
        assert!(!tcp.all_shared_memory());
        assert!(Topology::single_host(3).all_shared_memory());
        assert!(!Topology::single_host(1).all_shared_memory());
    }
}
