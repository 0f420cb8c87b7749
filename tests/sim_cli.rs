//! `ciera sim` end to end: the projection on the bundled trace slice (ratios measured on it,
//! every GPU count and method present, the SVG written), the validation table on measured rows
//! whose prediction is known in closed form, and clear errors for bad input.

use std::path::{Path, PathBuf};
use std::process::Command;

fn ciera() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ciera"));
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

fn slice() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/olmoe-slice")
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ciera-sim-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = ciera().arg("sim").args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every GPU count x method gets a row; one node gains nothing from inter-node compression;
/// on a slow network the Delta cache's Allgather speedup follows its measured ratio; the
/// block scheme (ratio 1.00 at these steps) never beats raw; the SVG names every series.
#[test]
fn projection_on_the_bundled_slice() {
    let d = tmpdir("proj");
    let svg = d.join("p.svg");
    let (ok, out, err) = run(&[
        "--trace",
        slice().to_str().unwrap(),
        "--cluster",
        "h100-eth100",
        "--gpus",
        "8,16,64",
        "--json",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(rows.len(), 3 * 7, "{out}");
    let get = |gpus: u64, m: &str| {
        rows.iter()
            .find(|r| r["gpus"] == gpus && r["method"] == m)
            .unwrap_or_else(|| panic!("no row {gpus} {m}"))
    };
    for m in [
        "raw",
        "ciera-exp",
        "ciera-full",
        "ciera-delta",
        "block512",
        "dietgpu",
    ] {
        assert_eq!(get(8, m)["allgather_speedup"].as_f64(), Some(1.0), "{m}");
        assert_eq!(get(64, "block512")["allgather_speedup"].as_f64(), Some(1.0));
    }
    let delta = get(64, "ciera-delta")["allgather_speedup"]
        .as_f64()
        .unwrap();
    let exp = get(64, "ciera-exp")["allgather_speedup"].as_f64().unwrap();
    assert!(delta > 2.0 * exp && exp > 1.5, "delta {delta} exp {exp}");
    let it = get(64, "ciera-delta")["iteration_speedup"]
        .as_f64()
        .unwrap();
    assert!(
        it > 1.0 && it < delta,
        "iteration {it} vs Allgather {delta}"
    );
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("ciera-delta (Allgather)"));
    assert!(svg.contains("GPU codec throughput ASSUMED"));
}

/// Measured rows whose prediction is closed-form: raw on the shaped loopback is (N-1) x S over
/// the link's TCP goodput plus one latency per step. The table prints the measured and the
/// predicted time and the error, and counts the rows within 10%.
#[test]
fn validation_table_on_known_rows() {
    let d = tmpdir("val");
    let trace = slice();
    let rows = [(2, 4 << 20, 30.0), (4, 16 << 20, 406.4)];
    let mut text = String::from("# not a row\n");
    for (n, size, ms) in rows {
        text += &serde_json::json!({
            "nodes": 1, "ranks_per_node": n, "algo": "ring", "rate_gbit": 1.0, "size": size,
            "mode": "raw", "window": "100-102", "trace": trace, "time_us": ms * 1e3,
            "wire_ratio": 1.0, "wrong": 0,
        })
        .to_string();
        text += "\n";
    }
    std::fs::write(d.join("runs.jsonl"), text).unwrap();
    // Moving a TCP byte costs 1 ns a side: far below the 1 Gbit/s link, so the link binds.
    std::fs::write(
        d.join("probe.json"),
        r#"{"loopback_tcp_bps": 1e9, "veth_tcp_bps": 1e9}"#,
    )
    .unwrap();
    let (ok, out, err) = run(&["--validate", d.to_str().unwrap(), "--cores", "2"]);
    assert!(ok, "{err}");
    let goodput = 125e6 * 8948.0 / 9014.0;
    for (n, size, ms) in rows {
        let want = ((n - 1) as f64 * size as f64 / goodput + (n - 1) as f64 * 50e-6) * 1e3;
        let err_pct = (want - ms) / ms * 100.0;
        let line = out
            .lines()
            .find(|l| l.contains(&format!("{}M", size >> 20)) && l.contains("raw"))
            .unwrap_or_else(|| panic!("no row for {size}:\n{out}"));
        assert!(
            line.contains(&format!("{ms:.1}ms")) && line.contains(&format!("{want:.1}ms")),
            "{line} (want {want:.1})"
        );
        assert!(line.contains(&format!("{err_pct:+.1}%")), "{line}");
    }
    // 2 ranks 4M: 33.8 ms predicted vs 30.0 (+12.7%); 4 ranks 16M: 405.4 vs 406.4.
    assert!(
        out.contains("# 1/2 rows within 10%; link-bound rows"),
        "{out}"
    );
    assert!(out.contains("host-CPU-bound rows: 0/0"), "{out}");
    // A probe of the loopback shaped to 1 Gbit/s that found 20 ns of busy cores per byte (10 a
    // side, more than the link's 8 ns) makes the same rows host-CPU-bound and counted apart.
    std::fs::write(
        d.join("probe.json"),
        r#"{"loopback_tcp_bps": 1e9, "veth_tcp_bps": 1e9,
            "shaped": [{"link": "loopback", "rate_gbit": 1.0, "cpu_s_per_byte": 2e-8}]}"#,
    )
    .unwrap();
    let (ok, out, err) = run(&["--validate", d.to_str().unwrap(), "--cores", "2"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("# a TCP byte on the loopback shaped to 1 Gbit/s costs the cores 20.00 ns"),
        "{out}"
    );
    assert!(out.contains("link-bound rows (cpu < 0.75): 0/0"), "{out}");
    assert!(out.contains("host-CPU-bound rows: "), "{out}");
    assert!(!out.contains("host-CPU-bound rows: 0/0"), "{out}");
    // A shaped entry that is not whole is named.
    std::fs::write(
        d.join("probe.json"),
        r#"{"loopback_tcp_bps": 1e9, "veth_tcp_bps": 1e9,
            "shaped": [{"link": "loopback", "rate_gbit": 1.0}]}"#,
    )
    .unwrap();
    let (ok, _, err) = run(&["--validate", d.to_str().unwrap()]);
    assert!(
        !ok && err.contains("shaped[0]") && err.contains("cpu_s_per_byte"),
        "{err}"
    );
}

#[test]
fn bad_input_is_named() {
    let (ok, _, err) = run(&["--model", "gpt-9"]);
    assert!(!ok);
    assert!(
        err.contains("--model \"gpt-9\"") && err.contains("olmoe-1b-7b"),
        "{err}"
    );
    let (ok, _, err) = run(&["--cluster", "tpu"]);
    assert!(
        !ok && err.contains("--cluster \"tpu\"") && err.contains("h100-ib400"),
        "{err}"
    );
    let (ok, _, err) = run(&["--gpus", "8,x"]);
    assert!(!ok && err.contains("--gpus: \"x\""), "{err}");
    let (ok, _, err) = run(&["--gpus", "12", "--trace", slice().to_str().unwrap()]);
    assert!(!ok && err.contains("not a multiple of 8"), "{err}");
    let (ok, _, err) = run(&["--mfu", "2"]);
    assert!(!ok && err.contains("--mfu"), "{err}");
    let d = tmpdir("bad");
    let (ok, _, err) = run(&["--validate", d.to_str().unwrap()]);
    assert!(!ok && err.contains("runs.jsonl"), "{err}");
    std::fs::write(
        d.join("probe.json"),
        r#"{"loopback_tcp_bps": 1e9, "veth_tcp_bps": 1e9}"#,
    )
    .unwrap();
    std::fs::write(d.join("runs.jsonl"), "{\"nodes\": 1}\n").unwrap();
    let (ok, _, err) = run(&["--validate", d.to_str().unwrap()]);
    assert!(
        !ok && err.contains("runs.jsonl:1") && err.contains("ranks_per_node"),
        "{err}"
    );
    let row = serde_json::json!({
        "nodes": 1, "ranks_per_node": 2, "algo": "ring", "rate_gbit": 1.0, "size": 1024,
        "mode": "raw", "window": "100-102", "trace": slice(), "time_us": 100.0,
        "wire_ratio": 1.0, "wrong": 0,
    });
    std::fs::write(d.join("runs.jsonl"), format!("{row}\n")).unwrap();
    std::fs::write(d.join("probe.json"), r#"{"loopback_tcp_bps": 1e9}"#).unwrap();
    let (ok, _, err) = run(&["--validate", d.to_str().unwrap()]);
    assert!(
        !ok && err.contains("probe.json") && err.contains("veth_tcp_bps"),
        "{err}"
    );
    let m = d.join("model.txt");
    std::fs::write(&m, "preset = olmoe\nlayerz = 3\n").unwrap();
    let (ok, _, err) = run(&["--model", m.to_str().unwrap()]);
    assert!(
        !ok && err.contains("layerz") && err.contains("line 2"),
        "{err}"
    );
}
