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

/// The kernel sources' bytes, by path, sorted.
#[cfg(feature = "cuda")]
fn kernel_sources() -> std::io::Result<Vec<(std::path::PathBuf, Vec<u8>)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir("kernels")? {
        let path = entry?.path();
        if path.is_file() {
            let bytes = std::fs::read(&path)?;
            files.push((path, bytes));
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(feature = "cuda")]
fn build_ptx() -> cudaforge::Result<()> {
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let ptx_rs = out_dir.join("ptx.rs");
    let before = kernel_sources()?;
    cudaforge::KernelBuilder::new()
        .source_dir("kernels")
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()?
        .write(&ptx_rs)?;
    // cudaforge records a source's hash after nvcc has compiled it, so a source saved while
    // nvcc was running would be recorded as compiled and its old PTX kept by every later
    // build. Forget this build's outputs and fail instead: the next build compiles it again.
    if kernel_sources()? != before {
        for entry in std::fs::read_dir(&out_dir)? {
            let path = entry?.path();
            if path.is_file() {
                std::fs::remove_file(&path)?;
            }
        }
        panic!("a file in kernels/ changed while nvcc compiled it; build again");
    }
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
