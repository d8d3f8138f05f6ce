//! Embeds the commit the binaries were built from, so that results written on the GPU machine
//! (which has no git) name it. The benchmark crate (`bench/`) reads it through this package's
//! `COMMIT`, so its sources are watched here too.

use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=CANDLE_OFFLOAD_COMMIT={commit}");
    // The sources too (directories are scanned whole): `--dirty` is only true if the script
    // runs again after an uncommitted edit, which touches none of git's files (otherwise
    // binaries built from an edited tree would name the clean commit below it).
    for path in [
        ".git/HEAD",
        ".git/index",
        ".git/refs/heads",
        "Cargo.toml",
        "Cargo.lock",
        "src",
        "examples",
        "bench",
        "tests",
        "candle-offload",
        "models",
    ] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}
