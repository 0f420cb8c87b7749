//! The layer rules of ARCHITECTURE.md, checked against the code:
//! - the `layers` block there lists, for every module of the `ciera` crate (and for the
//!   interposers), the modules it may use; the imports in the code must be exactly those
//!   (an arrow in the picture that the code lacks is as wrong as an import the picture lacks);
//! - the codec and the schedules are leaves of the data path: they may not use the transport,
//!   the engine, the communicator, the policy, the C ABI or the CLI, whatever the picture says;
//! - nothing but the `ciera` binary uses the CLI;
//! - the modules that need no `unsafe` forbid it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Names the crate root re-exports, and the module each stands for.
const ROOT_REEXPORTS: [(&str, &str); 4] = [
    ("DType", "dtype"),
    ("Error", "error"),
    ("Result", "error"),
    ("SharedBuffer", "mem"),
];

/// Modules that must say `#![forbid(unsafe_code)]`.
const NO_UNSAFE: [&str; 13] = [
    "algo",
    "cli",
    "coded_enum",
    "comm",
    "compress",
    "dtype",
    "engine",
    "error",
    "logging",
    "mem",
    "parse",
    "safetensors",
    "sim",
];

/// What the codec and the schedules may never use.
const NOT_FROM_LEAVES: [&str; 6] = ["transport", "engine", "comm", "compress", "capi", "cli"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without its comments (doc links are not imports).
fn code_of(p: &Path) -> String {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| match l.find("//") {
            // A `//` inside a string literal ("http://") would cut code short; none of the
            // paths this test looks for follow one on the same line.
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Identifiers following `prefix::` in `code`, including those inside `prefix::{a, b::c}`.
fn paths_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let pat = format!("{prefix}::");
    let mut rest = code;
    while let Some(i) = rest.find(&pat) {
        let before = rest[..i].chars().last();
        rest = &rest[i + pat.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // e.g. `xcrate::`
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

fn module_of_name(name: &str) -> String {
    ROOT_REEXPORTS
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(name, |(_, m)| m)
        .to_string()
}

/// Every module's uses of other modules, from the code.
fn actual_arrows() -> BTreeMap<String, BTreeSet<String>> {
    let mut arrows: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let src = Path::new(ROOT).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" {
            continue;
        }
        let code = code_of(f);
        let set = arrows.entry(module.clone()).or_default();
        // `ciera::` is how the binary (a separate crate) names the library.
        for name in paths_after(&code, "crate")
            .into_iter()
            .chain(paths_after(&code, "ciera"))
        {
            let m = module_of_name(&name);
            if m != module {
                set.insert(m);
            }
        }
        if code.contains("ciera_transport") {
            set.insert("transport".into());
        }
    }
    let mut files = Vec::new();
    for which in ["nccl", "mpi"] {
        rust_files(
            &Path::new(ROOT).join("interpose").join(which).join("src"),
            &mut files,
        );
    }
    let set = arrows.entry("interpose".into()).or_default();
    for f in &files {
        for name in paths_after(&code_of(f), "ciera") {
            set.insert(module_of_name(&name));
        }
    }
    arrows
}

/// The `layers` block of ARCHITECTURE.md: `module -> a, b` (or `-> nothing`) per line.
fn declared_arrows() -> BTreeMap<String, BTreeSet<String>> {
    let doc = std::fs::read_to_string(Path::new(ROOT).join("ARCHITECTURE.md")).unwrap();
    let start = doc
        .find("```layers\n")
        .expect("ARCHITECTURE.md has a ```layers block");
    let body = &doc[start + "```layers\n".len()..];
    let body = &body[..body.find("```").expect("the layers block ends")];
    let mut arrows = BTreeMap::new();
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (m, to) = line
            .split_once("->")
            .unwrap_or_else(|| panic!("layers line without '->': {line:?}"));
        let to = to.split('#').next().unwrap();
        let set: BTreeSet<String> = to
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty() && *t != "nothing")
            .map(String::from)
            .collect();
        assert!(
            arrows.insert(m.trim().to_string(), set).is_none(),
            "{m} twice in the layers block"
        );
    }
    arrows
}

#[test]
fn imports_are_exactly_the_arrows_of_architecture_md() {
    let actual = actual_arrows();
    let declared = declared_arrows();
    let mut wrong = Vec::new();
    for (m, uses) in &actual {
        let Some(allowed) = declared.get(m) else {
            wrong.push(format!("module {m} is missing from the layers block"));
            continue;
        };
        for u in uses.difference(allowed) {
            wrong.push(format!(
                "{m} uses {u}, which the layers block does not allow"
            ));
        }
        for u in allowed.difference(uses) {
            wrong.push(format!(
                "the layers block says {m} -> {u}, but {m} does not use {u}"
            ));
        }
    }
    for m in declared.keys().filter(|m| !actual.contains_key(*m)) {
        wrong.push(format!("the layers block names {m}, which is not a module"));
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

#[test]
fn the_codec_and_the_schedules_stay_leaves_and_only_the_binary_uses_the_cli() {
    let declared = declared_arrows();
    let actual = actual_arrows();
    for leaf in ["codec", "algo"] {
        for arrows in [&declared, &actual] {
            let uses = &arrows[leaf];
            for bad in NOT_FROM_LEAVES {
                assert!(!uses.contains(bad), "{leaf} must not use {bad}");
            }
        }
    }
    for (m, uses) in &actual {
        assert!(
            m == "bin" || !uses.contains("cli"),
            "{m} uses the CLI; only src/bin may"
        );
    }
}

#[test]
fn modules_without_unsafe_forbid_it() {
    for m in NO_UNSAFE {
        let dir = Path::new(ROOT).join("src").join(m);
        let file = if dir.is_dir() {
            dir.join("mod.rs")
        } else {
            dir.with_extension("rs")
        };
        let text = std::fs::read_to_string(&file).unwrap();
        let inner: Vec<&str> = text
            .lines()
            .map(str::trim)
            .take_while(|l| l.starts_with("//!") || l.starts_with("#![") || l.is_empty())
            .collect();
        assert!(
            inner.contains(&"#![forbid(unsafe_code)]"),
            "{} lacks #![forbid(unsafe_code)] among its inner attributes",
            file.display()
        );
    }
}

#[test]
fn the_path_scanner_reads_groups_and_skips_lookalikes() {
    let code = "use crate::{algo::Topology, engine, DType};\nlet x = crate::mem::Location::Host;\nnotcrate::y;";
    let got = paths_after(code, "crate");
    let want: BTreeSet<String> = ["algo", "engine", "DType", "mem"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(got, want);
}
