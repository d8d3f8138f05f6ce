//! Finding NCCL at run time. Nothing links against it: a binary starts where it is missing, and
//! the doctor says where it was found, which version it is, or where it was looked for.
//!
//! NCCL comes as `libnccl.so.2`: from the distribution's package, CUDA's own repositories, or the
//! `nvidia-nccl-cu*` wheel that PyTorch installs beside itself
//! (`site-packages/nvidia/nccl/lib/`, whose directory is on no loader path).

use std::path::{Path, PathBuf};

/// The file names NCCL's library goes by: the versioned one every package ships, then the
/// development link.
pub const NCCL_FILE_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// Where NCCL was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclFound {
    /// What was loaded: a bare file name (found by the loader's own search: `LD_LIBRARY_PATH`,
    /// the loader's cache) or a path.
    pub path: String,
    /// `(major, minor, patch)` as `ncclGetVersion` gives it.
    pub version: (u32, u32, u32),
    /// Whether the loader's own search finds it (a later `dlopen` by name then finds it too).
    pub on_loader_path: bool,
}

/// What a search for NCCL found, and every candidate it tried that failed, with why.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NcclSearch {
    /// The first candidate that loaded and answered its version.
    pub found: Option<NcclFound>,
    /// The candidates tried before it (or all of them), each with its error.
    pub tried: Vec<(String, String)>,
}

/// The directories under Python prefixes (`/usr`, `/usr/local`, `~/.local`, a virtual
/// environment, a conda prefix) where a wheel puts NCCL: `lib/python3*/{site,dist}-packages/
/// nvidia/*/lib` (the `nccl` package's, or a combined `cu13`/`cu12` one) that hold one of
/// `libnccl.so.2` or `libnccl.so`. Sorted, each once.
pub fn python_nccl_dirs(prefixes: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for prefix in prefixes {
        for site in site_dirs(prefix) {
            for pkg in read_dir_sorted(&site.join("nvidia")) {
                let lib = pkg.join("lib");
                if NCCL_FILE_NAMES.iter().any(|n| lib.join(n).is_file()) {
                    out.push(lib);
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// `prefix/lib/python3*/{site,dist}-packages` and `prefix/lib/python3/dist-packages`.
fn site_dirs(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for lib in read_dir_sorted(&prefix.join("lib")) {
        let name = lib.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !name.starts_with("python3") {
            continue;
        }
        for sub in ["site-packages", "dist-packages"] {
            if lib.join(sub).is_dir() {
                out.push(lib.join(sub));
            }
        }
    }
    out
}

fn read_dir_sorted(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    out.sort();
    out
}

/// NCCL's version from `ncclGetVersion`'s code: `major * 10000 + minor * 100 + patch` from 2.9
/// on, `major * 1000 + minor * 100 + patch` before.
pub fn nccl_version(code: i32) -> (u32, u32, u32) {
    let c = code.max(0) as u32;
    if c >= 10_000 {
        (c / 10_000, c % 10_000 / 100, c % 100)
    } else {
        (c / 1000, c % 1000 / 100, c % 100)
    }
}

/// Looks for NCCL: first by file name through the loader's own search, then in each of `dirs`
/// (e.g. [`python_nccl_dirs`]). A candidate counts when it loads and answers
/// `ncclGetVersion`. The library is closed again: this only says where it is.
pub fn find_nccl(dirs: &[PathBuf]) -> NcclSearch {
    let mut search = NcclSearch::default();
    let bare = NCCL_FILE_NAMES.iter().map(|n| (n.to_string(), true));
    let in_dirs = dirs.iter().flat_map(|d| {
        NCCL_FILE_NAMES
            .iter()
            .map(|n| d.join(n))
            .filter(|p| p.is_file())
            .map(|p| (p.display().to_string(), false))
    });
    for (candidate, on_loader_path) in bare.chain(in_dirs) {
        match open_library(&candidate) {
            Ok((_, code)) => {
                search.found = Some(NcclFound {
                    path: candidate,
                    version: nccl_version(code),
                    on_loader_path,
                });
                return search;
            }
            Err(e) => search.tried.push((candidate, e)),
        }
    }
    search
}

/// Opens `name` (a file name for the loader's search, or a path) and calls its
/// `ncclGetVersion`: the library, kept open, and the version's code.
pub(super) fn open_library(name: &str) -> Result<(libloading::Library, i32), String> {
    type GetVersion = unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int;
    // SAFETY: loading a shared library runs its initialisers; NCCL's only set up its own
    // state. `name` is NCCL's file name or a file found under one of its names.
    let lib = unsafe { libloading::Library::new(name) }.map_err(|e| e.to_string())?;
    let code = {
        // SAFETY: `ncclGetVersion` has had this signature in every NCCL 2 release
        // (`ncclResult_t ncclGetVersion(int *version)`); a library without it fails here.
        let get: libloading::Symbol<'_, GetVersion> =
            unsafe { lib.get(b"ncclGetVersion\0") }.map_err(|e| e.to_string())?;
        let mut code: std::ffi::c_int = 0;
        // SAFETY: `code` is a valid, writable int for the call's duration; the symbol lives
        // as long as `lib`, which outlives the call.
        let status = unsafe { get(&mut code) };
        if status != 0 {
            return Err(format!("ncclGetVersion returned {status}"));
        }
        code
    };
    Ok((lib, code))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_version_codes() {
        assert_eq!(nccl_version(22_703), (2, 27, 3));
        assert_eq!(nccl_version(2804), (2, 8, 4));
        assert_eq!(nccl_version(-1), (0, 0, 0));
    }

    #[test]
    fn finds_wheel_dirs_and_reports_a_file_that_is_not_nccl() {
        let tmp = tempfile::Builder::new()
            .prefix("candle-offload-nccl-")
            .tempdir()
            .unwrap();
        let root = tmp.path().to_path_buf();
        let lib = root.join("lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::create_dir_all(root.join("lib/python3.12/site-packages/nvidia/cublas/lib"))
            .unwrap();
        std::fs::write(lib.join("libnccl.so.2"), b"not a library").unwrap();
        assert_eq!(
            python_nccl_dirs(std::slice::from_ref(&root)),
            vec![lib.clone()]
        );
        let search = find_nccl(std::slice::from_ref(&lib));
        let fake = lib.join("libnccl.so.2").display().to_string();
        match &search.found {
            // No NCCL on this machine's loader path: the fake file was tried and refused.
            None => assert!(search
                .tried
                .iter()
                .any(|(c, e)| *c == fake && !e.is_empty())),
            // A real one on the loader path is found first; the fake never loads.
            Some(f) => assert!(f.on_loader_path && f.path != fake, "{f:?}"),
        }
    }
}
