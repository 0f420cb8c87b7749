//! NVRTC, CUDA's run-time compiler, loaded when first asked for: the kernels in cuda/ are
//! compiled to a cubin for the GPU at hand when they are first needed, so the crate builds, and
//! everything but the GPU path runs, with no CUDA installed. Calls go through cudarc's NVRTC
//! bindings, whose library is loaded by name; cudarc panics when it finds none, so this module
//! finds and loads the library first and answers [`NvrtcError::NotFound`] instead.
//!
//! Where `libnvrtc.so.13` is looked for, in order (the first that exists is loaded with
//! `RTLD_NOW | RTLD_GLOBAL` and kept for the process's life; cudarc's own by-name load then
//! finds that object, which is checked):
//!
//! 1. `CIERA_NVRTC_LIB`: a path to the library file. If it is set and cannot be loaded, that
//!    is the error; nothing else is tried.
//! 2. The dynamic loader's search (`LD_LIBRARY_PATH`, ld.so.cache): a CUDA toolkit install.
//! 3. The PyPI wheel `nvidia-cuda-nvrtc` (13.x) in a Python virtual environment: `CIERA_VENV`,
//!    else `.venv` in this repository (where `.ci/run` installs it), searched as
//!    `lib/python3*/site-packages/nvidia/**/lib/libnvrtc.so.13*` (the 13.x wheels put it in
//!    `nvidia/cu13/lib`, older ones in `nvidia/cuda_nvrtc/lib`).
//!
//! NVRTC loads `libnvrtc-builtins.so.13.*` from its own directory, wherever that is, so no
//! library path needs setting. Only NVRTC 13 is accepted (cudarc's bindings are built for
//! CUDA 13.0's ABI).
//!
//! [`compile`] makes a cubin for one real architecture with the options every kernel file is
//! written for: `-std=c++17 -default-device -DCIERA_DEVICE=1`, no `--use_fast_math` (the codec
//! is integer code that must match the CPU bit for bit), and `-Xptxas -v`, whose report gives
//! each kernel's registers, spills, shared and local memory ([`KernelResources`]). A compiled
//! (source, architecture) pair is kept for the process's life and not compiled again.
//!
//! It is also kept on disk, so that a process does not pay NVRTC's tens of seconds for a
//! cubin an earlier one made: `CIERA_CUBIN_CACHE` names the folder (`off` disables it;
//! default `$XDG_CACHE_HOME/ciera/cubin`, else `~/.cache/ciera/cubin`). An entry is the cubin
//! and NVRTC's log, named by the source's XXH3-128 and the architecture, so a changed source
//! never loads a stale cubin; a cubin read back is checked as a fresh one is (its kernels are
//! read from its ELF). A cache hit needs no NVRTC at all (a machine with a driver but no NVRTC
//! can run cubins another machine compiled into the folder). [`compile_fresh`] always runs
//! NVRTC (the compile test) and writes through.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString, OsStr};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result as raw, sys};

pub use super::cubin::{CubinEntry, KernelResources};

/// The soname looked for, and the major version cudarc's bindings were built for.
const LIBRARY: &str = "libnvrtc.so.13";
const MAJOR: u32 = 13;

pub type Result<T, E = NvrtcError> = std::result::Result<T, E>;

/// What went wrong finding NVRTC or compiling with it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NvrtcError {
    /// No `libnvrtc.so.13` was found; `searched` lists each place and why it did not serve.
    NotFound { searched: Vec<String> },
    /// A library was found at `path` but is not one this module can use (it did not load, is
    /// another major version, or cudarc's own load resolved to a different file).
    Unusable { path: String, detail: String },
    /// The source does not compile: NVRTC's log says why.
    Compile {
        name: String,
        arch: Arch,
        log: String,
    },
    /// An NVRTC call failed for a reason other than the source (`op` names the call).
    Call {
        op: &'static str,
        name: String,
        code: String,
    },
    /// The source or its name cannot be passed to NVRTC (a NUL byte inside).
    InvalidSource { name: String },
    /// NVRTC produced a cubin this crate cannot read.
    Cubin {
        name: String,
        arch: Arch,
        detail: String,
    },
}

impl fmt::Display for NvrtcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NvrtcError::NotFound { searched } => {
                write!(f, "NVRTC ({LIBRARY}) not found; searched:")?;
                for s in searched {
                    write!(f, "\n  - {s}")?;
                }
                write!(
                    f,
                    "\n(install CUDA 13, or run .ci/run, which puts the PyPI wheel \
                     nvidia-cuda-nvrtc into .venv)"
                )
            }
            NvrtcError::Unusable { path, detail } => write!(f, "NVRTC at {path}: {detail}"),
            NvrtcError::Compile { name, arch, log } => {
                write!(f, "{name} does not compile for {arch}:\n{log}")
            }
            NvrtcError::Call { op, name, code } => write!(f, "{op} on {name}: {code}"),
            NvrtcError::InvalidSource { name } => {
                write!(f, "{name}: source or name holds a NUL byte")
            }
            NvrtcError::Cubin { name, arch, detail } => {
                write!(f, "cubin of {name} for {arch}: {detail}")
            }
        }
    }
}

impl std::error::Error for NvrtcError {}

/// A real GPU architecture, `sm_<number>` (80: A100, 90: H100, 100: B200, 120: RTX 50xx).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch(u32);

impl Arch {
    /// `sm_<number>`, e.g. `Arch::sm(90)`.
    pub const fn sm(number: u32) -> Arch {
        Arch(number)
    }

    /// The number in `sm_<number>`.
    pub const fn number(self) -> u32 {
        self.0
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}", self.0)
    }
}

/// One source compiled for one architecture.
#[derive(Debug)]
pub struct Compiled {
    /// The name the source was compiled under (what NVRTC's messages call it).
    pub name: String,
    pub arch: Arch,
    /// The ELF image for `cuModuleLoadData`.
    pub cubin: Vec<u8>,
    /// NVRTC's program log: warnings, and ptxas's resource report.
    pub log: String,
    /// Per kernel, what ptxas reported ([`KernelResources`]), in the order it compiled them.
    pub kernels: Vec<KernelResources>,
    /// The kernel entry points the cubin itself declares, with their register counts.
    pub entries: Vec<CubinEntry>,
}

impl Compiled {
    /// The report for the kernel called `name`, if ptxas gave one.
    pub fn kernel(&self, name: &str) -> Option<&KernelResources> {
        self.kernels.iter().find(|k| k.name == name)
    }
}

/// Where the loaded NVRTC came from.
#[derive(Clone, Debug)]
pub struct Library {
    /// The file the loader mapped (resolved through the loader for a by-name load).
    pub path: PathBuf,
    /// (major, minor), e.g. (13, 5).
    pub version: (u32, u32),
}

/// Finds and loads NVRTC on the first call; later calls answer the same (found or not).
pub fn library() -> Result<&'static Library> {
    static LOADED: OnceLock<Result<Library>> = OnceLock::new();
    LOADED.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// NVRTC's version, (major, minor).
pub fn version() -> Result<(u32, u32)> {
    library().map(|l| l.version)
}

/// The architectures this NVRTC can compile for, as `sm_` numbers, ascending.
pub fn supported_archs() -> Result<Vec<u32>> {
    library()?;
    let mut n: c_int = 0;
    // SAFETY: NVRTC is loaded (library() succeeded); `n` is a writable int.
    let rc = unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) };
    check(rc, "nvrtcGetNumSupportedArchs", "")?;
    let mut archs = vec![0 as c_int; n.max(0) as usize];
    // SAFETY: `archs` holds the `n` ints NVRTC said it will write.
    let rc = unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) };
    check(rc, "nvrtcGetSupportedArchs", "")?;
    let mut out: Vec<u32> = archs.into_iter().map(|a| a as u32).collect();
    out.sort_unstable();
    Ok(out)
}

/// Compiles `source` (CUDA C++, named `name` in messages) to a cubin for `arch`, or answers
/// the cubin compiled earlier in this process from the same source for the same `arch`.
pub fn compile(source: &str, name: &str, arch: Arch) -> Result<Arc<Compiled>> {
    type Slot = Arc<Mutex<Option<Arc<Compiled>>>>;
    static CACHE: OnceLock<Mutex<HashMap<(u128, Arch), Slot>>> = OnceLock::new();
    let key = (xxhash_rust::xxh3::xxh3_128(source.as_bytes()), arch);
    // One slot per key: the map's lock is held only to find the slot, the slot's while it
    // compiles, so different sources compile in parallel and the same one once.
    let slot = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_default()
        .clone();
    let mut done = slot.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = done.as_ref() {
        return Ok(c.clone());
    }
    let c = match disk_cache().and_then(|d| read_cached(&d, key.0, name, arch)) {
        Some(c) => c,
        None => compile_fresh(source, name, arch)?,
    };
    let c = Arc::new(c);
    *done = Some(c.clone());
    Ok(c)
}

/// Compiles `source` with NVRTC whatever the caches hold (and writes the disk cache).
pub fn compile_fresh(source: &str, name: &str, arch: Arch) -> Result<Compiled> {
    library()?;
    let c = compile_uncached(source, name, arch)?;
    if let Some(dir) = disk_cache() {
        write_cached(&dir, xxhash_rust::xxh3::xxh3_128(source.as_bytes()), &c);
    }
    Ok(c)
}

/// The disk cache's folder, or None when `CIERA_CUBIN_CACHE=off` or no home is known.
fn disk_cache() -> Option<PathBuf> {
    match std::env::var_os("CIERA_CUBIN_CACHE") {
        Some(v) if v == "off" => None,
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
            .map(|c| c.join("ciera").join("cubin")),
    }
}

fn cache_path(dir: &Path, hash: u128, arch: Arch, ext: &str) -> PathBuf {
    dir.join(format!("{hash:032x}-{arch}.{ext}"))
}

/// A cached cubin for (source hash, arch), checked like a fresh one; None if absent or bad.
fn read_cached(dir: &Path, hash: u128, name: &str, arch: Arch) -> Option<Compiled> {
    let cubin = std::fs::read(cache_path(dir, hash, arch, "cubin")).ok()?;
    let log = std::fs::read_to_string(cache_path(dir, hash, arch, "log")).unwrap_or_default();
    let entries = super::cubin::cubin_entries(&cubin).ok()?;
    if entries.is_empty() {
        return None;
    }
    Some(Compiled {
        name: name.into(),
        arch,
        kernels: super::cubin::parse_ptxas_report(&log),
        entries,
        cubin,
        log,
    })
}

/// Best effort: a write that fails leaves the cache as it was (written to a temporary name,
/// then renamed, so a reader never sees half a cubin).
fn write_cached(dir: &Path, hash: u128, c: &Compiled) {
    let write = |ext: &str, bytes: &[u8]| -> std::io::Result<()> {
        let path = cache_path(dir, hash, c.arch, ext);
        let tmp = path.with_extension(format!("{ext}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &path)
    };
    let _ = std::fs::create_dir_all(dir)
        .and_then(|()| write("log", c.log.as_bytes()))
        .and_then(|()| write("cubin", &c.cubin));
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program came from nvrtcCreateProgram and is destroyed only here.
        let _ = unsafe { raw::destroy_program(self.0) };
    }
}

fn compile_uncached(source: &str, name: &str, arch: Arch) -> Result<Compiled> {
    let invalid = || NvrtcError::InvalidSource { name: name.into() };
    let src = CString::new(source).map_err(|_| invalid())?;
    let cname = CString::new(name).map_err(|_| invalid())?;
    let program = Program(
        raw::create_program(&src, Some(&cname))
            .map_err(|e| call_error("nvrtcCreateProgram", name, e))?,
    );
    let options = [
        format!("-arch={arch}"),
        "-std=c++17".into(),
        "-default-device".into(),
        "-DCIERA_DEVICE=1".into(),
        "-Xptxas".into(),
        "-v".into(),
    ];
    // SAFETY: a live program; `src` and `cname`, which it may point into, outlive it.
    let compiled = unsafe { raw::compile_program(program.0, &options) };
    // SAFETY: a live program.
    let log = unsafe { raw::get_program_log(program.0) }
        .map(|l| c_chars_to_string(&l))
        .unwrap_or_default();
    match compiled {
        Ok(()) => {}
        Err(raw::NvrtcError(sys::nvrtcResult::NVRTC_ERROR_COMPILATION)) => {
            return Err(NvrtcError::Compile {
                name: name.into(),
                arch,
                log,
            })
        }
        Err(e) => {
            let mut err = call_error("nvrtcCompileProgram", name, e);
            if let NvrtcError::Call { code, .. } = &mut err {
                code.push_str(&format!(" ({})", log.trim()));
            }
            return Err(err);
        }
    }
    let mut size = 0usize;
    // SAFETY: a live, compiled program; `size` is writable.
    let rc = unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) };
    check(rc, "nvrtcGetCUBINSize", name)?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds the `size` bytes NVRTC said the cubin has.
    let rc = unsafe { sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr() as *mut c_char) };
    check(rc, "nvrtcGetCUBIN", name)?;
    let cubin_error = |detail: String| NvrtcError::Cubin {
        name: name.into(),
        arch,
        detail,
    };
    if cubin.is_empty() {
        return Err(cubin_error("NVRTC returned no cubin".into()));
    }
    let entries = super::cubin::cubin_entries(&cubin).map_err(|e| cubin_error(e.0))?;
    Ok(Compiled {
        name: name.into(),
        arch,
        kernels: super::cubin::parse_ptxas_report(&log),
        entries,
        cubin,
        log,
    })
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn call_error(op: &'static str, name: &str, e: raw::NvrtcError) -> NvrtcError {
    NvrtcError::Call {
        op,
        name: name.into(),
        code: format!("{:?}", e.0),
    }
}

fn check(rc: sys::nvrtcResult, op: &'static str, name: &str) -> Result<()> {
    rc.result().map_err(|e| call_error(op, name, e))
}

// ---- finding and loading the library -----------------------------------------------------

type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> sys::nvrtcResult;

fn load() -> Result<Library> {
    let explicit = std::env::var_os("CIERA_NVRTC_LIB").filter(|v| !v.is_empty());
    let venv = std::env::var_os("CIERA_VENV")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    let (handle, shown) = locate(explicit.as_deref(), venv.as_deref())?;
    adopt(handle, &shown)
}

/// dlopens the first of the places in the module doc that has the library: its handle and how
/// to name it in messages.
fn locate(explicit: Option<&OsStr>, venv: Option<&Path>) -> Result<(*mut c_void, String)> {
    if let Some(path) = explicit {
        let shown = format!("CIERA_NVRTC_LIB={}", Path::new(path).display());
        return dlopen(path.as_bytes())
            .map(|h| (h, shown.clone()))
            .map_err(|detail| NvrtcError::Unusable {
                path: shown,
                detail,
            });
    }
    let mut searched = vec!["CIERA_NVRTC_LIB: not set".to_string()];
    match dlopen(LIBRARY.as_bytes()) {
        Ok(h) => return Ok((h, LIBRARY.to_string())),
        Err(e) => searched.push(format!(
            "the loader's path (LD_LIBRARY_PATH, ld.so.cache): {e}"
        )),
    }
    let (venv, which) = match venv {
        Some(v) => (v.to_path_buf(), "CIERA_VENV"),
        None => (
            Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv"),
            "the repository's venv (CIERA_VENV not set)",
        ),
    };
    let found = venv_candidates(&venv);
    if found.is_empty() {
        searched.push(format!(
            "{which} {}: no lib/python3*/site-packages/nvidia/**/lib/{LIBRARY}*",
            venv.display()
        ));
    }
    for path in found {
        match dlopen(path.as_os_str().as_bytes()) {
            Ok(h) => return Ok((h, path.display().to_string())),
            Err(e) => searched.push(format!("{}: {e}", path.display())),
        }
    }
    Err(NvrtcError::NotFound { searched })
}

/// The NVRTC libraries a venv's wheels hold, the plain soname before versioned file names.
fn venv_candidates(venv: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for lib in dirs(&venv.join("lib")) {
        let is_python = lib
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("python3"));
        if !is_python {
            continue;
        }
        let nvidia = lib.join("site-packages").join("nvidia");
        // nvidia/<package>/lib today; one level deeper tolerated.
        let mut lib_dirs = Vec::new();
        for package in dirs(&nvidia) {
            lib_dirs.push(package.join("lib"));
            lib_dirs.extend(dirs(&package).into_iter().map(|d| d.join("lib")));
        }
        for dir in lib_dirs {
            let Ok(read) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut here: Vec<PathBuf> = read
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name().is_some_and(|n| {
                        let n = n.to_string_lossy();
                        n == LIBRARY || n.starts_with(&format!("{LIBRARY}."))
                    })
                })
                .collect();
            here.sort_by_key(|p| (p.file_name().is_none_or(|n| n != LIBRARY), p.clone()));
            out.extend(here);
        }
    }
    out
}

/// The subdirectories of `dir`, sorted; none if it cannot be read.
fn dirs(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    out
}

fn dlopen(name: &[u8]) -> std::result::Result<*mut c_void, String> {
    let c = CString::new(name).map_err(|_| "a NUL byte in the path".to_string())?;
    // SAFETY: a NUL-terminated name. Loading runs the library's initializers, which is what
    // loading NVRTC means; the handle is never closed.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        Err(dlerror())
    } else {
        Ok(h)
    }
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated message, valid until the next dl call
    // on this thread; it is copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-NULL, NUL-terminated (above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// The file the loader mapped for the object that defines `symbol`.
fn file_of(symbol: *const c_void) -> Option<PathBuf> {
    // SAFETY: Dl_info is plain data that dladdr fills in.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is writable; dladdr only reads the address.
    if unsafe { libc::dladdr(symbol, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated path owned by the loader, copied at once.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(OsStr::from_bytes(name.to_bytes())))
}

/// Checks the library behind `handle`: its version, and that cudarc's own load resolves to
/// it (cudarc tries `libnvrtc.so` before `libnvrtc.so.13`, which could be another CUDA's).
fn adopt(handle: *mut c_void, shown: &str) -> Result<Library> {
    let unusable = |detail: String| NvrtcError::Unusable {
        path: shown.to_string(),
        detail,
    };
    // SAFETY: a live handle (never closed) and a NUL-terminated name.
    let ours = unsafe { libc::dlsym(handle, c"nvrtcVersion".as_ptr()) };
    if ours.is_null() {
        return Err(unusable("no nvrtcVersion symbol: not NVRTC".into()));
    }
    let path = file_of(ours).unwrap_or_else(|| PathBuf::from(shown));
    // SAFETY: nvrtcVersion has had this signature since NVRTC 7:
    // nvrtcResult nvrtcVersion(int *major, int *minor).
    let version_fn = unsafe { std::mem::transmute::<*mut c_void, VersionFn>(ours) };
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two writable ints.
    let rc = unsafe { version_fn(&mut major, &mut minor) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(unusable(format!("nvrtcVersion: {rc:?}")));
    }
    let version = (major as u32, minor as u32);
    if version.0 != MAJOR {
        return Err(unusable(format!(
            "NVRTC {major}.{minor}; this build needs {MAJOR}.x"
        )));
    }
    // SAFETY: only tries to load libraries by name. It succeeds (ours answers to its soname),
    // so culib() below does not panic.
    if !unsafe { sys::is_culib_present() } {
        return Err(unusable(format!(
            "cudarc cannot load it by name (its soname is not {LIBRARY})"
        )));
    }
    // SAFETY: culib() loads the same candidates is_culib_present() just found; looking up a
    // symbol reads the loaded object. The pointer is compared, not called.
    let theirs = unsafe { cudarc::nvrtc::sys::culib().get::<VersionFn>(b"nvrtcVersion") }
        .map(|f| *f as *const c_void)
        .map_err(|e| unusable(format!("cudarc's load has no nvrtcVersion: {e}")))?;
    if !std::ptr::eq(theirs, ours) {
        let other = file_of(theirs).map_or("another file".into(), |p| p.display().to_string());
        return Err(unusable(format!(
            "cudarc loaded {other} instead (it tries libnvrtc.so first); \
             point CIERA_NVRTC_LIB or LD_LIBRARY_PATH at one CUDA 13"
        )));
    }
    Ok(Library { path, version })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_path_that_does_not_load_is_the_error() {
        let err = locate(Some(OsStr::new("/nonexistent/libnvrtc.so.13")), None).unwrap_err();
        let shown = err.to_string();
        assert!(matches!(err, NvrtcError::Unusable { .. }), "{shown}");
        assert!(
            shown.contains("CIERA_NVRTC_LIB=/nonexistent/libnvrtc.so.13"),
            "{shown}"
        );
    }

    #[test]
    fn finds_the_wheel_in_a_venv_and_names_what_it_searched() {
        let venv = std::env::temp_dir().join(format!("ciera-nvrtc-venv-{}", std::process::id()));
        let lib = venv.join("lib/python3.12/site-packages/nvidia/cu13/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::create_dir_all(venv.join("lib/python3.12/site-packages/nvidia/cuda_nvrtc/lib"))
            .unwrap();
        for f in [
            "libnvrtc.so.13.5",
            "libnvrtc.so.13",
            "libnvrtc-builtins.so.13.5",
            "x.so",
        ] {
            std::fs::write(lib.join(f), b"not an ELF file").unwrap();
        }
        let found = venv_candidates(&venv);
        assert_eq!(
            found,
            vec![lib.join("libnvrtc.so.13"), lib.join("libnvrtc.so.13.5")]
        );
        // If the loader's path has a real NVRTC, that one wins and the venv is not reached.
        if dlopen(LIBRARY.as_bytes()).is_err() {
            let err = locate(None, Some(&venv)).unwrap_err().to_string();
            assert!(err.contains("CIERA_NVRTC_LIB: not set"), "{err}");
            assert!(
                err.contains(&lib.join("libnvrtc.so.13").display().to_string()),
                "{err}"
            );
            let empty = venv.join("lib/python3.12/site-packages/nvidia/none");
            let err = locate(None, Some(&empty)).unwrap_err().to_string();
            assert!(err.contains("no lib/python3*/site-packages"), "{err}");
        }
        std::fs::remove_dir_all(&venv).unwrap();
    }

    /// The disk cache gives back the cubin NVRTC made (its kernels read from its ELF), keyed by
    /// source and architecture, and refuses a damaged file rather than loading it.
    #[test]
    fn disk_cache_round_trips_and_refuses_damage() {
        if let Err(e) = library() {
            use std::io::Write;
            let _ = std::io::stderr().lock().write_all(
                format!("SKIPPED disk_cache_round_trips_and_refuses_damage: {e}\n").as_bytes(),
            );
            assert!(
                std::env::var("CIERA_REQUIRE_NVRTC").map_or(true, |v| v != "1"),
                "{e}"
            );
            return;
        }
        let src = "extern \"C\" __global__ void k(unsigned* p) { p[threadIdx.x] += 1; }";
        let fresh = compile_uncached(src, "k.cu", Arch::sm(80)).unwrap();
        let dir = std::env::temp_dir().join(format!("ciera-cubin-{}", std::process::id()));
        let hash = xxhash_rust::xxh3::xxh3_128(src.as_bytes());
        write_cached(&dir, hash, &fresh);
        let back = read_cached(&dir, hash, "k.cu", Arch::sm(80)).expect("a cache hit");
        assert_eq!(back.cubin, fresh.cubin);
        assert_eq!(back.entries, fresh.entries);
        assert_eq!(back.kernels, fresh.kernels);
        assert!(
            read_cached(&dir, hash ^ 1, "k.cu", Arch::sm(80)).is_none(),
            "other source"
        );
        assert!(
            read_cached(&dir, hash, "k.cu", Arch::sm(90)).is_none(),
            "other arch"
        );
        let path = cache_path(&dir, hash, Arch::sm(80), "cubin");
        std::fs::write(&path, &fresh.cubin[..fresh.cubin.len() / 3]).unwrap();
        assert!(
            read_cached(&dir, hash, "k.cu", Arch::sm(80)).is_none(),
            "damaged cubin"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
