//! Export only this crate's own `#[no_mangle]` functions.
//!
//! rustc already links a cdylib with a version script naming its exported symbols, but that
//! list includes every `#[no_mangle]` function of the crates it links, so the whole C API of
//! `ciera` (cieraAllGather, ...) would be exported too. `--exclude-libs=ALL` makes symbols that
//! come from static archives (the dependencies' rlibs) local. A second `--version-script` does
//! not work here: GNU ld refuses two anonymous version scripts ("anonymous version tag cannot
//! be combined with other version tags") and lld cannot demote a name rustc's script lists.
//! tests/capi_nccl.rs and tests/capi_mpi.rs check the result with `nm -D --defined-only`.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs=ALL");
    println!("cargo:rerun-if-changed=build.rs");
}
