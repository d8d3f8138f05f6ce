//! The disk tier: a unit whose bytes stay in its checkpoint file, read on demand with
//! positioned reads: with O_DIRECT where the file system allows it (aligned reads through a
//! bounded buffer), otherwise through the page cache, with one warning naming the file; and
//! read ahead of their fetch by a small pool of reader threads ([`ReadPool`]).
//!
//! A unit's buffer is virtual here: it is a list of [`Segment`]s, each mapping a byte range of
//! the unit's layout to a byte range of a file, with an optional conversion of whole groups
//! (an F32 checkpoint stored as F16, GGML blocks dequantized); a tensor is one segment, or one
//! per run of rows where the loader reorders rows (a GGUF's q/k). The alignment gaps between
//! tensors read as zeros, as the in-memory tiers hold them. A read gathers the segments it
//! touches, sorts their file ranges and reads each run of (nearly) adjacent ranges with one
//! `pread`, so a tensor split into rows costs one read, not one per row. Every read first
//! checks that the file still has the size and modification time it had when the store was
//! built, so a file that changed or shrank is an error naming it, never wrong weights or a
//! panic.
//!
//! Read-ahead: [`HostTier::read_ahead`] hands the whole unit to a reader thread, which reads
//! it into a staging buffer of ordinary memory; a later `read_into` waits for that read if it
//! is still running and copies out of the buffer (after checking the file again), and
//! [`HostTier::end_read_ahead`] frees it. A read-ahead that failed or was dropped unread
//! leaves the next read to go to the file itself, which reports any error.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::SystemTime;

use super::{HostTier, PageableBuffer, SysError, SysResult, TierKind};

/// File ranges at most this far apart are read with one `pread` (the bytes between are read
/// and dropped): GGUF aligns tensors to 32 bytes, safetensors packs them.
const MERGE_GAP: u64 = 4096;

/// A merged read stops growing at this many bytes, which bounds its scratch buffer (a single
/// range larger than this is read on its own: straight into place, or for a conversion into a
/// buffer of its file bytes).
const MAX_RUN: u64 = 8 << 20;

/// Threads that read the pieces of one unit at once in the tests' [`ReadShape::DEFAULT`].
#[cfg(test)]
const READ_PARALLEL: usize = 2;

/// How a long read is cut up: into pieces of `piece` bytes (the largest request one O_DIRECT
/// `pread` makes), read by up to `threads` threads at once. Disks differ in the requests that
/// reach their rate (a local NVMe wants several in flight, some virtual disks want large ones),
/// so each disk unit is given its shape when it is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReadShape {
    pub threads: usize,
    pub piece: u64,
}

#[cfg(test)]
impl ReadShape {
    pub(crate) const DEFAULT: Self = Self {
        threads: READ_PARALLEL,
        piece: MAX_RUN,
    };
}

/// Alignment of O_DIRECT reads (offset, length and buffer): a multiple of every common logical
/// block size (512 and 4096 bytes).
const DIRECT_ALIGN: usize = 4096;

/// A checkpoint file kept open for the disk tier, with what it looked like when opened.
#[derive(Debug)]
pub(crate) struct DiskFile {
    path: PathBuf,
    file: File,
    len: u64,
    modified: Option<SystemTime>,
    /// Whether to read with O_DIRECT where the file system allows it.
    want_direct: bool,
    /// The file opened with O_DIRECT, once tried (`None`: reads go through the page cache).
    direct: OnceLock<Option<File>>,
}

/// A zeroed buffer of `len` bytes whose start is aligned for O_DIRECT.
struct AlignedBuf {
    buf: Vec<u8>,
    at: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> io::Result<Self> {
        let buf = vec![0u8; len + DIRECT_ALIGN];
        let at = buf.as_ptr().align_offset(DIRECT_ALIGN);
        if at > DIRECT_ALIGN {
            return Err(io::Error::other("cannot align a buffer for O_DIRECT"));
        }
        Ok(Self { buf, at, len })
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.at..self.at + self.len]
    }
}

/// Opens `path` with O_DIRECT and reads its first block, since some file systems accept the
/// flag and refuse the reads.
#[cfg(target_os = "linux")]
fn open_direct(path: &Path, len: u64) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    if len > 0 {
        let mut probe = AlignedBuf::new(DIRECT_ALIGN)?;
        f.read_at(probe.bytes_mut(), 0)?;
    }
    Ok(f)
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_: &Path, _: u64) -> io::Result<File> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "O_DIRECT is read only on Linux",
    ))
}

impl DiskFile {
    /// Opens `path` for positioned reads and records its size and modification time; with
    /// `direct`, its disk units read it with O_DIRECT where the file system allows (tried when
    /// the first disk unit uses it, falling back to the page cache with one warning naming it).
    pub(crate) fn open(path: &Path, direct: bool) -> SysResult<Arc<Self>> {
        let err = |reason: String| SysError::File {
            path: path.to_path_buf(),
            reason,
        };
        let file = File::open(path).map_err(|e| err(format!("cannot open: {e}")))?;
        let meta = file
            .metadata()
            .map_err(|e| err(format!("cannot read its metadata: {e}")))?;
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            file,
            len: meta.len(),
            modified: meta.modified().ok(),
            want_direct: direct,
            direct: OnceLock::new(),
        }))
    }

    /// The O_DIRECT handle, opened on first use (`None`: not wanted, or not allowed here).
    fn direct(&self) -> Option<&File> {
        self.direct
            .get_or_init(|| {
                if !self.want_direct {
                    return None;
                }
                match open_direct(&self.path, self.len) {
                    Ok(f) => Some(f),
                    Err(e) => {
                        tracing::warn!(
                            file = %self.path.display(),
                            error = %e,
                            "O_DIRECT is not available for this file; its disk units are read \
                             through the page cache"
                        );
                        None
                    }
                }
            })
            .as_ref()
    }

    /// Whether its disk units read it with O_DIRECT.
    pub(crate) fn reads_direct(&self) -> bool {
        self.direct().is_some()
    }

    /// Fills `dst` from `offset` in the default [`ReadShape`].
    #[cfg(test)]
    fn read_exact_at(&self, dst: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_exact_shaped(dst, offset, ReadShape::DEFAULT)
    }

    /// Fills `dst` from `offset`: with O_DIRECT through aligned buffers of at most
    /// `shape.piece` bytes, otherwise with `pread`s through the page cache. A read longer than
    /// a piece is cut at piece boundaries of the file and its pieces are read by up to
    /// `shape.threads` threads at once ([`read_queue`]), each with one buffer, since a disk
    /// (and the page cache's copy) reaches its rate only with several requests in flight.
    fn read_exact_shaped(&self, dst: &mut [u8], offset: u64, shape: ReadShape) -> io::Result<()> {
        let mut queue = Vec::new();
        push_pieces(&mut queue, self, offset, dst, shape.piece, ());
        read_queue(queue, shape).map_err(|((), e)| e)
    }

    /// [`read_exact_shaped`](Self::read_exact_shaped) on one thread: with O_DIRECT through
    /// `scratch` (allocated on first use, at most `piece` bytes plus alignment) in requests of
    /// at most `piece` bytes, otherwise one `pread`.
    fn read_run(
        &self,
        dst: &mut [u8],
        offset: u64,
        piece: u64,
        scratch: &mut Option<AlignedBuf>,
    ) -> io::Result<()> {
        let Some(direct) = self.direct() else {
            return self.file.read_exact_at(dst, offset);
        };
        let a = DIRECT_ALIGN as u64;
        let end = offset + dst.len() as u64;
        let span = (end.div_ceil(a) * a - offset / a * a).min(piece + 2 * a) as usize;
        if scratch.as_ref().is_none_or(|b| b.len < span) {
            *scratch = Some(AlignedBuf::new(span)?);
        }
        let scratch = scratch.as_mut().expect("allocated above");
        let mut pos = offset;
        while pos < end {
            let start = pos / a * a;
            let chunk_end = end.min(start + piece);
            let n = (chunk_end.div_ceil(a) * a - start) as usize;
            let buf = &mut scratch.bytes_mut()[..n];
            let mut got = 0;
            while got < n {
                match direct.read_at(&mut buf[got..], start + got as u64) {
                    Ok(0) => break,
                    Ok(k) => got += k,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            if (got as u64) < chunk_end - start {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "failed to fill whole buffer",
                ));
            }
            let (skip, take) = ((pos - start) as usize, (chunk_end - pos) as usize);
            let at = (pos - offset) as usize;
            dst[at..at + take].copy_from_slice(&buf[skip..skip + take]);
            pos = chunk_end;
        }
        Ok(())
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Its size when opened.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// An error unless the open file still has the size and modification time it had.
    fn check_unchanged(&self) -> io::Result<()> {
        let meta = self.file.metadata()?;
        if meta.len() != self.len {
            return Err(io::Error::other(format!(
                "{}: the file changed size since the store was built ({} bytes, now {}); \
                 reload the model",
                self.path.display(),
                self.len,
                meta.len()
            )));
        }
        if meta.modified().ok() != self.modified {
            return Err(io::Error::other(format!(
                "{}: the file was modified since the store was built; reload the model",
                self.path.display()
            )));
        }
        Ok(())
    }
}

/// Converts whole groups of the file's bytes into the stored bytes: `(src, dst)`, `src` a
/// whole number of file groups and `dst` the same number of stored groups.
pub(crate) type ConvertFn = dyn Fn(&[u8], &mut [u8]) -> Result<(), String> + Send + Sync;

/// How a segment's file bytes become the unit's bytes: groups of `from_group` file bytes
/// (one element of a float dtype, one GGML block) become groups of `to_group` stored bytes.
/// The function is the store's (passed in so that this module stays a leaf).
#[derive(Clone)]
pub(crate) struct Conversion {
    /// What it converts, for messages (`F32 -> F16`, `Q8_0 -> F32`).
    pub what: Arc<str>,
    /// File bytes per group.
    pub from_group: usize,
    /// Stored bytes per group.
    pub to_group: usize,
    /// Converts whole groups.
    pub convert: Arc<ConvertFn>,
}

impl std::fmt::Debug for Conversion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Conversion({}, {} -> {} bytes per group)",
            self.what, self.from_group, self.to_group
        )
    }
}

/// One run of a disk unit's bytes: `len` bytes at `at` in the unit's layout, read from the
/// file at `file_offset` (a tensor, or a run of its rows).
#[derive(Debug, Clone)]
pub(crate) struct Segment {
    /// The file.
    pub file: Arc<DiskFile>,
    /// The tensor (for messages; shared by the segments of its row runs).
    pub name: Arc<str>,
    /// Offset in the unit's layout.
    pub at: usize,
    /// Bytes in the unit's layout (after conversion).
    pub len: usize,
    /// Offset of its first byte in the file.
    pub file_offset: u64,
    /// `None` when the file holds the stored bytes as they are.
    pub conversion: Option<Conversion>,
}

impl Segment {
    /// Bytes it takes in the file.
    pub(crate) fn file_len(&self) -> usize {
        match &self.conversion {
            None => self.len,
            Some(c) => self.len / c.to_group * c.from_group,
        }
    }

    /// The file range holding bytes `part` (relative to the segment) of the unit, widened to
    /// whole groups of a conversion, and how many converted bytes precede `part.start` in it.
    fn file_range(&self, part: &Range<usize>) -> (Range<u64>, usize) {
        match &self.conversion {
            None => (
                self.file_offset + part.start as u64..self.file_offset + part.end as u64,
                0,
            ),
            Some(c) => {
                let (g0, g1) = (part.start / c.to_group, part.end.div_ceil(c.to_group));
                (
                    self.file_offset + (g0 * c.from_group) as u64
                        ..self.file_offset + (g1 * c.from_group) as u64,
                    part.start - g0 * c.to_group,
                )
            }
        }
    }
}

/// One segment's share of a read: its file bytes and where they go.
struct Piece<'a> {
    seg: &'a Segment,
    file: Range<u64>,
    /// Converted bytes to drop before `dst` starts.
    skip: usize,
    /// Destination range, relative to the read's start.
    dst: Range<usize>,
}

/// The bytes of a unit in its file(s): what a read needs, shared with read-ahead jobs.
#[derive(Debug)]
pub(crate) struct DiskUnit {
    unit: String,
    len: usize,
    segments: Vec<Segment>,
    /// How its reads are cut up.
    shape: ReadShape,
}

impl DiskUnit {
    /// An error naming the unit and the file, unless every file it reads still has the size
    /// and modification time it had.
    fn check_files(&self) -> io::Result<()> {
        let mut checked: Vec<&Path> = Vec::new();
        for s in &self.segments {
            if !checked.contains(&s.file.path()) {
                s.file.check_unchanged().map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!(
                            "reading unit {} from {}: {e}",
                            self.unit,
                            s.file.path().display()
                        ),
                    )
                })?;
                checked.push(s.file.path());
            }
        }
        Ok(())
    }

    /// Reads `range` of the unit's layout into `dst` (its length), zeros between segments.
    fn read(&self, range: Range<usize>, dst: &mut [u8]) -> io::Result<()> {
        self.read_shaped(range, dst, self.shape)
    }

    /// [`read`](Self::read) with its plain tensors read in `shape`.
    fn read_shaped(&self, range: Range<usize>, dst: &mut [u8], shape: ReadShape) -> io::Result<()> {
        if range.end > self.len || range.start > range.end || range.len() != dst.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "unit {}: cannot read {range:?} of {} bytes into {} bytes",
                    self.unit,
                    self.len,
                    dst.len()
                ),
            ));
        }
        let mut pieces = Vec::new();
        for s in &self.segments {
            let (a, b) = (range.start.max(s.at), range.end.min(s.at + s.len));
            if a >= b {
                continue;
            }
            let (file, skip) = s.file_range(&(a - s.at..b - s.at));
            pieces.push(Piece {
                seg: s,
                file,
                skip,
                dst: a - range.start..b - range.start,
            });
        }
        // The bytes no segment covers (alignment gaps) read as zeros; the rest is overwritten
        // below, so only the gaps are written here (a staging buffer is reused unzeroed).
        let mut covered: Vec<Range<usize>> = pieces.iter().map(|p| p.dst.clone()).collect();
        covered.sort_by_key(|r| r.start);
        let mut at = 0;
        for r in covered
            .iter()
            .chain(std::iter::once(&(dst.len()..dst.len())))
        {
            if r.start > at {
                dst[at..r.start].fill(0);
            }
            at = at.max(r.end);
        }
        let named = |s: &Segment, e: io::Error| {
            let what = if e.kind() == io::ErrorKind::UnexpectedEof {
                "the file is shorter than when the store was built".to_string()
            } else {
                e.to_string()
            };
            io::Error::new(
                e.kind(),
                format!(
                    "reading unit {} (tensor {}) from {}: {what}",
                    self.unit,
                    s.name,
                    s.file.path().display()
                ),
            )
        };
        let mut checked: Vec<&Path> = Vec::new();
        for p in &pieces {
            if !checked.contains(&p.seg.file.path()) {
                p.seg.file.check_unchanged().map_err(|e| named(p.seg, e))?;
                checked.push(p.seg.file.path());
            }
        }
        // Runs of pieces whose file ranges (nearly) touch, each read with one `pread`; a run
        // that is one tensor read as it is goes to `plain`, read last through one queue.
        pieces.sort_by_key(|p| (Arc::as_ptr(&p.seg.file) as usize, p.file.start));
        let mut plain: Vec<&Piece> = Vec::new();
        let mut i = 0;
        while i < pieces.len() {
            let first = &pieces[i];
            let (start, mut end, mut j) = (first.file.start, first.file.end, i + 1);
            while j < pieces.len()
                && Arc::ptr_eq(&pieces[j].seg.file, &first.seg.file)
                && pieces[j].file.start <= end + MERGE_GAP
                && pieces[j].file.end.max(end) - start <= MAX_RUN
            {
                end = end.max(pieces[j].file.end);
                j += 1;
            }
            let run = &pieces[i..j];
            if let [p] = run {
                if p.seg.conversion.is_none() {
                    plain.push(p);
                    i = j;
                    continue;
                }
            }
            let mut buf = vec![0u8; (end - start) as usize];
            first
                .seg
                .file
                .read_exact_shaped(&mut buf, start, self.shape)
                .map_err(|e| named(first.seg, e))?;
            for p in run {
                let src = &buf[(p.file.start - start) as usize..(p.file.end - start) as usize];
                let out = &mut dst[p.dst.clone()];
                match &p.seg.conversion {
                    None => out.copy_from_slice(src),
                    Some(c) => {
                        let conv_len = src.len() / c.from_group * c.to_group;
                        let failed = |e| named(p.seg, io::Error::other(format!("{}: {e}", c.what)));
                        if p.skip == 0 && conv_len == out.len() {
                            // Whole groups: converted straight into place.
                            (c.convert)(src, out).map_err(failed)?;
                        } else {
                            let mut conv = vec![0u8; conv_len];
                            (c.convert)(src, &mut conv).map_err(failed)?;
                            out.copy_from_slice(&conv[p.skip..p.skip + out.len()]);
                        }
                    }
                }
            }
            i = j;
        }
        read_plain(&plain, dst, shape).map_err(|(seg, e)| named(seg, e))
    }
}

/// Reads tensors stored as they are (`pieces`, in file order, disjoint in `dst`) through one
/// [`read_queue`] of their pieces, so that as many requests stay in flight from the unit's
/// first byte to its last (a tensor at a time would wait for each tensor's slowest piece); an
/// error comes with its segment.
fn read_plain<'a>(
    pieces: &[&Piece<'a>],
    dst: &mut [u8],
    shape: ReadShape,
) -> Result<(), (&'a Segment, io::Error)> {
    // The requests, in file order, each with its own slice of `dst`.
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by_key(|&k| pieces[k].dst.start);
    let mut slices: Vec<Option<&mut [u8]>> = (0..pieces.len()).map(|_| None).collect();
    let (mut rest, mut at) = (dst, 0usize);
    for k in order {
        let r = &pieces[k].dst;
        let (_, tail) = rest.split_at_mut(r.start - at);
        let (mine, tail) = tail.split_at_mut(r.len());
        slices[k] = Some(mine);
        (rest, at) = (tail, r.end);
    }
    let mut queue = Vec::new();
    for (p, slice) in pieces.iter().zip(slices) {
        let slice = slice.unwrap_or_default();
        push_pieces(
            &mut queue,
            &p.seg.file,
            p.file.start,
            slice,
            shape.piece,
            p.seg,
        );
    }
    read_queue(queue, shape)
}

/// One request of a queued read: `dst` from byte `pos` of `file`, and what an error names.
struct Request<'a, T> {
    file: &'a DiskFile,
    pos: u64,
    dst: &'a mut [u8],
    tag: T,
}

/// Queues the requests that fill `dst` from byte `pos` of `file`, cut at `piece` boundaries
/// of the file.
fn push_pieces<'a, T: Copy>(
    queue: &mut Vec<Request<'a, T>>,
    file: &'a DiskFile,
    mut pos: u64,
    mut dst: &'a mut [u8],
    piece: u64,
    tag: T,
) {
    while !dst.is_empty() {
        let take = ((pos / piece + 1) * piece - pos).min(dst.len() as u64);
        let (head, tail) = dst.split_at_mut(take as usize);
        queue.push(Request {
            file,
            pos,
            dst: head,
            tag,
        });
        (dst, pos) = (tail, pos + take);
    }
}

/// Reads the queued requests, in their order, by up to `shape.threads` threads taking the next
/// one as they finish one (on the calling thread when one is enough), so that as many stay in
/// flight from the first to the last. Every thread is joined; the first error is returned with
/// its request's tag, and no request starts after it.
fn read_queue<T: Copy + Send>(
    mut queue: Vec<Request<'_, T>>,
    shape: ReadShape,
) -> Result<(), (T, io::Error)> {
    let threads = shape.threads.min(queue.len());
    if threads <= 1 {
        let mut scratch = None;
        for r in queue {
            r.file
                .read_run(r.dst, r.pos, shape.piece, &mut scratch)
                .map_err(|e| (r.tag, e))?;
        }
        return Ok(());
    }
    let first_tag = queue[0].tag;
    queue.reverse(); // popped from the end: in order
    let queue = Mutex::new(queue);
    let failed = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut scratch = None;
                    loop {
                        if failed.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
                        let Some(r) = next else {
                            return Ok(());
                        };
                        if let Err(e) = r.file.read_run(r.dst, r.pos, shape.piece, &mut scratch) {
                            failed.store(true, Ordering::Relaxed);
                            return Err((r.tag, e));
                        }
                    }
                })
            })
            .collect();
        let mut first = Ok(());
        for h in handles {
            let r = h.join().unwrap_or_else(|_| {
                Err((first_tag, io::Error::other("a disk read thread panicked")))
            });
            if first.is_ok() {
                first = r;
            }
        }
        first
    })
}

/// Where a unit's read-ahead stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadAhead {
    /// None issued (or it was dropped).
    None,
    /// Issued, still reading.
    InFlight,
    /// Read: the bytes are in host memory (or the read failed, and the fetch reads again).
    Ready,
}

/// A staging buffer kept for the next read-ahead of the same size, so that a unit's read does
/// not first allocate and fault in (and afterwards unmap) hundreds of megabytes.
type Spare = Arc<Mutex<Option<PageableBuffer>>>;

/// A read-ahead's outcome, once a reader thread has finished it.
#[derive(Debug)]
struct Staged {
    result: Mutex<Option<io::Result<PageableBuffer>>>,
    done: Condvar,
    /// Set when nobody needs the bytes any more: a job not started yet skips the read.
    dropped: AtomicBool,
    /// Where its buffer goes when it is dropped (the pool's one spare, if that is empty).
    spare: Spare,
}

impl Drop for Staged {
    fn drop(&mut self) {
        let result = self.result.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(Ok(buf)) = result.take() {
            let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
            if spare.is_none() {
                *spare = Some(buf);
            }
        }
    }
}

impl Staged {
    fn lock(&self) -> MutexGuard<'_, Option<io::Result<PageableBuffer>>> {
        self.result.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn finish(&self, r: io::Result<PageableBuffer>) {
        let mut g = self.lock();
        if g.is_none() {
            *g = Some(r);
        }
        self.done.notify_all();
    }

    /// Waits until the read has finished.
    fn wait(&self) -> MutexGuard<'_, Option<io::Result<PageableBuffer>>> {
        let mut g = self.lock();
        while g.is_none() {
            g = self.done.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g
    }
}

/// One unit to read ahead. Dropped without running (the pool closing), it finishes its
/// read-ahead as failed, so that nothing waits for it.
struct ReadJob {
    unit: Arc<DiskUnit>,
    staged: Arc<Staged>,
}

impl ReadJob {
    fn run(self) {
        if self.staged.dropped.load(Ordering::Relaxed) {
            return;
        }
        let len = self.unit.len;
        let spare = self
            .staged
            .spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let mut buf = spare
            .filter(|b| b.len() == len)
            .unwrap_or_else(|| PageableBuffer::zeroed(len));
        let read = match buf.bytes_mut() {
            Some(dst) => self.unit.read(0..len, dst),
            None => Err(io::Error::other("a pageable buffer without bytes")),
        };
        tracing::trace!(unit = %self.unit.unit, bytes = len, ok = read.is_ok(), "read ahead");
        self.staged.finish(read.map(|()| buf));
    }
}

impl Drop for ReadJob {
    fn drop(&mut self) {
        self.staged
            .finish(Err(io::Error::other("the read-ahead was dropped unread")));
    }
}

/// Reader threads for read-ahead: a unit's whole bytes read from its file into host memory
/// ahead of its fetch. Jobs run in the order given; dropping the pool skips the jobs not
/// started and waits for those running.
#[derive(Debug)]
pub(crate) struct ReadPool {
    tx: Option<mpsc::Sender<ReadJob>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    closing: Arc<AtomicBool>,
    /// One staging buffer kept from a finished read-ahead for the next (see [`Spare`]): the
    /// staging is then at most the read-aheads in flight plus this one, and in steady state
    /// the next read-ahead takes it right after a fetch ends the one that left it.
    spare: Spare,
}

impl ReadPool {
    /// A pool of `threads` reader threads (at least one).
    pub(crate) fn new(threads: usize) -> io::Result<Self> {
        let (tx, rx) = mpsc::channel::<ReadJob>();
        let rx = Arc::new(Mutex::new(rx));
        let closing = Arc::new(AtomicBool::new(false));
        let mut pool = Self {
            tx: Some(tx),
            threads: Vec::new(),
            closing: closing.clone(),
            spare: Spare::default(),
        };
        for i in 0..threads.max(1) {
            let (rx, closing) = (rx.clone(), closing.clone());
            let handle = std::thread::Builder::new()
                .name(format!("offload-read-{i}"))
                .spawn(move || loop {
                    let job = match rx.lock() {
                        Ok(r) => r.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) if !closing.load(Ordering::Relaxed) => job.run(),
                        Ok(job) => drop(job),
                        Err(_) => return,
                    }
                })?;
            pool.threads.push(handle);
        }
        Ok(pool)
    }

    /// How many reader threads it has.
    pub(crate) fn threads(&self) -> usize {
        self.threads.len()
    }

    fn submit(&self, job: ReadJob) {
        // A pool whose threads are gone drops the job, which finishes it as failed.
        if let Some(tx) = &self.tx {
            let _ = tx.send(job);
        }
    }
}

impl Drop for ReadPool {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Relaxed);
        self.tx.take();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// A unit that lives in its checkpoint file(s).
#[derive(Debug)]
pub(crate) struct DiskTier {
    inner: Arc<DiskUnit>,
    /// Its read-ahead, issued and not yet ended.
    staged: Mutex<Option<Arc<Staged>>>,
}

impl DiskTier {
    fn staged(&self) -> MutexGuard<'_, Option<Arc<Staged>>> {
        self.staged.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl DiskTier {
    /// A unit of `len` bytes made of `segments` (inside `0..len`, not overlapping), read in
    /// `shape`; each segment's file range is checked against the file's size.
    pub(crate) fn new(
        unit: &str,
        len: usize,
        mut segments: Vec<Segment>,
        shape: ReadShape,
    ) -> SysResult<Self> {
        segments.sort_by_key(|s| s.at);
        let mut end = 0;
        for s in &segments {
            let bad = |reason: String| SysError::File {
                path: s.file.path().to_path_buf(),
                reason: format!("unit {unit}, tensor {}: {reason}", s.name),
            };
            if s.at < end || s.at + s.len > len {
                return Err(bad(format!(
                    "bytes {}..{} do not fit the unit's layout of {len} bytes",
                    s.at,
                    s.at + s.len
                )));
            }
            if let Some(c) = &s.conversion {
                if c.to_group == 0 || c.from_group == 0 || s.len % c.to_group != 0 {
                    return Err(bad(format!(
                        "{} bytes are not whole groups of {} ({})",
                        s.len, c.to_group, c.what
                    )));
                }
            }
            if s.file_offset + s.file_len() as u64 > s.file.len() {
                return Err(bad(format!(
                    "its data ({} bytes at {}) is past the end of the file ({} bytes)",
                    s.file_len(),
                    s.file_offset,
                    s.file.len()
                )));
            }
            end = s.at + s.len;
        }
        // Tries O_DIRECT now, so that a file system without it is warned about at load.
        for s in &segments {
            s.file.reads_direct();
        }
        Ok(Self {
            inner: Arc::new(DiskUnit {
                unit: unit.to_string(),
                len,
                segments,
                shape,
            }),
            staged: Mutex::new(None),
        })
    }
}

impl HostTier for DiskTier {
    fn kind(&self) -> TierKind {
        TierKind::Disk
    }
    fn len(&self) -> usize {
        self.inner.len
    }
    fn bytes(&self) -> Option<&[u8]> {
        None
    }
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
    fn read_into(&self, range: Range<usize>, dst: &mut [u8]) -> io::Result<()> {
        let staged = self.staged().clone();
        if let Some(staged) = staged {
            let result = staged.wait();
            if let Some(Ok(buf)) = &*result {
                // The bytes were read earlier: the file must still be the one they came from.
                self.inner.check_files()?;
                let src = buf
                    .bytes()
                    .and_then(|b| b.get(range.clone()))
                    .filter(|b| b.len() == dst.len());
                if let Some(src) = src {
                    dst.copy_from_slice(src);
                    return Ok(());
                }
            } else {
                // Failed or dropped: read from the file, which reports its own error.
                drop(result);
                self.staged().take();
            }
        }
        self.inner.read(range, dst)
    }
    fn read_ahead(&self, pool: &ReadPool) -> bool {
        let mut slot = self.staged();
        if slot.is_some() {
            return false;
        }
        let staged = Arc::new(Staged {
            result: Mutex::new(None),
            done: Condvar::new(),
            dropped: AtomicBool::new(false),
            spare: pool.spare.clone(),
        });
        *slot = Some(staged.clone());
        drop(slot);
        pool.submit(ReadJob {
            unit: self.inner.clone(),
            staged,
        });
        true
    }
    fn read_ahead_state(&self) -> ReadAhead {
        match &*self.staged() {
            None => ReadAhead::None,
            Some(s) if s.lock().is_some() => ReadAhead::Ready,
            Some(_) => ReadAhead::InFlight,
        }
    }
    fn reads_direct(&self) -> bool {
        self.inner.segments.iter().all(|s| s.file.reads_direct())
    }
    fn end_read_ahead(&self) {
        if let Some(s) = self.staged().take() {
            s.dropped.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_to_f16(src: &[u8], dst: &mut [u8]) -> Result<(), String> {
        for (i, c) in src.chunks_exact(4).enumerate() {
            let x = f32::from_le_bytes(c.try_into().unwrap());
            dst[2 * i..2 * i + 2].copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
        }
        Ok(())
    }

    /// Tensor `name`'s `len` bytes at `at` in the unit, stored as they are at `file_offset`.
    fn plain(file: &Arc<DiskFile>, name: &str, at: usize, len: usize, file_offset: u64) -> Segment {
        Segment {
            file: file.clone(),
            name: name.into(),
            at,
            len,
            file_offset,
            conversion: None,
        }
    }

    #[test]
    fn reads_segments_converts_and_refuses_a_changed_file() -> anyhow::Result<()> {
        let tmp = tempfile::Builder::new()
            .prefix("candle-offload-disk-")
            .tempdir()?;
        let dir = tmp.path();
        let path = dir.join("w.bin");
        let values = [1.0f32, 2.0, 3.0, 4.0];
        let mut data = vec![9u8, 9, 9];
        data.extend(values.iter().flat_map(|x| x.to_le_bytes()));
        std::fs::write(&path, &data)?;
        let file = DiskFile::open(&path, false)?;
        let seg = |at, len, conversion| Segment {
            file: file.clone(),
            name: "t".into(),
            at,
            len,
            file_offset: 3,
            conversion,
        };
        // Raw bytes at offset 4 of an 24-byte unit, zeros around them.
        let tier = DiskTier::new("u", 24, vec![seg(4, 16, None)], ReadShape::DEFAULT)?;
        let mut out = vec![7u8; 24];
        tier.read_into(0..24, &mut out)?;
        assert_eq!(&out[..4], &[0; 4]);
        assert_eq!(&out[4..20], &data[3..]);
        assert_eq!(&out[20..], &[0; 4]);
        // A read that starts and ends inside elements of a converted segment.
        let conv = Conversion {
            what: "F32 -> F16".into(),
            from_group: 4,
            to_group: 2,
            convert: Arc::new(f32_to_f16),
        };
        let tier = DiskTier::new(
            "u",
            8,
            vec![seg(0, 8, Some(conv.clone()))],
            ReadShape::DEFAULT,
        )?;
        let mut all = vec![0u8; 8];
        tier.read_into(0..8, &mut all)?;
        let want: Vec<u8> = values
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect();
        assert_eq!(all, want);
        let mut mid = vec![0u8; 5];
        tier.read_into(1..6, &mut mid)?;
        assert_eq!(mid, want[1..6]);
        assert!(tier.read_into(4..9, &mut [0u8; 5]).is_err());
        // Rows in reverse order, one segment per row (as a GGUF's q/k rows): gathered from one
        // read, raw and converted, whole and in part.
        let rows = |width: usize, conversion: Option<Conversion>| {
            let segments = (0..4)
                .map(|k| Segment {
                    file_offset: 3 + 4 * k as u64,
                    ..seg((3 - k) * width, width, conversion.clone())
                })
                .collect();
            DiskTier::new("u", 4 * width, segments, ReadShape::DEFAULT)
        };
        let reversed: Vec<u8> = data[3..].chunks(4).rev().flatten().copied().collect();
        let mut out = vec![0u8; 16];
        rows(4, None)?.read_into(0..16, &mut out)?;
        assert_eq!(out, reversed);
        let mut part = vec![0u8; 9];
        rows(4, None)?.read_into(5..14, &mut part)?;
        assert_eq!(part, reversed[5..14]);
        let want_rev: Vec<u8> = want.chunks(2).rev().flatten().copied().collect();
        let mut out = vec![0u8; 8];
        rows(2, Some(conv))?.read_into(0..8, &mut out)?;
        assert_eq!(out, want_rev);
        // A segment past the end of the file is refused when the tier is made.
        let e = DiskTier::new("u", 64, vec![seg(0, 20, None)], ReadShape::DEFAULT).unwrap_err();
        assert!(e.to_string().contains("w.bin"), "{e}");
        // The file shrinks: the next read names it.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)?
            .set_len(10)?;
        let e = tier.read_into(0..8, &mut all).unwrap_err().to_string();
        assert!(e.contains("w.bin") && e.contains("unit u"), "{e}");
        Ok(())
    }

    #[test]
    fn merged_reads_stop_at_their_bound() -> anyhow::Result<()> {
        // Four 3 MiB rows in reverse order: adjacent in the file, but past `MAX_RUN` together.
        let tmp = tempfile::Builder::new()
            .prefix("candle-offload-runs-")
            .tempdir()?;
        let dir = tmp.path();
        let path = dir.join("rows.bin");
        let row = 3 << 20;
        let data: Vec<u8> = (0..4 * row).map(|i| (i / 4099 % 251) as u8).collect();
        std::fs::write(&path, &data)?;
        let file = DiskFile::open(&path, false)?;
        let segments = (0..4)
            .map(|k| plain(&file, "t", (3 - k) * row, row, (k * row) as u64))
            .collect();
        let tier = DiskTier::new("u", 4 * row, segments, ReadShape::DEFAULT)?;
        let mut out = vec![0u8; 4 * row];
        tier.read_into(0..4 * row, &mut out)?;
        for k in 0..4 {
            assert!(
                out[(3 - k) * row..(4 - k) * row] == data[k * row..(k + 1) * row],
                "row {k}"
            );
        }
        Ok(())
    }

    /// Reads with O_DIRECT equal reads through the page cache, at any offset and length, past
    /// `MAX_RUN` and up to the file's unaligned end; where O_DIRECT cannot be had (a file
    /// system that refuses it, a path gone), the file is read through the page cache instead.
    #[test]
    fn direct_reads_equal_page_cache_reads_or_fall_back() -> anyhow::Result<()> {
        let dirs = [std::env::temp_dir(), PathBuf::from("/dev/shm")];
        for base in dirs.iter().filter(|d| d.is_dir()) {
            let tmp = tempfile::Builder::new()
                .prefix("candle-offload-direct-")
                .tempdir_in(base)?;
            let dir = tmp.path();
            let path = dir.join("w.bin");
            // Long enough for a read cut into more pieces than `READ_PARALLEL` threads.
            let len = (41 << 20) + 1234;
            let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
            std::fs::write(&path, &data)?;
            let direct = DiskFile::open(&path, true)?;
            let cached = DiskFile::open(&path, false)?;
            assert!(!cached.reads_direct());
            eprintln!("{}: O_DIRECT {}", dir.display(), direct.reads_direct());
            for (offset, n) in [
                (0, 10),
                (4095, 2),
                (4096, 4096),
                (777, 3 << 20),
                (5, len - 5),
                (len - 3000, 3000),
            ] {
                let (mut a, mut b) = (vec![0u8; n], vec![1u8; n]);
                direct.read_exact_at(&mut a, offset as u64)?;
                cached.read_exact_at(&mut b, offset as u64)?;
                assert!(a == b && a == data[offset..offset + n], "{offset}+{n}");
                // Other shapes: one thread, more threads than pieces, pieces that are not a
                // power of two, pieces larger than the default.
                for (threads, piece) in [(1, 3 << 20), (3, (1 << 20) + 4096), (16, 32 << 20)] {
                    let shape = ReadShape { threads, piece };
                    let mut c = vec![2u8; n];
                    direct.read_exact_shaped(&mut c, offset as u64, shape)?;
                    assert!(c == a, "{offset}+{n} in {shape:?}");
                    cached.read_exact_shaped(&mut c, offset as u64, shape)?;
                    assert!(c == a, "{offset}+{n} in {shape:?}, page cache");
                }
            }
            let e = direct
                .read_exact_at(&mut [0u8; 10], len as u64 - 5)
                .unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
            // A long read past the end fails in its last piece, on whichever thread reads it.
            for f in [&direct, &cached] {
                let mut a = vec![0u8; 20 << 20];
                let e = f
                    .read_exact_at(&mut a, len as u64 - (20 << 20) + 7)
                    .unwrap_err();
                assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
            }
            // O_DIRECT that cannot be had (here: the path is gone by the time the first disk
            // unit tries it) leaves the page cache, through the handle already open.
            let late = DiskFile::open(&path, true)?;
            std::fs::rename(&path, dir.join("moved.bin"))?;
            assert!(!late.reads_direct());
            let mut a = vec![0u8; 5000];
            late.read_exact_at(&mut a, 123)?;
            assert!(a == data[123..5123]);
        }
        Ok(())
    }

    #[test]
    fn read_ahead_serves_reads_and_still_checks_the_file() -> anyhow::Result<()> {
        let tmp = tempfile::Builder::new()
            .prefix("candle-offload-readahead-")
            .tempdir()?;
        let dir = tmp.path();
        let path = dir.join("w.bin");
        let data: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        std::fs::write(&path, &data)?;
        let file = DiskFile::open(&path, false)?;
        let tier = DiskTier::new(
            "u",
            10_000,
            vec![plain(&file, "t", 0, 10_000, 0)],
            ReadShape::DEFAULT,
        )?;
        let pool = ReadPool::new(2)?;
        assert_eq!(tier.read_ahead_state(), ReadAhead::None);
        assert!(tier.read_ahead(&pool));
        assert!(!tier.read_ahead(&pool), "one read-ahead per unit at a time");
        let mut out = vec![0u8; 300];
        tier.read_into(5000..5300, &mut out)?;
        assert_eq!(out, data[5000..5300]);
        assert_eq!(tier.read_ahead_state(), ReadAhead::Ready);
        // The staged bytes are not handed out once the file has changed.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)?
            .set_len(5000)?;
        let e = tier.read_into(0..300, &mut out).unwrap_err().to_string();
        assert!(e.contains("w.bin") && e.contains("unit u"), "{e}");
        tier.end_read_ahead();
        assert_eq!(tier.read_ahead_state(), ReadAhead::None);
        // A read-ahead whose read fails leaves the read to the file, which names it.
        assert!(tier.read_ahead(&pool));
        let e = tier.read_into(0..300, &mut out).unwrap_err().to_string();
        assert!(e.contains("w.bin") && e.contains("changed size"), "{e}");
        // Jobs the pool drops unread never leave a reader waiting.
        std::fs::write(&path, &data)?;
        let tier = DiskTier::new(
            "v",
            10_000,
            vec![plain(&DiskFile::open(&path, false)?, "t", 0, 10_000, 0)],
            ReadShape::DEFAULT,
        )?;
        let pool = ReadPool::new(1)?;
        tier.read_ahead(&pool);
        drop(pool);
        tier.read_into(0..300, &mut out)?;
        assert_eq!(out, data[..300]);
        Ok(())
    }

    /// A read-ahead reuses the buffer the one before it left (not zeroed): the gaps between
    /// its segments still read as zeros, whatever the buffer held.
    #[test]
    fn a_reused_staging_buffer_reads_its_gaps_as_zeros() -> anyhow::Result<()> {
        let tmp = tempfile::Builder::new()
            .prefix("candle-offload-spare-")
            .tempdir()?;
        let dir = tmp.path();
        let path = dir.join("w.bin");
        let data: Vec<u8> = (0..4000u32).map(|i| (i % 251) as u8 | 1).collect();
        std::fs::write(&path, &data)?;
        let file = DiskFile::open(&path, false)?;
        let seg = |at, len, file_offset| plain(&file, "t", at, len, file_offset);
        // The same length; the first covers every byte, the second leaves 0..256 and
        // 1256..1512 as gaps.
        let full = DiskTier::new("full", 2000, vec![seg(0, 2000, 0)], ReadShape::DEFAULT)?;
        let gappy = DiskTier::new(
            "gappy",
            2000,
            vec![seg(256, 1000, 7), seg(1512, 488, 3000)],
            ReadShape::DEFAULT,
        )?;
        let pool = ReadPool::new(1)?;
        for _ in 0..3 {
            for tier in [&full, &gappy] {
                assert!(tier.read_ahead(&pool));
                let mut out = vec![0xAAu8; 2000];
                tier.read_into(0..2000, &mut out)?;
                tier.end_read_ahead();
                let mut direct = vec![0x55u8; 2000];
                tier.inner.read(0..2000, &mut direct)?;
                assert_eq!(out, direct, "read-ahead equals a plain read");
            }
        }
        let mut out = vec![0xAAu8; 2000];
        gappy.inner.read(0..2000, &mut out)?;
        assert!(out[..256].iter().chain(&out[1256..1512]).all(|&b| b == 0));
        assert_eq!(out[256..1256], data[7..1007]);
        assert_eq!(out[1512..], data[3000..3488]);
        assert!(full.inner.read(0..2000, &mut out).is_ok() && out == data[..2000]);
        Ok(())
    }

    /// A unit of several tensors longer than a piece, stored out of file order, reads the
    /// same in every shape, whole or in part, with O_DIRECT or not; a file cut short fails
    /// with the tensor's name, whichever thread meets it.
    #[test]
    fn a_unit_reads_the_same_in_every_shape() -> anyhow::Result<()> {
        let tmp = tempfile::Builder::new()
            .prefix("candle-offload-shape-")
            .tempdir()?;
        let dir = tmp.path();
        let path = dir.join("w.bin");
        let len = (7 << 20) + 333;
        let data: Vec<u8> = (0..len).map(|i| (i % 241) as u8).collect();
        std::fs::write(&path, &data)?;
        for direct in [false, true] {
            let file = DiskFile::open(&path, direct)?;
            let seg = |name, at, len, file_offset| plain(&file, name, at, len, file_offset);
            // a: 3 MiB + 5 at file 1 MiB + 17; b: 2 MiB + 100 at file 5; c: 1 MiB at file 4 MiB + 500.
            let (a, b, c) = ((3 << 20) + 5, (2 << 20) + 100, 1 << 20);
            let unit_len = a + b + c + 4096;
            let tier = DiskTier::new(
                "u",
                unit_len,
                vec![
                    seg("a", 0, a, (1 << 20) + 17),
                    seg("b", a + 4096, b, 5),
                    seg("c", a + 4096 + b, c, (4 << 20) + 500),
                ],
                ReadShape::DEFAULT,
            )?;
            let mut want = vec![0u8; unit_len];
            want[..a].copy_from_slice(&data[(1 << 20) + 17..(1 << 20) + 17 + a]);
            want[a + 4096..a + 4096 + b].copy_from_slice(&data[5..5 + b]);
            want[a + 4096 + b..].copy_from_slice(&data[(4 << 20) + 500..(4 << 20) + 500 + c]);
            for (threads, piece) in [(1, 1 << 20), (4, 1 << 20), (3, 700_000), (8, 8 << 20)] {
                let shape = ReadShape { threads, piece };
                for range in [0..unit_len, 17..a + 5000, a + 4000..unit_len - 9] {
                    let mut out = vec![0x5Au8; range.len()];
                    tier.inner.read_shaped(range.clone(), &mut out, shape)?;
                    assert!(
                        out == want[range.clone()],
                        "{shape:?} {range:?} direct {direct}"
                    );
                }
            }
        }
        // Past the end of the file in tensor c's last pieces: the error is c's, whichever
        // thread meets it, after every thread has stopped.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)?
            .set_len(6 << 20)?;
        let file = DiskFile::open(&path, false)?;
        let seg = |name, at: usize, len| plain(&file, name, at, len, at as u64);
        let (sa, sc) = (seg("a", 0, 4 << 20), seg("c", 4 << 20, 3 << 20));
        fn piece(seg: &Segment) -> Piece<'_> {
            Piece {
                seg,
                file: seg.file_offset..seg.file_offset + seg.len as u64,
                skip: 0,
                dst: seg.at..seg.at + seg.len,
            }
        }
        let (pa, pc) = (piece(&sa), piece(&sc));
        let mut out = vec![0u8; 7 << 20];
        for threads in [1, 4] {
            let shape = ReadShape {
                threads,
                piece: 1 << 20,
            };
            let (seg, e) = read_plain(&[&pa, &pc], &mut out, shape).unwrap_err();
            assert_eq!((&*seg.name, e.kind()), ("c", io::ErrorKind::UnexpectedEof));
        }
        Ok(())
    }
}
