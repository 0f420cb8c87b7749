//! The C ABI of libciera.so from C: the header's layout against src/capi.rs, the exported
//! symbols, and a C program (tests/c/ciera_app.c) run as 2, 3 and 4 ranks by `ciera launch`.

#[path = "c/support.rs"]
mod support;

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ciera::capi::ResultCode;
use ciera::capi::{self, CConfig, CStats, CUniqueId};
use ciera::DType;
use support::*;

fn include_dir() -> PathBuf {
    Path::new(MANIFEST_DIR).join("include")
}

#[test]
fn header_matches_the_rust_side() {
    let dir = scratch("layout");
    let exe = dir.join("layout");
    cc(
        &exe,
        &[c_dir().join("layout.c")],
        &[format!("-I{}", include_dir().display())],
    );
    let o = Command::new(&exe).output().unwrap();
    assert_success("layout", &o);
    let printed: BTreeMap<String, i64> = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect();

    let mut want: BTreeMap<String, i64> = BTreeMap::new();
    let mut put = |k: &str, v: i64| {
        want.insert(k.to_string(), v);
    };
    put("CIERA_VERSION_CODE", capi::VERSION_CODE as i64);
    put("CIERA_API_MAGIC", capi::API_MAGIC as i64);
    put("CIERA_CONFIG_UNDEF_INT", capi::CONFIG_UNDEF_INT as i64);
    put("CIERA_UNIQUE_ID_BYTES", capi::UNIQUE_ID_BYTES as i64);
    for (name, code) in [
        ("cieraSuccess", ResultCode::Success),
        ("cieraUnhandledCudaError", ResultCode::UnhandledCudaError),
        ("cieraSystemError", ResultCode::SystemError),
        ("cieraInternalError", ResultCode::InternalError),
        ("cieraInvalidArgument", ResultCode::InvalidArgument),
        ("cieraInvalidUsage", ResultCode::InvalidUsage),
        ("cieraRemoteError", ResultCode::RemoteError),
        ("cieraInProgress", ResultCode::InProgress),
    ] {
        put(name, code as i64);
    }
    put("cieraNumResults", 8);
    for (names, d) in [
        (&["cieraInt8", "cieraChar"][..], DType::I8),
        (&["cieraUint8"], DType::U8),
        (&["cieraInt32", "cieraInt"], DType::I32),
        (&["cieraUint32"], DType::U32),
        (&["cieraInt64"], DType::I64),
        (&["cieraUint64"], DType::U64),
        (&["cieraFloat16", "cieraHalf"], DType::F16),
        (&["cieraFloat32", "cieraFloat"], DType::F32),
        (&["cieraFloat64", "cieraDouble"], DType::F64),
        (&["cieraBfloat16"], DType::BF16),
        (&["cieraFloat8e4m3"], DType::F8E4M3),
        (&["cieraFloat8e5m2"], DType::F8E5M2),
    ] {
        for n in names {
            put(n, d.code() as i64);
        }
    }
    put("cieraNumTypes", DType::ALL.len() as i64);
    put("cieraCompressionAuto", capi::COMPRESSION_AUTO as i64);
    put("cieraCompressionOn", capi::COMPRESSION_ON as i64);
    put("cieraCompressionOff", capi::COMPRESSION_OFF as i64);
    put("cieraCompressionUnset", capi::CONFIG_UNDEF_INT as i64);
    put("cieraTransportAuto", capi::TRANSPORT_AUTO as i64);
    put("cieraTransportShm", capi::TRANSPORT_SHM as i64);
    put("cieraTransportTcp", capi::TRANSPORT_TCP as i64);
    put("cieraTransportUnset", capi::CONFIG_UNDEF_INT as i64);
    put("sizeof(cieraUniqueId)", size_of::<CUniqueId>() as i64);
    put(
        "sizeof(cieraComm_t)",
        size_of::<*mut std::ffi::c_void>() as i64,
    );
    put("sizeof(cieraResult_t)", size_of::<std::ffi::c_int>() as i64);
    put(
        "sizeof(cieraDataType_t)",
        size_of::<std::ffi::c_int>() as i64,
    );
    put("sizeof(cieraConfig_t)", size_of::<CConfig>() as i64);
    for (f, o) in [
        ("size", offset_of!(CConfig, size)),
        ("magic", offset_of!(CConfig, magic)),
        ("version", offset_of!(CConfig, version)),
        ("timeoutMs", offset_of!(CConfig, timeout_ms)),
        ("compression", offset_of!(CConfig, compression)),
        ("cacheBudgetMB", offset_of!(CConfig, cache_budget_mb)),
        ("transport", offset_of!(CConfig, transport)),
        ("verify", offset_of!(CConfig, verify)),
    ] {
        put(&format!("offsetof(cieraConfig_t,{f})"), o as i64);
    }
    put("sizeof(cieraStats_t)", size_of::<CStats>() as i64);
    for (f, o) in [
        ("size", offset_of!(CStats, size)),
        ("magic", offset_of!(CStats, magic)),
        ("version", offset_of!(CStats, version)),
        ("calls", offset_of!(CStats, calls)),
        ("inPlaceCalls", offset_of!(CStats, in_place_calls)),
        ("failedCalls", offset_of!(CStats, failed_calls)),
        ("rawCalls", offset_of!(CStats, raw_calls)),
        ("fillCalls", offset_of!(CStats, fill_calls)),
        ("deltaCalls", offset_of!(CStats, delta_calls)),
        ("repairs", offset_of!(CStats, repairs)),
        ("rawBytes", offset_of!(CStats, raw_bytes)),
        ("wireBytes", offset_of!(CStats, wire_bytes)),
        ("cacheBytes", offset_of!(CStats, cache_bytes)),
        ("encodeNs", offset_of!(CStats, encode_ns)),
        ("decodeNs", offset_of!(CStats, decode_ns)),
        ("misses", offset_of!(CStats, misses)),
    ] {
        put(&format!("offsetof(cieraStats_t,{f})"), o as i64);
    }
    put("initializer.version", capi::CONFIG_VERSION as i64);
    put("initializer.size", size_of::<CConfig>() as i64);
    put("initializer.timeoutMs", capi::CONFIG_UNDEF_INT as i64);
    put("initializer.verify", capi::CONFIG_UNDEF_INT as i64);
    put("stats_initializer.version", capi::STATS_VERSION as i64);
    assert_eq!(
        printed, want,
        "include/ciera.h (left) and src/capi.rs (right) disagree"
    );
}

#[test]
fn libciera_exports_exactly_the_c_api() {
    build_libs(&["ciera"]);
    let syms = exported_symbols(&lib_path("libciera.so"));
    let mut want = vec![
        "cieraAllGather",
        "cieraAllGatherKeyed",
        "cieraCommAbort",
        "cieraCommCount",
        "cieraCommDestroy",
        "cieraCommGetAsyncError",
        "cieraCommGetStats",
        "cieraCommInitFromEnv",
        "cieraCommInitRank",
        "cieraCommInitRankConfig",
        "cieraCommUserRank",
        "cieraGetErrorString",
        "cieraGetLastError",
        "cieraGetUniqueId",
        "cieraGetVersion",
        "cieraMemAlloc",
        "cieraMemFree",
    ];
    want.sort();
    assert_eq!(syms, want);
    // Every function the header declares is exported, and nothing else.
    let header = std::fs::read_to_string(include_dir().join("ciera.h")).unwrap();
    let mut declared: Vec<&str> = header
        .lines()
        .filter(|l| l.starts_with("cieraResult_t ciera") || l.starts_with("const char* ciera"))
        .map(|l| l.split('(').next().unwrap().rsplit(' ').next().unwrap())
        .collect();
    declared.sort();
    assert_eq!(declared, want);
}

#[test]
fn device_memory_is_seen_when_the_driver_is_loaded_late() {
    // The "driver" checks are cached while no new library is loaded; loading one (here a fake
    // libcuda.so.1) must make the next call ask again.
    build_libs(&["ciera"]);
    let dir = scratch("late_cuda");
    let fake = dir.join("libcuda.so.1");
    cc(
        &fake,
        &[c_dir().join("fake_cuda.c")],
        &[
            "-shared".into(),
            "-fPIC".into(),
            "-Wl,-soname,libcuda.so.1".into(),
        ],
    );
    let exe = dir.join("late_cuda");
    cc_with_libciera(&exe, "late_cuda.c", &["-ldl"]);
    let mut cmd = Command::new(&exe);
    cmd.arg(&fake);
    for k in [
        "CIERA_ROOT",
        "CIERA_RANK",
        "CIERA_NRANKS",
        "OMPI_COMM_WORLD_SIZE",
        "RANK",
    ] {
        cmd.env_remove(k);
    }
    let o = run_limited(cmd, Duration::from_secs(60));
    assert_success("late_cuda", &o);
    assert!(text(&o).0.contains("late_cuda: OK"), "{:?}", text(&o));
}

/// Compiles tests/c/`src` into `exe` against include/ciera.h and the built libciera.so, with
/// `extra` linker arguments.
fn cc_with_libciera(exe: &Path, src: &str, extra: &[&str]) {
    let lib_dir = profile_dir();
    let mut args = vec![
        format!("-I{}", include_dir().display()),
        format!("-I{}", c_dir().display()),
        format!("-L{}", lib_dir.display()),
        "-lciera".into(),
        format!("-Wl,-rpath,{}", lib_dir.display()),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    cc(exe, &[c_dir().join(src)], &args);
}

/// Compiles ciera_app.c against include/ciera.h and the built libciera.so.
fn build_app() -> PathBuf {
    build_libs(&["ciera"]);
    let exe = scratch("ciera_app").join("ciera_app");
    cc_with_libciera(&exe, "ciera_app.c", &["-lm"]);
    exe
}

fn launch(n: usize, args: &[String], env: &[(&str, &str)]) -> (String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ciera"));
    cmd.args(["launch", "-n", &n.to_string(), "--"]).args(args);
    cmd.env("CIERA_TIMEOUT", "60");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = run_limited(cmd, Duration::from_secs(180));
    assert_success(&format!("ciera launch -n {n} {args:?} with {env:?}"), &o);
    text(&o)
}

#[test]
fn c_program_gathers_exact_bytes_and_reports_bad_calls() {
    let exe = build_app().display().to_string();
    let olmoe = Path::new(MANIFEST_DIR)
        .join("tests/data/olmoe-slice")
        .display()
        .to_string();
    let scratch = scratch("ciera_app_ids");
    for n in 2..=4 {
        // From the launcher's environment; compression from CIERA_COMPRESS (forced on, so the
        // app can require delta calls, except with 3 ranks: auto, whose choices depend on
        // timing).
        let env_mode: &[(&str, &str)] = if n == 3 {
            &[]
        } else {
            &[("CIERA_COMPRESS", "on"), ("CIERA_APP_EXPECT_DELTAS", "1")]
        };
        let (out_env, _) = launch(
            n,
            &[exe.clone(), "env".into(), "60".into(), olmoe.clone()],
            env_mode,
        );
        // From a unique id that rank 0 makes and hands out (through a file here), with a
        // cieraConfig_t asking for compression: it overrides CIERA_COMPRESS=off.
        let id_file = scratch.join(format!("id-{n}")).display().to_string();
        let (out_id, _) = launch(
            n,
            &[exe.clone(), "id".into(), id_file, "60".into()],
            &[("CIERA_COMPRESS", "off"), ("CIERA_APP_EXPECT_DELTAS", "1")],
        );
        // Buffers from cieraMemAlloc, raw gathers (compression off): peers copy straight
        // out of each other's buffers; the app checks every element as before.
        let (out_shared, _) = launch(
            n,
            &[exe.clone(), "env".into(), "60".into()],
            &[("CIERA_COMPRESS", "off"), ("CIERA_APP_SHARED", "1")],
        );
        for (mode, out) in [("env", &out_env), ("id", &out_id), ("shared", &out_shared)] {
            for r in 0..n {
                let line = out
                    .lines()
                    .find(|l| l.starts_with(&format!("ciera_app rank {r}: OK")))
                    .unwrap_or_else(|| panic!("n={n} {mode}: no OK line from rank {r}:\n{out}"));
                assert!(line.contains("60 iterations"), "{line}");
                if mode == "env" {
                    assert!(line.contains("12 olmoe files"), "{line}");
                }
            }
            eprintln!("n={n} {mode}:\n{out}");
        }
    }
}
