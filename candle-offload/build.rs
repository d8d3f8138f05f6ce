//! Build script: with the `cuda` feature, compiles the project's own CUDA kernels
//! (`kernels/*.cu`) to PTX for `CUDA_COMPUTE_CAP` with cudaforge, as candle-kernels does, and
//! writes `$OUT_DIR/ptx.rs` (one `&str` constant per file, embedded with `include_str!`, each
//! allowed to go unused by the modules that embed the others).
//! Without the feature it does nothing.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels");
    // The feature's env var is what cargo sets; the cfg keeps cudaforge (an optional
    // build-dependency of the feature) out of builds without it.
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        #[cfg(feature = "cuda")]
        if let Err(e) = build_ptx() {
            // A kernel that does not compile fails the build, with nvcc's message.
            panic!("compiling candle-offload's CUDA kernels: {e}");
        }
    }
}

#[cfg(feature = "cuda")]
fn build_ptx() -> cudaforge::Result<()> {
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let ptx_rs = out_dir.join("ptx.rs");
    cudaforge::KernelBuilder::new()
        .source_dir("kernels")
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()?
        .write(&ptx_rs)?;
    // Each launcher module (sys/kernels.rs, sys/train_kernels.rs) embeds the file but uses
    // only its own kernel file's constant: the others are allowed to be unused there.
    let consts = std::fs::read_to_string(&ptx_rs)?;
    let allowed: String = consts
        .lines()
        .map(|l| format!("#[allow(dead_code)]\n{l}\n"))
        .collect();
    std::fs::write(&ptx_rs, allowed)?;
    Ok(())
}
