//! Many hosts on one machine, for real: every "node" is a network namespace with its own
//! address on a bridge, hostname and /dev/shm (bench/netns_nodes.sh), and Open MPI's mpirun
//! starts the ranks in them through an rsh agent (bench/netns_rsh.sh). The ranks run
//! `ciera perf --trace` on the bundled trace steps (raw and compressed, every bit checked):
//! the topology each job detects is printed and checked (hosts, ranks, shared memory within a
//! node, the hierarchical schedule), a rank killed on one node is reported by rank on every
//! other node, and the namespaces are gone afterwards. Needs root, ip, tc, unshare and mpirun
//! (`.ci/run` installs Open MPI); skips visibly without. Simulated hosts under `ciera launch`
//! (`CIERA_RANKS_PER_HOST`) need none of that.

#[path = "common/skip.rs"]
mod skip;
#[path = "c/support.rs"]
mod support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use support::*;

/// Namespaces are machine-wide: one test at a time uses them.
fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn script(name: &str) -> PathBuf {
    Path::new(MANIFEST_DIR).join("bench").join(name)
}

fn data() -> String {
    Path::new(MANIFEST_DIR)
        .join("tests/data/olmoe-slice")
        .display()
        .to_string()
}

/// Why namespaced nodes cannot run here, if they cannot.
fn cannot() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (network namespaces need it)".into());
    }
    for tool in ["ip", "tc", "unshare", "mpirun"] {
        if !have(tool) {
            return Some(format!(
                "no {tool} (.ci/run installs Open MPI; ip and tc are iproute2)"
            ));
        }
    }
    None
}

/// The nodes of bench/netns_nodes.sh, torn down when dropped (also after a failed test).
struct Nodes {
    n: usize,
    hostfile: PathBuf,
}

impl Nodes {
    fn up(n: usize, rate: Option<&str>) -> Nodes {
        let mut cmd = Command::new(script("netns_nodes.sh"));
        cmd.args(["up", &n.to_string()]);
        if let Some(r) = rate {
            cmd.arg(r);
        }
        let o = cmd.output().unwrap();
        assert_success("netns_nodes.sh up", &o);
        let hostfile = scratch("multinode").join("hostfile");
        let hosts: String = (0..n).map(|i| format!("ciera-node{i} slots=2\n")).collect();
        std::fs::write(&hostfile, hosts).unwrap();
        Nodes { n, hostfile }
    }

    /// `mpirun` of `ciera ARGS` with 2 ranks per node, rank 0 serving the root on node 0.
    fn mpirun(&self, args: &[&str], secret: &str) -> Command {
        let mut cmd = Command::new("mpirun");
        cmd.args(["--allow-run-as-root", "--oversubscribe", "--hostfile"])
            .arg(&self.hostfile)
            .args(["-np", &(2 * self.n).to_string(), "--mca", "plm_rsh_agent"])
            .arg(script("netns_rsh.sh"))
            .args(["--mca", "oob_tcp_if_include", "10.77.0.0/24"])
            .args(["--mca", "btl_tcp_if_include", "10.77.0.0/24"])
            // A rank that fails does not end the job at once: the others report first.
            .args(["--mca", "orte_abort_on_non_zero_status", "0"])
            .args(["-x", "CIERA_ROOT=10.77.0.1:29500"])
            .args(["-x", &format!("CIERA_SECRET={secret}")])
            .args(["-x", "CIERA_TIMEOUT=60"])
            .arg(env!("CARGO_BIN_EXE_ciera"))
            .args(args);
        cmd
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        let _ = Command::new(script("netns_nodes.sh")).arg("down").output();
    }
}

fn no_nodes_left() {
    let o = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let list = String::from_utf8_lossy(&o.stdout);
    assert!(!list.contains("ciera-node"), "namespaces left: {list}");
    let br = Command::new("ip")
        .args(["link", "show", "ciera-br0"])
        .output()
        .unwrap();
    assert!(!br.status.success(), "the bridge is still there");
}

fn secret() -> String {
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The topology line `ciera perf --trace` prints for `nodes` hosts of 2 ranks, gathering
/// [`SIZE`] with the hierarchical schedule.
fn topology_line(nodes: usize) -> String {
    let hosts: Vec<String> = (0..nodes)
        .map(|h| format!("host {h}: ranks {} {}", 2 * h, 2 * h + 1))
        .collect();
    format!(
        "# topology: {nodes} host(s) x 2 rank(s) ({}), shared memory within hosts; {} B per rank: hier",
        hosts.join("; "),
        SIZE_BYTES / (2 * nodes)
    )
}

/// Bytes gathered per call: whole bf16 elements per rank at 4 and 6 ranks.
const SIZE: &str = "384K";
const SIZE_BYTES: usize = 384 << 10;

const PERF: [&str; 12] = [
    "perf", "--trace", "", "-b", SIZE, "-e", SIZE, "-i", "2", "-w", "2", "--modes",
];

fn perf_args(data: &str, modes: &str) -> Vec<String> {
    let mut v: Vec<String> = PERF.iter().map(|s| s.to_string()).collect();
    v[2] = data.to_string();
    v.push(modes.into());
    v
}

/// Four windows of raw and compressed rows, every bit right, every compressed call framed.
fn check_rows(out: &str) {
    assert!(out.contains("# wrong elements: 0 OK"), "{out}");
    for mode in [" raw ", " delta-on "] {
        let rows: Vec<&str> = out.lines().filter(|l| l.contains(mode)).collect();
        assert_eq!(rows.len(), 4, "{mode}: {out}");
        assert!(rows.iter().all(|l| l.trim_end().ends_with(" 0")), "{out}");
        if mode == " delta-on " {
            assert!(rows.iter().all(|l| l.contains(" 2/2 ")), "{out}");
        }
    }
}

#[test]
fn mpirun_across_namespace_nodes_is_exact_and_sees_the_topology() {
    if let Some(why) = cannot() {
        return skip::skip(
            "mpirun_across_namespace_nodes_is_exact_and_sees_the_topology",
            &why,
        );
    }
    let _x = exclusive();
    let data = data();
    for n in [2, 3] {
        let nodes = Nodes::up(n, None);
        let args = perf_args(&data, "raw,delta-on");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = run_limited(nodes.mpirun(&args, &secret()), Duration::from_secs(300));
        let (out, err) = text(&o);
        assert!(o.status.success(), "{n} nodes:\n{out}\n{err}");
        assert!(
            out.contains(&topology_line(n)),
            "{n} nodes: topology:\n{out}"
        );
        check_rows(&out);
        skip::show(&format!("{n} nodes x 2 ranks under mpirun:\n{out}"));
        drop(nodes);
        no_nodes_left();
    }
}

#[test]
fn a_rank_killed_on_one_node_is_named_on_every_other_node() {
    if let Some(why) = cannot() {
        return skip::skip(
            "a_rank_killed_on_one_node_is_named_on_every_other_node",
            &why,
        );
    }
    let _x = exclusive();
    let nodes = Nodes::up(3, None);
    let secret = secret();
    let mut args = perf_args(&data(), "raw");
    args[8] = "100000".into(); // iterations: it runs until a rank is killed
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut child = nodes
        .mpirun(&args, &secret)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun");
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let stderr = child.stderr.take().unwrap();
    let (etx, erx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = etx.send(line);
        }
    });
    let mut err = String::new();
    let drain = |err: &mut String, wait: Duration| {
        while let Ok(l) = erx.recv_timeout(wait) {
            err.push_str(&l);
            err.push('\n');
        }
    };
    // Once the timed calls run, kill rank 3 (node 1), found by its environment.
    let started = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(l) if l.starts_with("#    window") => break,
            Ok(_) => {}
            Err(_) if started.elapsed() > Duration::from_secs(120) => {
                let _ = child.kill();
                drain(&mut err, Duration::from_secs(1));
                panic!("the job never started its timed calls:\n{err}");
            }
            Err(_) => {}
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let victim = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                let env = String::from_utf8_lossy(&env);
                env.contains(&format!("CIERA_SECRET={secret}"))
                    && env.split('\0').any(|v| v == "OMPI_COMM_WORLD_RANK=3")
            })
        })
        .expect("rank 3's process");
    // SAFETY: kill has no memory preconditions; the pid is rank 3 of this test's job.
    unsafe { libc::kill(victim, libc::SIGKILL) };
    // Every other rank, on every node, says that rank 3 stopped it.
    let wants: Vec<String> = [(0, 0), (1, 0), (2, 1), (4, 2), (5, 2)]
        .iter()
        .map(|(r, node)| {
            format!("ciera perf: rank {r} (on ciera-node{node}): stopped: rank 3 failed")
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(90);
    while Instant::now() < deadline && !wants.iter().all(|w| err.lines().any(|l| l.starts_with(w)))
    {
        drain(&mut err, Duration::from_millis(200));
    }
    // mpirun (told not to abort on a failed rank) may wait on; the nodes go either way.
    let _ = child.kill();
    let _ = child.wait();
    for w in &wants {
        assert!(err.lines().any(|l| l.starts_with(w)), "no \"{w}\":\n{err}");
    }
    skip::show(&format!("rank 3 killed on ciera-node1:\n{err}"));
    drop(nodes);
    no_nodes_left();
}

#[test]
fn ciera_launch_with_simulated_hosts_runs_the_hierarchical_schedule() {
    let args = perf_args(&data(), "raw,delta-on");
    let o = run_limited(
        {
            let mut c = Command::new(env!("CARGO_BIN_EXE_ciera"));
            c.args(["launch", "-n", "6", "--"])
                .arg(env!("CARGO_BIN_EXE_ciera"))
                .args(&args)
                .env("CIERA_RANKS_PER_HOST", "2")
                .env("CIERA_TIMEOUT", "60");
            c
        },
        Duration::from_secs(300),
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains(&topology_line(3)), "{out}");
    check_rows(&out);
}
