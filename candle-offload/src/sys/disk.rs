//! The disk tier: a unit whose bytes stay in its checkpoint file, read on demand with
//! positioned reads (`pread`, through the page cache; no O_DIRECT or io_uring yet).
//!
//! A unit's buffer is virtual here: each tensor is a [`Segment`] mapping a byte range of the
//! unit's layout to a byte range of a file, with an optional element conversion (an F32
//! checkpoint stored as F16); the alignment gaps between tensors read as zeros, as the
//! in-memory tiers hold them. Every read first checks that the file still has the size and
//! modification time it had when the store was built, so a file that changed or shrank is an
//! error naming it, never wrong weights or a panic.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use candle_core::DType;

use super::{HostTier, SysError, SysResult, TierKind};

/// A checkpoint file kept open for the disk tier, with what it looked like when opened.
#[derive(Debug)]
pub(crate) struct DiskFile {
    path: PathBuf,
    file: File,
    len: u64,
    modified: Option<SystemTime>,
}

impl DiskFile {
    /// Opens `path` for positioned reads and records its size and modification time.
    pub(crate) fn open(path: &Path) -> SysResult<Arc<Self>> {
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
        }))
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

/// Converts whole elements: `(src, from, dst, to)`.
pub(crate) type ConvertFn = fn(&[u8], DType, &mut [u8], DType) -> Result<(), String>;

/// How a segment's file bytes become the unit's bytes: elements of `from` converted to `to`
/// by `convert` (the store's float conversion, passed in so that this module stays a leaf).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Conversion {
    /// The file's dtype.
    pub from: DType,
    /// The stored dtype.
    pub to: DType,
    /// Converts whole elements.
    pub convert: ConvertFn,
}

/// One tensor of a disk unit: `len` bytes at `at` in the unit's layout, read from the file at
/// `file_offset`.
#[derive(Debug, Clone)]
pub(crate) struct Segment {
    /// The file.
    pub file: Arc<DiskFile>,
    /// The tensor (for messages).
    pub name: String,
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
        match self.conversion {
            None => self.len,
            Some(c) => self.len / c.to.size_in_bytes() * c.from.size_in_bytes(),
        }
    }

    /// Reads bytes `part` (relative to the segment) into `dst`.
    fn read(&self, part: Range<usize>, dst: &mut [u8]) -> io::Result<()> {
        let Some(c) = self.conversion else {
            return self
                .file
                .file
                .read_exact_at(dst, self.file_offset + part.start as u64);
        };
        // Whole elements around the part, converted, then the part cut out.
        let (wf, wt) = (c.from.size_in_bytes(), c.to.size_in_bytes());
        let (e0, e1) = (part.start / wt, part.end.div_ceil(wt));
        let mut src = vec![0u8; (e1 - e0) * wf];
        self.file
            .file
            .read_exact_at(&mut src, self.file_offset + (e0 * wf) as u64)?;
        let mut out = vec![0u8; (e1 - e0) * wt];
        (c.convert)(&src, c.from, &mut out, c.to).map_err(io::Error::other)?;
        let skip = part.start - e0 * wt;
        dst.copy_from_slice(&out[skip..skip + dst.len()]);
        Ok(())
    }
}

/// A unit that lives in its checkpoint file(s).
#[derive(Debug)]
pub(crate) struct DiskTier {
    unit: String,
    len: usize,
    segments: Vec<Segment>,
}

impl DiskTier {
    /// A unit of `len` bytes made of `segments` (inside `0..len`, not overlapping); each
    /// segment's file range is checked against the file's size.
    pub(crate) fn new(unit: &str, len: usize, mut segments: Vec<Segment>) -> SysResult<Self> {
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
            if let Some(c) = s.conversion {
                if s.len % c.to.size_in_bytes() != 0 {
                    return Err(bad(format!("{} bytes are not whole {:?}", s.len, c.to)));
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
        Ok(Self {
            unit: unit.to_string(),
            len,
            segments,
        })
    }
}

impl HostTier for DiskTier {
    fn kind(&self) -> TierKind {
        TierKind::Disk
    }
    fn len(&self) -> usize {
        self.len
    }
    fn bytes(&self) -> Option<&[u8]> {
        None
    }
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
    fn read_into(&self, range: Range<usize>, dst: &mut [u8]) -> io::Result<()> {
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
        dst.fill(0);
        let mut checked: Vec<&Path> = Vec::new();
        for s in &self.segments {
            let (a, b) = (range.start.max(s.at), range.end.min(s.at + s.len));
            if a >= b {
                continue;
            }
            let named = |e: io::Error| {
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
            if !checked.contains(&s.file.path()) {
                s.file.check_unchanged().map_err(named)?;
                checked.push(s.file.path());
            }
            s.read(
                a - s.at..b - s.at,
                &mut dst[a - range.start..b - range.start],
            )
            .map_err(named)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_to_f16(src: &[u8], _: DType, dst: &mut [u8], _: DType) -> Result<(), String> {
        for (i, c) in src.chunks_exact(4).enumerate() {
            let x = f32::from_le_bytes(c.try_into().unwrap());
            dst[2 * i..2 * i + 2].copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
        }
        Ok(())
    }

    #[test]
    fn reads_segments_converts_and_refuses_a_changed_file() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("candle-offload-disk-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("w.bin");
        let values = [1.0f32, 2.0, 3.0, 4.0];
        let mut data = vec![9u8, 9, 9];
        data.extend(values.iter().flat_map(|x| x.to_le_bytes()));
        std::fs::write(&path, &data)?;
        let file = DiskFile::open(&path)?;
        let seg = |at, len, conversion| Segment {
            file: file.clone(),
            name: "t".into(),
            at,
            len,
            file_offset: 3,
            conversion,
        };
        // Raw bytes at offset 4 of an 24-byte unit, zeros around them.
        let tier = DiskTier::new("u", 24, vec![seg(4, 16, None)])?;
        let mut out = vec![7u8; 24];
        tier.read_into(0..24, &mut out)?;
        assert_eq!(&out[..4], &[0; 4]);
        assert_eq!(&out[4..20], &data[3..]);
        assert_eq!(&out[20..], &[0; 4]);
        // A read that starts and ends inside elements of a converted segment.
        let conv = Conversion {
            from: DType::F32,
            to: DType::F16,
            convert: f32_to_f16,
        };
        let tier = DiskTier::new("u", 8, vec![seg(0, 8, Some(conv))])?;
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
        // A segment past the end of the file is refused when the tier is made.
        let e = DiskTier::new("u", 64, vec![seg(0, 20, None)]).unwrap_err();
        assert!(e.to_string().contains("w.bin"), "{e}");
        // The file shrinks: the next read names it.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)?
            .set_len(10)?;
        let e = tier.read_into(0..8, &mut all).unwrap_err().to_string();
        assert!(e.contains("w.bin") && e.contains("unit u"), "{e}");
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
