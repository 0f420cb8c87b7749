//! Compiles cuda/codec.cu as C++ for the host (with host_prelude.h), with the emulator that runs
//! its kernels' block bodies (host/emulator.cpp).
fn main() {
    println!("cargo:rerun-if-changed=codec.cu");
    println!("cargo:rerun-if-changed=host_prelude.h");
    println!("cargo:rerun-if-changed=host/emulator.cpp");
    cc::Build::new()
        .cpp(true)
        .file("host/emulator.cpp")
        .flag_if_supported("-std=c++17")
        .flag_if_supported("-Wno-unused-function")
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("ciera_cuda_emu");
}
