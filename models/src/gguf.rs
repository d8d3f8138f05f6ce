//! Reading GGUF files: the header (one error naming the file for a malformed or unreadable
//! one, a buffered reader that keeps its own position), GGML type names, checks of a tensor's
//! data range, metadata fields, and which tensors stay GGML blocks (the rule the GGUF loader
//! and quantize-on-load share).

use std::io::Seek;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType};

use crate::error::{ModelError, Result};

/// A GGUF file's header and the open file.
pub(crate) fn gguf_content(path: &Path) -> Result<(gguf_file::Content, std::fs::File)> {
    let mut file = std::fs::File::open(path)
        .map_err(|e| ModelError::file(path, format!("cannot open: {e}")))?;
    // Candle's reader panics on some malformed files (`general.alignment` = 0 divides by
    // zero): read under `catch_unwind`, with the panic hook quiet for the call, so that a bad
    // file is one error naming it. Loading happens on one thread, before anything else runs.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        gguf_file::Content::read(&mut Positioned::new(&file))
    }));
    std::panic::set_hook(hook);
    let content = match read {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            // Candle stops at a GGML type it does not know without naming the tensor: find it.
            if let Some((tensor, id)) = unreadable_tensor_type(&mut file) {
                let name = GGML_TYPE_NAMES
                    .get(id as usize)
                    .copied()
                    .unwrap_or_default();
                let name = if name.is_empty() { "unknown" } else { name };
                return Err(ModelError::Tensor {
                    path: path.to_path_buf(),
                    tensor,
                    reason: format!(
                        "GGML type {id} ({name}) is not supported: Candle 0.11 reads F32, F16, \
                         BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 and Q2_K to Q8_K (requantize \
                         the file to one of those)"
                    ),
                });
            }
            return Err(ModelError::file(
                path,
                format!("not a valid GGUF file: {e}"),
            ));
        }
        Err(panic) => {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "malformed header".into());
            return Err(ModelError::file(
                path,
                format!("not a valid GGUF file: the reader failed ({why})"),
            ));
        }
    };
    Ok((content, file))
}

/// A buffered reader that keeps its own position. Candle's GGUF parser asks for the stream
/// position before every length-prefixed value and reads each field on its own: on a bare
/// `File` that is an `lseek` and one or two `read`s per metadata string, about a million system
/// calls for a tokenizer of 49152 tokens and as many merges (0.3 s and more of a small model's
/// start, three headers read per load). Here the reads come from a buffer and the position
/// from a counter.
struct Positioned<R> {
    inner: std::io::BufReader<R>,
    pos: u64,
}

impl<R: std::io::Read> Positioned<R> {
    fn new(inner: R) -> Self {
        Self {
            inner: std::io::BufReader::with_capacity(1 << 16, inner),
            pos: 0,
        }
    }
}

impl<R: std::io::Read> std::io::Read for Positioned<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl<R: std::io::Read + Seek> Seek for Positioned<R> {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        self.pos = self.inner.seek(to)?;
        Ok(self.pos)
    }

    fn stream_position(&mut self) -> std::io::Result<u64> {
        Ok(self.pos)
    }
}

/// GGML type names by id (ggml.h; removed ids are empty), for messages.
const GGML_TYPE_NAMES: [&str; 43] = [
    "F32", "F16", "Q4_0", "Q4_1", "", "", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S",
    "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16", "", "", "", "TQ1_0", "TQ2_0", "",
    "", "", "MXFP4", "NVFP4", "Q1_0", "Q2_0",
];

/// A GGML type's name as llama.cpp writes it (`Q4_K`, where Candle's `Debug` says `Q4K`).
pub(crate) fn ggml_name(t: GgmlDType) -> String {
    let d = format!("{t:?}");
    match d.strip_suffix('K') {
        Some(stem) if !stem.contains('_') => format!("{stem}_K"),
        _ => d,
    }
}

/// The GGML type ids Candle 0.11's GGUF reader knows.
fn candle_reads_type(id: u32) -> bool {
    matches!(id, 0..=3 | 6..=15 | 30)
}

/// Reads a GGUF header field by field, never past the file's end.
struct HeaderWalk<'a> {
    r: std::io::BufReader<&'a mut std::fs::File>,
    left: u64,
    v1: bool,
}

impl HeaderWalk<'_> {
    fn bytes(&mut self, n: u64) -> Option<Vec<u8>> {
        use std::io::Read as _;
        if n > self.left {
            return None;
        }
        let mut v = vec![0u8; usize::try_from(n).ok()?];
        self.r.read_exact(&mut v).ok()?;
        self.left -= n;
        Some(v)
    }

    fn skip(&mut self, n: u64) -> Option<()> {
        use std::io::Read as _;
        if n > self.left {
            return None;
        }
        let skipped = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink()).ok()?;
        self.left -= n;
        (skipped == n).then_some(())
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.bytes(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.bytes(8)?.try_into().ok()?))
    }

    /// A count or string length: 32 bits in version 1, 64 after.
    fn len(&mut self) -> Option<u64> {
        if self.v1 {
            self.u32().map(u64::from)
        } else {
            self.u64()
        }
    }

    fn skip_value(&mut self, value_type: u32, depth: u32) -> Option<()> {
        let fixed = |t: u32| match t {
            0 | 1 | 7 => Some(1u64),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        match value_type {
            8 => {
                let n = self.len()?;
                self.skip(n)
            }
            9 if depth < 8 => {
                let t = self.u32()?;
                let n = self.len()?;
                match fixed(t) {
                    Some(size) => self.skip(n.checked_mul(size)?),
                    None => {
                        // Every element takes at least one byte.
                        if n > self.left {
                            return None;
                        }
                        (0..n).try_for_each(|_| self.skip_value(t, depth + 1))
                    }
                }
            }
            t => self.skip(fixed(t)?),
        }
    }
}

/// The first tensor of a GGUF file whose GGML type id Candle cannot read, and that id; `None`
/// when every type is readable or the header is malformed before that.
fn unreadable_tensor_type(file: &mut std::fs::File) -> Option<(String, u32)> {
    let left = file.metadata().ok()?.len();
    file.rewind().ok()?;
    let mut w = HeaderWalk {
        r: std::io::BufReader::new(file),
        left,
        v1: false,
    };
    if w.u32()? != 0x4655_4747 {
        return None;
    }
    w.v1 = w.u32()? == 1;
    let tensors = w.len()?;
    let entries = w.len()?;
    for _ in 0..entries {
        let key = w.len()?;
        w.skip(key)?;
        let t = w.u32()?;
        w.skip_value(t, 0)?;
    }
    for _ in 0..tensors {
        let n = w.len()?;
        let name = String::from_utf8_lossy(&w.bytes(n)?).into_owned();
        let dims = u64::from(w.u32()?);
        w.skip(dims.checked_mul(if w.v1 { 4 } else { 8 })?)?;
        let t = w.u32()?;
        if !candle_reads_type(t) {
            return Some((name, t));
        }
        w.u64()?;
    }
    None
}

/// Checks that a GGUF tensor's rows are whole blocks of its type and that its data lies
/// inside the file, before anything is read: one error naming the file and the tensor.
pub(crate) fn check_tensor_data(
    path: &Path,
    name: &str,
    info: &gguf_file::TensorInfo,
    data_offset: u64,
    file_len: u64,
) -> Result<()> {
    let t = info.ggml_dtype;
    let err = |reason: String| ModelError::Tensor {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        reason,
    };
    let dims = info.shape.dims();
    let row = dims.last().copied().unwrap_or(1);
    let block = t.block_size();
    if row % block != 0 {
        return Err(err(format!(
            "shape {dims:?}: its rows of {row} elements are not whole {} blocks of {block} \
             elements",
            ggml_name(t)
        )));
    }
    let elems = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64));
    let bytes = elems.and_then(|e| (e / block as u64).checked_mul(t.type_size() as u64));
    let start = data_offset.checked_add(info.offset);
    match (start, bytes) {
        (Some(start), Some(bytes)) if start.checked_add(bytes).is_some_and(|e| e <= file_len) => {
            Ok(())
        }
        (start, bytes) => Err(err(format!(
            "its {} data of shape {dims:?} ({} bytes at offset {}) runs past the end of the \
             file ({file_len} bytes): the file is truncated or its header is wrong",
            ggml_name(t),
            bytes.map_or("too many".into(), |b| b.to_string()),
            start.map_or("past 2^64".into(), |s| s.to_string()),
        ))),
    }
}

/// A metadata field, which must be present.
pub(crate) fn meta<'a>(
    c: &'a gguf_file::Content,
    path: &Path,
    key: &str,
) -> Result<&'a gguf_file::Value> {
    c.metadata
        .get(key)
        .ok_or_else(|| ModelError::config(path, key, "missing from the GGUF metadata"))
}

/// A metadata field that must be a positive integer.
pub(crate) fn meta_usize(c: &gguf_file::Content, path: &Path, key: &str) -> Result<usize> {
    let v = meta(c, path, key)?;
    let n = v
        .to_u64()
        .or_else(|_| v.to_u32().map(u64::from))
        .map_err(|e| ModelError::config(path, key, e))?;
    if n == 0 {
        return Err(ModelError::config(path, key, "must be larger than zero"));
    }
    Ok(n as usize)
}

/// Whether a GGUF tensor (HF name `hf`, GGML type `t`, `shape`) stays as its blocks: a
/// quantized projection inside a decoder layer, or the (untied) output head, whose rows are
/// whole blocks. Norms are dequantized; a GGUF's token embedding is kept by
/// [`keeps_embedding_blocks`]. Quantize-on-load (`crate::quantize`) quantizes exactly the
/// tensors this keeps.
pub(crate) fn keeps_blocks(hf: &str, t: GgmlDType, shape: &[usize]) -> bool {
    let quantized = !matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
    quantized
        && ((hf.contains(".layers.") && is_projection(hf)) || hf == "lm_head.weight")
        && shape.len() == 2
        && shape[1].is_multiple_of(t.block_size())
}

/// A layer's projection weight: `*_proj.weight`, or a Mixtral expert's `w1`/`w2`/`w3`.
fn is_projection(hf: &str) -> bool {
    hf.ends_with("_proj.weight")
        || (hf.contains(".experts.")
            && [".w1.weight", ".w2.weight", ".w3.weight"]
                .iter()
                .any(|s| hf.ends_with(s)))
}

/// Whether a GGUF's token embedding (HF name `hf`) stays as its blocks when a file's blocks
/// are kept: its rows are dequantized on lookup, and a tied output head multiplies the same
/// blocks, so host memory holds the file's bytes once.
pub(crate) fn keeps_embedding_blocks(hf: &str, t: GgmlDType, shape: &[usize]) -> bool {
    !matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
        && hf == "model.embed_tokens.weight"
        && shape.len() == 2
        && shape[1].is_multiple_of(t.block_size())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positioned_reader_keeps_the_position_through_reads_and_seeks() {
        use std::io::{Cursor, Read, SeekFrom};
        let data: Vec<u8> = (0..=255u8).cycle().take(200_000).collect();
        let mut r = Positioned::new(Cursor::new(&data));
        let mut buf = [0u8; 7];
        r.read_exact(&mut buf).unwrap();
        assert_eq!((r.stream_position().unwrap(), buf[6]), (7, 6));
        // Past the buffer's first fill, then back and forth.
        let mut big = vec![0u8; 70_000];
        r.read_exact(&mut big).unwrap();
        assert_eq!(r.stream_position().unwrap(), 70_007);
        assert_eq!(big[69_999], data[70_006]);
        assert_eq!(r.seek(SeekFrom::End(0)).unwrap(), 200_000);
        assert_eq!(r.seek(SeekFrom::Start(100)).unwrap(), 100);
        r.read_exact(&mut buf).unwrap();
        assert_eq!((r.stream_position().unwrap(), buf[0]), (107, data[100]));
        assert_eq!(r.seek(SeekFrom::Current(-7)).unwrap(), 100);
        r.read_exact(&mut buf).unwrap();
        assert_eq!(buf[0], data[100]);
        // A short read (what the buffer holds) moves the position by what it returned.
        let n = r.read(&mut big).unwrap();
        assert!(n > 0);
        assert_eq!(r.stream_position().unwrap(), 107 + n as u64);
        assert_eq!(big[n - 1], data[106 + n]);
    }

    #[test]
    fn ggml_types_are_named_as_llama_cpp_names_them() {
        assert_eq!(ggml_name(GgmlDType::Q4K), "Q4_K");
        assert_eq!(ggml_name(GgmlDType::Q8K), "Q8_K");
        assert_eq!(ggml_name(GgmlDType::Q8_1), "Q8_1");
        assert_eq!(ggml_name(GgmlDType::F16), "F16");
        assert_eq!(GGML_TYPE_NAMES[16], "IQ2_XXS");
        assert_eq!(GGML_TYPE_NAMES[30], "BF16");
        assert!((0..43).filter(|&i| candle_reads_type(i)).all(|i| {
            let name = GGML_TYPE_NAMES[i as usize];
            !name.is_empty() && !name.starts_with("IQ")
        }));
    }
}
