//! Calling NCCL: its library opened at run time, a communicator initialised without blocking,
//! and point-to-point sends and receives of device bytes on a CUDA stream.
//!
//! Nothing here blocks on a peer. A communicator is created non-blocking (NCCL's
//! `ncclConfig_t.blocking = 0`): its initialisation and each enqueued call return at once,
//! and [`NcclComm::state`] says whether it is ready, still in progress, or failed. The caller
//! polls with its own deadline and [`NcclComm::abort`]s a communicator whose peer never came
//! or died, which frees NCCL's threads and kernels instead of hanging in them. The crate's own
//! transport (`dist::NcclTransport`) does that loop; the CUDA side of a tensor (its device
//! pointer and stream) is `cuda_nccl.rs`'s.
//!
//! The C declarations below are NCCL's public API (`nccl.h`) since 2.14, the first release with
//! `ncclCommInitRankConfig`, `ncclCommFinalize` and non-blocking communicators; an older
//! library is refused with its version.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

use super::nccl::{nccl_version, open_library};

/// `ncclResult_t`.
type NcclResult = c_int;
/// `ncclSuccess`.
const NCCL_SUCCESS: NcclResult = 0;
/// `ncclInProgress`: a non-blocking call or initialisation is still running.
const NCCL_IN_PROGRESS: NcclResult = 7;
/// `ncclUint8`: every transfer is bytes, whatever the tensor's dtype.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const NCCL_UINT8: c_int = 1;
/// `NCCL_CONFIG_UNDEF_INT`: a configuration field left to NCCL's default.
const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `ncclConfig_t.magic`.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// The oldest NCCL this module calls: 2.14, as `NCCL_VERSION(2, 14, 0)` writes it.
pub(crate) const NCCL_MIN_VERSION: (u32, u32, u32) = (2, 14, 0);
const NCCL_MIN_VERSION_CODE: u32 = 21_400;

/// `ncclUniqueId`: what rank 0 makes and every rank passes to its initialisation.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct NcclUniqueId {
    internal: [c_char; Self::BYTES],
}

impl NcclUniqueId {
    /// `NCCL_UNIQUE_ID_BYTES`.
    pub(crate) const BYTES: usize = 128;

    /// The id as bytes, to send to the other ranks.
    pub(crate) fn to_bytes(self) -> Vec<u8> {
        self.internal.iter().map(|&c| c as u8).collect()
    }

    /// The id rank 0 sent; `None` unless `bytes` has exactly [`Self::BYTES`].
    pub(crate) fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::BYTES {
            return None;
        }
        let mut internal = [0 as c_char; Self::BYTES];
        for (d, &s) in internal.iter_mut().zip(bytes) {
            *d = s as c_char;
        }
        Some(Self { internal })
    }
}

/// The first fields of `ncclConfig_t`, as NCCL 2.14 declared them. NCCL reads `size` bytes of
/// the caller's struct over its own defaults and treats fields its `version` predates as
/// unset, so this prefix is valid for every later release.
#[repr(C)]
struct NcclConfig214 {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

impl NcclConfig214 {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
    fn non_blocking() -> Self {
        Self {
            size: std::mem::size_of::<Self>(),
            magic: CONFIG_MAGIC,
            version: NCCL_MIN_VERSION_CODE,
            blocking: 0,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
        }
    }
}

/// `ncclComm_t`.
type RawComm = *mut c_void;

/// `ncclSend` and `ncclRecv`: buffer (`const void *` for the send, the same in the ABI), count,
/// datatype, peer, communicator, stream.
type P2p =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> NcclResult;

/// NCCL's entry points this module calls, resolved once.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Api {
    get_unique_id: unsafe extern "C" fn(*mut NcclUniqueId) -> NcclResult,
    init_rank_config: unsafe extern "C" fn(
        *mut RawComm,
        c_int,
        NcclUniqueId,
        c_int,
        *mut NcclConfig214,
    ) -> NcclResult,
    get_async_error: unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult,
    abort: unsafe extern "C" fn(RawComm) -> NcclResult,
    finalize: unsafe extern "C" fn(RawComm) -> NcclResult,
    destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    send: P2p,
    recv: P2p,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    last_error: unsafe extern "C" fn(RawComm) -> *const c_char,
}

/// Why a call into NCCL failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum NcclError {
    /// The library could not be opened or lacks an entry point.
    #[error("NCCL ({path}) could not be loaded: {reason}")]
    Load {
        /// What was opened.
        path: String,
        /// What the loader said.
        reason: String,
    },
    /// The library is older than [`NCCL_MIN_VERSION`].
    #[error(
        "NCCL {}.{}.{} ({path}) is older than 2.14, the first with non-blocking communicators",
        version.0, version.1, version.2
    )]
    TooOld {
        /// What was opened.
        path: String,
        /// Its version.
        version: (u32, u32, u32),
    },
    /// The communicator was aborted after an earlier failure; it takes no more calls.
    #[error("the communicator was aborted after an earlier failure")]
    Aborted,
    /// A call returned an error, or the communicator holds one.
    #[error("{call}: {name} (code {code}){}", if detail.is_empty() { String::new() } else { format!(": {detail}") })]
    Call {
        /// The NCCL function.
        call: &'static str,
        /// Its `ncclResult_t`.
        code: i32,
        /// `ncclGetErrorString` of it.
        name: String,
        /// `ncclGetLastError`: NCCL's own account, where it has one.
        detail: String,
    },
}

/// NCCL's library, opened at run time, and its version.
pub(crate) struct NcclLib {
    api: Api,
    version: (u32, u32, u32),
    path: String,
    // Last: the entry points above point into it.
    _lib: libloading::Library,
}

impl std::fmt::Debug for NcclLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLib")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

impl NcclLib {
    /// Opens NCCL at `path` (a file name for the loader's own search, or a path, as
    /// [`find_nccl`](super::find_nccl) reports it) and resolves its entry points.
    pub(crate) fn open(path: &str) -> Result<Arc<Self>, NcclError> {
        let load = |reason: String| NcclError::Load {
            path: path.to_string(),
            reason,
        };
        let (lib, code) = open_library(path).map_err(load)?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: each symbol is declared above with its `nccl.h` signature, unchanged
                // since 2.14 (checked below); the pointer is kept only beside `lib`.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| load(format!("{}: {e}", $name)))?
            };
        }
        let version = nccl_version(code);
        if version < NCCL_MIN_VERSION {
            return Err(NcclError::TooOld {
                path: path.to_string(),
                version,
            });
        }
        let api = Api {
            get_unique_id: sym!("ncclGetUniqueId"),
            init_rank_config: sym!("ncclCommInitRankConfig"),
            get_async_error: sym!("ncclCommGetAsyncError"),
            abort: sym!("ncclCommAbort"),
            finalize: sym!("ncclCommFinalize"),
            destroy: sym!("ncclCommDestroy"),
            send: sym!("ncclSend"),
            recv: sym!("ncclRecv"),
            group_start: sym!("ncclGroupStart"),
            group_end: sym!("ncclGroupEnd"),
            error_string: sym!("ncclGetErrorString"),
            last_error: sym!("ncclGetLastError"),
        };
        Ok(Arc::new(Self {
            api,
            version,
            path: path.to_string(),
            _lib: lib,
        }))
    }

    /// `(major, minor, patch)`.
    pub(crate) fn version(&self) -> (u32, u32, u32) {
        self.version
    }

    /// What was opened.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// A new unique id (rank 0 makes it; it opens NCCL's bootstrap socket).
    pub(crate) fn unique_id(&self) -> Result<NcclUniqueId, NcclError> {
        let mut id = NcclUniqueId {
            internal: [0; NcclUniqueId::BYTES],
        };
        // SAFETY: `id` is a writable `ncclUniqueId` for the call.
        let code = unsafe { (self.api.get_unique_id)(&mut id) };
        self.check("ncclGetUniqueId", code, std::ptr::null_mut())?;
        Ok(id)
    }

    fn check(&self, call: &'static str, code: NcclResult, comm: RawComm) -> Result<(), NcclError> {
        if code == NCCL_SUCCESS || code == NCCL_IN_PROGRESS {
            return Ok(());
        }
        Err(self.error(call, code, comm))
    }

    fn error(&self, call: &'static str, code: NcclResult, comm: RawComm) -> NcclError {
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: NCCL's strings are NUL-terminated and static or owned by a
                // communicator not yet destroyed; this copies one at once.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        // SAFETY: `ncclGetErrorString` takes any result code and returns a static string.
        let name = text(unsafe { (self.api.error_string)(code) });
        // SAFETY: `comm` is null (the thread's last error) or a communicator not yet destroyed.
        let detail = text(unsafe { (self.api.last_error)(comm) });
        NcclError::Call {
            call,
            code,
            name,
            detail,
        }
    }

    /// Runs `body` between `ncclGroupStart` and `ncclGroupEnd`: the sends and receives between them are one
    /// operation (a rank sending to itself needs it).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn group<R, E: From<NcclError>>(
        &self,
        body: impl FnOnce() -> Result<R, E>,
    ) -> Result<R, E> {
        // SAFETY: no arguments; NCCL keeps a per-thread group depth.
        let code = unsafe { (self.api.group_start)() };
        self.check("ncclGroupStart", code, std::ptr::null_mut())?;
        let out = body();
        // SAFETY: as above; always closed, so the thread's depth returns to where it was.
        let code = unsafe { (self.api.group_end)() };
        let out = out?;
        self.check("ncclGroupEnd", code, std::ptr::null_mut())?;
        Ok(out)
    }
}

/// Where a non-blocking communicator stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommState {
    /// Initialised, and every call so far enqueued.
    Ready,
    /// Its initialisation or last call is still running.
    InProgress,
}

/// An NCCL communicator of one rank, non-blocking. Dropping it finalises and destroys it, or
/// aborts it where that fails.
pub(crate) struct NcclComm {
    lib: Arc<NcclLib>,
    raw: RawComm,
    rank: usize,
    world_size: usize,
    aborted: bool,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("nccl", &self.lib.version)
            .finish()
    }
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; `NcclComm`'s
// methods take `&mut self` for every call that touches it except `state`, which NCCL allows
// concurrently with others (`ncclCommGetAsyncError` is its documented polling call).
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Starts the initialisation of rank `rank` of `world_size` with `id` on the current
    /// thread's CUDA device (the caller binds it first) and returns at once: poll
    /// [`state`](Self::state) until [`CommState::Ready`], or [`abort`](Self::abort).
    pub(crate) fn start(
        lib: &Arc<NcclLib>,
        world_size: usize,
        rank: usize,
        id: NcclUniqueId,
    ) -> Result<Self, NcclError> {
        let ranks = c_int::try_from(world_size).unwrap_or(c_int::MAX);
        let me = c_int::try_from(rank).unwrap_or(c_int::MAX);
        let mut raw: RawComm = std::ptr::null_mut();
        let mut config = NcclConfig214::non_blocking();
        // SAFETY: `raw` and `config` are valid for the call (NCCL copies `config.size` bytes of
        // the config and keeps no pointer to it); `id` is passed by value as `nccl.h` declares.
        let code = unsafe { (lib.api.init_rank_config)(&mut raw, ranks, id, me, &mut config) };
        if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
            let err = lib.error("ncclCommInitRankConfig", code, raw);
            if !raw.is_null() {
                // SAFETY: `raw` is the communicator NCCL returned, not yet destroyed.
                unsafe { (lib.api.abort)(raw) };
            }
            return Err(err);
        }
        if raw.is_null() {
            return Err(lib.error("ncclCommInitRankConfig", code, raw));
        }
        Ok(Self {
            lib: lib.clone(),
            raw,
            rank,
            world_size,
            aborted: false,
        })
    }

    /// This rank.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The library this communicator came from.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn lib(&self) -> &Arc<NcclLib> {
        &self.lib
    }

    /// Ready, still in progress, or the error NCCL holds for this communicator (a peer's
    /// failure reaches it as `ncclRemoteError`).
    pub(crate) fn state(&self) -> Result<CommState, NcclError> {
        let raw = self.live()?;
        let mut state: NcclResult = NCCL_SUCCESS;
        // SAFETY: `raw` is a live communicator; `state` is writable for the call.
        let code = unsafe { (self.lib.api.get_async_error)(raw, &mut state) };
        self.lib.check("ncclCommGetAsyncError", code, self.raw)?;
        match state {
            NCCL_SUCCESS => Ok(CommState::Ready),
            NCCL_IN_PROGRESS => Ok(CommState::InProgress),
            other => Err(self.lib.error("ncclCommGetAsyncError", other, self.raw)),
        }
    }

    /// Polls [`state`](Self::state) until the communicator is ready (`true`) or `deadline`
    /// passes with it still in progress (`false`).
    pub(crate) fn wait_ready(&self, deadline: std::time::Instant) -> Result<bool, NcclError> {
        loop {
            match self.state()? {
                CommState::Ready => return Ok(true),
                CommState::InProgress if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                CommState::InProgress => return Ok(false),
            }
        }
    }

    /// Enqueues a send of `bytes` bytes at device address `ptr` to `peer` on `stream`.
    ///
    /// # Safety
    /// `ptr` must address `bytes` readable bytes of this communicator's device that stay
    /// alive and unwritten until the send has completed on `stream`, a stream of that device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) unsafe fn send(
        &mut self,
        ptr: u64,
        bytes: usize,
        peer: usize,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        // SAFETY: the caller's contract, which is `ncclSend`'s.
        unsafe { self.p2p("ncclSend", self.lib.api.send, ptr, bytes, peer, stream) }
    }

    /// Enqueues a receive of `bytes` bytes from `peer` into device address `ptr` on `stream`.
    ///
    /// # Safety
    /// `ptr` must address `bytes` writable bytes of this communicator's device that nothing
    /// else reads or writes until the receive has completed on `stream`, a stream of that
    /// device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) unsafe fn recv(
        &mut self,
        ptr: u64,
        bytes: usize,
        peer: usize,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        // SAFETY: the caller's contract, which is `ncclRecv`'s.
        unsafe { self.p2p("ncclRecv", self.lib.api.recv, ptr, bytes, peer, stream) }
    }

    /// One point-to-point call, `ncclSend` or `ncclRecv` (`call` names it in errors).
    ///
    /// # Safety
    /// That call's contract on `ptr`, `bytes` and `stream` ([`Self::send`], [`Self::recv`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    unsafe fn p2p(
        &mut self,
        call: &'static str,
        f: P2p,
        ptr: u64,
        bytes: usize,
        peer: usize,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        let raw = self.live()?;
        let peer = c_int::try_from(peer).unwrap_or(c_int::MAX);
        // SAFETY: the caller's contract; `raw` is a live communicator; `f` is the entry
        // point `call` names, resolved with this signature.
        let code = unsafe { f(ptr as *mut c_void, bytes, NCCL_UINT8, peer, raw, stream) };
        self.lib.check(call, code, raw)
    }

    /// The raw communicator, unless it was aborted or closed (NCCL freed it then).
    fn live(&self) -> Result<RawComm, NcclError> {
        if self.aborted {
            return Err(NcclError::Aborted);
        }
        Ok(self.raw)
    }

    /// Aborts the communicator: NCCL stops its threads and any kernel waiting on a peer.
    /// Every later call fails; dropping it then frees nothing more.
    pub(crate) fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // SAFETY: `self.raw` is a live communicator; it is not used again.
            unsafe { (self.lib.api.abort)(self.raw) };
        }
    }

    /// Finalises the communicator (flushing what it enqueued) within `deadline`, then
    /// destroys it; aborts it where that fails or takes longer.
    pub(crate) fn close(&mut self, deadline: std::time::Instant) -> Result<(), NcclError> {
        if self.aborted {
            return Ok(());
        }
        // Past this point `aborted` also means closed: `live` refuses every later call.
        // SAFETY: `self.raw` is a live communicator.
        let code = unsafe { (self.lib.api.finalize)(self.raw) };
        if let Err(e) = self.lib.check("ncclCommFinalize", code, self.raw) {
            self.abort();
            return Err(e);
        }
        match self.wait_ready(deadline) {
            Ok(true) => {}
            Ok(false) => {
                self.abort();
                return Err(NcclError::Call {
                    call: "ncclCommFinalize",
                    code: NCCL_IN_PROGRESS,
                    name: "still in progress at its deadline".into(),
                    detail: String::new(),
                });
            }
            Err(e) => {
                self.abort();
                return Err(e);
            }
        }
        self.aborted = true;
        // SAFETY: `self.raw` is finalised and not used again.
        let code = unsafe { (self.lib.api.destroy)(self.raw) };
        self.lib
            .check("ncclCommDestroy", code, std::ptr::null_mut())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        if let Err(e) = self.close(deadline) {
            tracing::warn!(
                rank = self.rank,
                "NCCL communicator not closed cleanly: {e}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_prefix_has_nccl_214s_layout() {
        // size_t, two unsigned, four int, one pointer: 40 bytes on 64-bit targets.
        assert_eq!(std::mem::size_of::<NcclConfig214>(), 40);
        assert_eq!(std::mem::offset_of!(NcclConfig214, blocking), 16);
        assert_eq!(std::mem::offset_of!(NcclConfig214, net_name), 32);
        let c = NcclConfig214::non_blocking();
        assert_eq!((c.size, c.magic, c.blocking), (40, 0xcafe_beef, 0));
        assert_eq!(nccl_version(c.version as i32), NCCL_MIN_VERSION);
    }

    #[test]
    fn unique_ids_travel_as_128_bytes() {
        let bytes: Vec<u8> = (0..128u8).map(|b| b.wrapping_mul(7)).collect();
        let id = NcclUniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.to_bytes(), bytes);
        assert!(NcclUniqueId::from_bytes(&bytes[..127]).is_none());
    }

    /// Where NCCL is found (the loader's path, or the Python environments the doctor searches):
    /// every entry point resolves and a unique id is made, which needs no GPU.
    #[test]
    fn a_real_nccl_opens_with_every_entry_point() {
        let mut prefixes = vec![std::path::PathBuf::from("/usr")];
        prefixes.extend(std::env::var_os("VIRTUAL_ENV").map(Into::into));
        let search = super::super::find_nccl(&super::super::python_nccl_dirs(&prefixes));
        let Some(found) = search.found else {
            eprintln!("skipped: no NCCL here");
            return;
        };
        let lib = match NcclLib::open(&found.path) {
            Err(NcclError::TooOld { .. }) => return,
            other => other.unwrap(),
        };
        assert_eq!(lib.version(), found.version);
        let id = lib.unique_id().unwrap();
        assert!(id.to_bytes().iter().any(|&b| b != 0));
    }

    #[test]
    fn a_library_that_is_not_there_is_an_error_naming_it() {
        let e = NcclLib::open("/nonexistent/libnccl.so.2").unwrap_err();
        assert!(e.to_string().contains("/nonexistent/libnccl.so.2"), "{e}");
    }
}
