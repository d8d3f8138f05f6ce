//! Build script: with the `cuda` feature, compiles the crate's CUDA kernels (`kernels/*.cu`,
//! one PTX module per op family, sharing the `kernels/*.cuh` headers) to PTX for
//! `CUDA_COMPUTE_CAP` with cudaforge, as candle-kernels does, and writes `$OUT_DIR/ptx.rs`: one
//! `&str` constant per file, named after it (`norm.cu` is `NORM`), embedded with
//! `include_str!` by `src/cuda.rs`. Without the feature it does nothing.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels");
    // The feature's env var is what cargo sets; the cfg keeps cudaforge (an optional
    // build-dependency of the feature) out of builds without it.
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        #[cfg(feature = "cuda")]
        if let Err(e) = build_ptx() {
            // A kernel that does not compile fails the build, with nvcc's message.
            panic!("compiling candle-offload-kernels' CUDA kernels: {e}");
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
        // A header's edit recompiles every file (its hash is part of each file's).
        .watch(["kernels"])
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
    Ok(())
}
