//! Every kernel file in cuda/ compiles with NVRTC, with no GPU: for sm_80, sm_90 and the newest
//! architecture NVRTC knows, each `cuda/*.cu` is compiled to a cubin, every `extern "C"
//! __global__` function its text defines must be an entry point of that cubin with a register
//! count, ptxas's report must agree with the cubin, and a table of registers, spills, shared
//! and local memory per file, architecture and kernel shows in the normal test output.
//!
//! NVRTC is found as `ciera::gpu::nvrtc` says (CIERA_NVRTC_LIB, the loader's path, the
//! `nvidia-cuda-nvrtc` wheel in CIERA_VENV or .venv). Without it the test prints a SKIPPED
//! line, unless CIERA_REQUIRE_NVRTC=1 (CI sets it), where it fails naming what was searched.
//! CIERA_CUDA_DIR compiles another directory's `.cu` files instead of cuda/.

#[path = "common/skip.rs"]
mod skip;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ciera::gpu::nvrtc::{self, Arch, Compiled, NvrtcError};

/// The architectures compiled besides the newest NVRTC supports: A100 and H100.
const ARCHS: [u32; 2] = [80, 90];

#[test]
fn every_kernel_file_compiles() {
    const TEST: &str = "every_kernel_file_compiles";
    let required = std::env::var_os("CIERA_REQUIRE_NVRTC").is_some_and(|v| v == "1");
    let (library, supported) =
        match nvrtc::library().and_then(|l| Ok((l, nvrtc::supported_archs()?))) {
            Ok(found) => found,
            Err(e) if required => panic!("CIERA_REQUIRE_NVRTC=1 but NVRTC is not usable: {e}"),
            Err(e) => {
                skip::skip(TEST, &format!("{e}").replace('\n', " "));
                return;
            }
        };
    let dir = std::env::var_os("CIERA_CUDA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda"));
    let files = kernel_files(&dir);
    if files.is_empty() {
        skip::skip(TEST, &format!("no .cu files in {}", dir.display()));
        return;
    }
    let newest = *supported.last().expect("NVRTC supports no architecture");
    let mut archs: Vec<u32> = ARCHS
        .iter()
        .copied()
        .filter(|a| supported.contains(a))
        .collect();
    archs.push(newest);
    archs.dedup();

    // Every (file, architecture) compiles on a thread of its own: the compile cache lets
    // different ones run in parallel.
    let sources: Vec<(String, String)> = files
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let text =
                std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (name, text)
        })
        .collect();
    let results: Vec<(usize, Arch, Result<Arc<Compiled>, NvrtcError>)> = std::thread::scope(|s| {
        let jobs: Vec<_> = sources
            .iter()
            .enumerate()
            .flat_map(|(i, (name, text))| archs.iter().map(move |&a| (i, name, text, Arch::sm(a))))
            .map(|(i, name, text, arch)| {
                (
                    i,
                    arch,
                    s.spawn(move || nvrtc::compile_fresh(text, name, arch).map(Arc::new)),
                )
            })
            .collect();
        jobs.into_iter()
            .map(|(i, arch, h)| (i, arch, h.join().unwrap()))
            .collect()
    });

    let mut table = format!(
        "NVRTC {}.{} from {}{}; kernels of {} (spilling kernels marked)\n",
        library.version.0,
        library.version.1,
        library.path.display(),
        builtins_mapped().map_or(String::new(), |b| format!(", builtins {}", b.display())),
        dir.display(),
    );
    let _ = writeln!(
        table,
        "  {:<20} {:<7} {:<32} {:>5} {:>4} {:>10} {:>10} {:>8} {:>8}",
        "file", "arch", "kernel", "regs", "bar", "spill st B", "spill ld B", "smem B", "local B"
    );
    let mut failures = Vec::new();
    for (i, arch, result) in &results {
        let (file, text) = &sources[*i];
        let compiled = match result {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("{file} for {arch}: {e}"));
                continue;
            }
        };
        let mut kernels: Vec<_> = compiled.kernels.iter().collect();
        kernels.sort_by(|a, b| a.name.cmp(&b.name));
        for k in kernels {
            let _ = writeln!(
                table,
                "  {:<20} {:<7} {:<32} {:>5} {:>4} {:>10} {:>10} {:>8} {:>8}{}",
                file,
                arch.to_string(),
                k.name,
                k.registers,
                k.barriers,
                k.spill_stores,
                k.spill_loads,
                k.shared_bytes,
                k.local_bytes,
                if k.spills() { "  SPILLS" } else { "" }
            );
        }
        failures.extend(
            check_kernels(text, compiled)
                .into_iter()
                .map(|f| format!("{file} for {arch}: {f}")),
        );
    }
    skip::show(&table);
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
}

/// What is wrong with the kernels `source` defines in its cubin: one that is missing, has no
/// register count, or whose count ptxas's report contradicts.
fn check_kernels(source: &str, compiled: &Compiled) -> Vec<String> {
    let mut failures = Vec::new();
    for pattern in kernel_names(source) {
        let entries: Vec<_> = (compiled.entries.iter())
            .filter(|e| pattern.matches(&e.name))
            .collect();
        if entries.is_empty() {
            failures.push(format!("kernel {pattern} is not in the cubin"));
        }
        for entry in entries {
            let name = &entry.name;
            match (entry.registers, compiled.kernel(name)) {
                (None | Some(0), _) => failures.push(format!(
                    "{name} has no register count in the cubin ({:?})",
                    entry.registers
                )),
                (_, None) => failures.push(format!(
                    "ptxas did not report on {name}; log:\n{}",
                    compiled.log
                )),
                (Some(r), Some(k)) if r != k.registers => failures.push(format!(
                    "{name}: {r} registers in the cubin, {} in ptxas's report",
                    k.registers
                )),
                _ => {}
            }
        }
    }
    failures
}

/// The `.cu` files of `dir`, sorted; none if it does not exist.
fn kernel_files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu") && p.is_file())
        .collect();
    out.sort();
    out
}

/// Where the process mapped `libnvrtc-builtins` from, once NVRTC has compiled something.
fn builtins_mapped() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("libnvrtc-builtins"))
        .map(PathBuf::from)
}

/// The name of a kernel as its definition spells it: literal text, or inside a macro body
/// (`ciera_enc_tile_##name`) literal pieces and the macro's parameters, which match anything.
#[derive(Clone, Debug, PartialEq, Eq)]
struct KernelName(Vec<Option<String>>);

impl KernelName {
    fn literal(name: &str) -> KernelName {
        KernelName(vec![Some(name.to_string())])
    }

    fn matches(&self, name: &str) -> bool {
        fn go(pieces: &[Option<String>], s: &str) -> bool {
            match pieces.split_first() {
                None => s.is_empty(),
                Some((Some(lit), rest)) => {
                    s.strip_prefix(lit.as_str()).is_some_and(|r| go(rest, r))
                }
                Some((None, rest)) => {
                    (1..=s.len()).any(|i| s.is_char_boundary(i) && go(rest, &s[i..]))
                }
            }
        }
        go(&self.0, name)
    }
}

impl std::fmt::Display for KernelName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for p in &self.0 {
            f.write_str(p.as_deref().unwrap_or("*"))?;
        }
        Ok(())
    }
}

/// The `extern "C" __global__` functions `source` defines (not those it only declares), in
/// order, comments skipped. Attributes between `__global__` and the name (`void
/// __launch_bounds__(256, 2) name(...)`) are stepped over. In a `#define`'s body, the
/// macro's parameters in the name (`ciera_enc_tile_##name`) become wildcards: what the
/// macro is expanded with is not read.
fn kernel_names(source: &str) -> Vec<KernelName> {
    const ATTRIBUTES: [&str; 5] = [
        "__launch_bounds__",
        "__attribute__",
        "__maxnreg__",
        "__cluster_dims__",
        "__align__",
    ];
    let code = without_comments(source);
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("__global__").map(|i| from + i) {
        from = at + "__global__".len();
        // The declaration's start: after the last `;`, `{` or `}` before it.
        let start = code[..at].rfind([';', '{', '}']).map_or(0, |i| i + 1);
        let declaration: String = code[start..at]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        if !declaration.contains("extern \"C\"") {
            continue;
        }
        let params = macro_parameters(&code, at);
        let mut i = from;
        // The identifiers of the name so far, joined by `##`.
        let mut name: Vec<String> = Vec::new();
        let mut pasting = false;
        while i < b.len() {
            let c = b[i] as char;
            if c.is_ascii_alphanumeric() || c == '_' {
                let s = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                if !pasting {
                    name.clear();
                }
                name.push(code[s..i].to_string());
                pasting = false;
                continue;
            }
            if code[i..].starts_with("##") {
                pasting = true;
                i += 2;
                continue;
            }
            if c == '(' {
                let close = matching_paren(b, i);
                if name.len() == 1 && ATTRIBUTES.contains(&name[0].as_str()) {
                    i = close + 1;
                    name.clear();
                    continue;
                }
                let after = code[(close + 1).min(code.len())..].trim_start();
                if after.starts_with('{') && !name.is_empty() {
                    out.push(KernelName(
                        name.iter()
                            .map(|t| (!params.contains(t)).then(|| t.clone()))
                            .collect(),
                    ));
                }
                break;
            }
            if c == ';' || c == '{' {
                break;
            }
            i += 1;
        }
    }
    out
}

/// The parameters of the `#define NAME(a, b)` whose body (continued with `\`) holds `at`;
/// none outside a macro.
fn macro_parameters(code: &str, at: usize) -> Vec<String> {
    let mut line_start = code[..at].rfind('\n').map_or(0, |i| i + 1);
    loop {
        let line = code[line_start..].lines().next().unwrap_or("").trim_start();
        if let Some(rest) = line.strip_prefix('#').map(str::trim_start) {
            let Some(rest) = rest.strip_prefix("define") else {
                return Vec::new();
            };
            let head = rest.trim_start();
            let name_end = head
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(head.len());
            let Some(list) = head[name_end..].strip_prefix('(') else {
                return Vec::new();
            };
            let list = list.split(')').next().unwrap_or("");
            return list.split(',').map(|p| p.trim().to_string()).collect();
        }
        // Go up one line only if that line continues into this one.
        if line_start == 0 {
            return Vec::new();
        }
        let prev_start = code[..line_start - 1].rfind('\n').map_or(0, |i| i + 1);
        if !code[prev_start..line_start - 1].trim_end().ends_with('\\') {
            return Vec::new();
        }
        line_start = prev_start;
    }
}

/// The index of the `)` that closes the `(` at `open` (the end of `b` if none does).
fn matching_paren(b: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    for (i, &c) in b.iter().enumerate().skip(open) {
        match c {
            b'(' => depth += 1,
            b')' => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    b.len()
}

/// `source` with `//` and `/* */` comments blanked (string and character literals kept).
fn without_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut chars = source.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if prev == '*' && c == '/' {
                        break;
                    }
                    prev = c;
                }
                out.push(' ');
            }
            '"' | '\'' => {
                out.push(c);
                let mut escaped = false;
                for d in chars.by_ref() {
                    out.push(d);
                    if escaped {
                        escaped = false;
                    } else if d == '\\' {
                        escaped = true;
                    } else if d == c {
                        break;
                    }
                }
            }
            _ => out.push(c),
        }
    }
    out
}

#[test]
fn kernel_names_are_read_from_definitions_only() {
    let src = r#"
        // extern "C" __global__ void in_a_comment(int) {}
        /* extern "C" __global__ void in_a_block_comment(int) {} */
        const char* s = "extern \"C\" __global__ void in_a_string() {}";
        __global__ void not_extern_c(int x) {}
        extern "C" __global__ void declared(int);
        extern "C" __global__ void __launch_bounds__(256, 2)
            bounded(const unsigned* __restrict__ in, int n) { if (n) {} }
        extern "C" {
            __global__ void in_a_block(int x) {}
        }
        extern "C"
        __global__
        void split_over_lines(int (*f)(int)) {}
        #define KERNELS(name, T) \\
            extern "C" __global__ void __launch_bounds__(NT) enc_##name(const T* p) { \\
                body<T>(p);                                                          \\
            }                                                                        \\
            extern "C" __global__ void name##_dec_##T(T* p) { body<T>(p); }
        KERNELS(bf16, Bf16)
    "#;
    let names = kernel_names(src);
    let shown: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    assert_eq!(shown, ["bounded", "split_over_lines", "enc_*", "*_dec_*"]);
    assert_eq!(names[0], KernelName::literal("bounded"));
    assert!(names[0].matches("bounded") && !names[0].matches("bounded2"));
    assert!(
        names[2].matches("enc_bf16") && !names[2].matches("enc_") && !names[2].matches("dec_bf16")
    );
    assert!(names[3].matches("bf16_dec_Bf16") && !names[3].matches("bf16_enc_Bf16"));
}
