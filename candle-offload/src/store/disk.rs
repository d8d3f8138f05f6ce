//! The disk tier of a unit that stays in its checkpoint file: where each tensor sits in the
//! file ([`FileSpan`]), the segments a fetch reads, and the conversion of the file's bytes to
//! the stored format on every read.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device};

use super::convert::{convert_into, tensor_to_bytes};
use super::format::WeightFormat;
use super::layout::TensorMeta;
use crate::error::{Error, Result};
use crate::sys;

/// Where a tensor's bytes are in a checkpoint file, for the disk tier.
pub(super) struct FileSpan {
    pub(super) file: Arc<sys::DiskFile>,
    /// Offset of its first byte.
    pub(super) offset: u64,
    /// Its length in the file.
    pub(super) len: usize,
    /// How the file holds it.
    pub(super) format: WeightFormat,
    /// Stored row `r` is file row `rows[r]` (`None`: the file's order).
    pub(super) rows: Option<Vec<usize>>,
}

/// The disk tier of a unit laid out as `tensors`, each read from its span of a file: one
/// segment per tensor, or per run of rows where the span reorders them, with the conversion
/// from the file's format to the stored one.
pub(super) fn disk_tier(
    unit: &str,
    len: usize,
    tensors: &[TensorMeta],
    spans: &[&FileSpan],
    reads: crate::tuning::DiskTuning,
) -> Result<sys::DiskTier> {
    let mut segments = Vec::with_capacity(tensors.len());
    for (t, span) in tensors.iter().zip(spans) {
        let bad = |reason: String| Error::File {
            path: span.file.path().to_path_buf(),
            reason: format!("tensor {}: {reason}", t.name),
        };
        let need = span.format.host_bytes(&t.shape).map_err(bad)?;
        if span.len != need {
            return Err(bad(format!(
                "holds {} bytes, but its shape and {} need {need}",
                span.len, span.format
            )));
        }
        let conversion = conversion(span.format, t.format).map_err(bad)?;
        let name: Arc<str> = t.name.as_str().into();
        let segment = |at: usize, len: usize, file_offset: u64| sys::Segment {
            file: span.file.clone(),
            name: name.clone(),
            at,
            len,
            file_offset,
            conversion: conversion.clone(),
        };
        let Some(order) = &span.rows else {
            segments.push(segment(t.offset, t.nbytes, span.offset));
            continue;
        };
        // Runs of rows that follow each other in the file: one segment each.
        let rows = t.shape.dims().first().copied().unwrap_or(1);
        let mut seen = vec![false; rows];
        if order.len() != rows
            || order
                .iter()
                .any(|&r| r >= rows || std::mem::replace(&mut seen[r], true))
        {
            return Err(bad(format!(
                "its row order is not a permutation of its {rows} rows"
            )));
        }
        let (row, file_row) = (t.nbytes / rows, span.len / rows);
        let mut r = 0;
        while r < rows {
            let mut n = 1;
            while r + n < rows && order[r + n] == order[r] + n {
                n += 1;
            }
            segments.push(segment(
                t.offset + r * row,
                n * row,
                span.offset + (order[r] * file_row) as u64,
            ));
            r += n;
        }
    }
    let shape = sys::ReadShape {
        threads: reads.threads,
        piece: (reads.piece_mib as u64) << 20,
    };
    Ok(sys::DiskTier::new(unit, len, segments, shape)?)
}

/// How a disk segment's file bytes (`from`) become its stored bytes (`to`): `None` when they
/// are the same; a float conversion ([`convert_into`]); GGML blocks dequantized as Candle
/// dequantizes them, then converted to the stored dtype as Candle converts (what the GGUF
/// loader does in memory). Anything else cannot be read from the file.
fn conversion(
    from: WeightFormat,
    to: WeightFormat,
) -> std::result::Result<Option<sys::Conversion>, String> {
    match (from, to) {
        (f, t) if f == t => Ok(None),
        (WeightFormat::Dense(f), WeightFormat::Dense(t)) if f.is_float() && t.is_float() => {
            Ok(Some(sys::Conversion {
                what: format!("{f:?} -> {t:?}").into(),
                from_group: f.size_in_bytes(),
                to_group: t.size_in_bytes(),
                convert: Arc::new(move |src, dst| convert_into(src, f, dst, t)),
            }))
        }
        (WeightFormat::Ggml(g), WeightFormat::Dense(t)) if t.is_float() => {
            Ok(Some(sys::Conversion {
                what: format!("{g:?} blocks -> {t:?}").into(),
                from_group: g.type_size(),
                to_group: g.block_size() * t.size_in_bytes(),
                convert: Arc::new(move |src, dst| {
                    dequantize_into(src, g, dst, t).map_err(|e| e.to_string())
                }),
            }))
        }
        (f, t) => Err(format!(
            "the file holds it as {f}, which cannot be read as {t}"
        )),
    }
}

/// Dequantizes whole blocks of `g` in `src` into `dst` as `to`, through Candle exactly as the
/// GGUF loader does in memory (`QTensor::dequantize`, then `to_dtype`).
fn dequantize_into(src: &[u8], g: GgmlDType, dst: &mut [u8], to: DType) -> candle_core::Result<()> {
    // `QStorage::from_data` views the bytes as blocks: align them for any block type (8).
    let mut buf = vec![0u8; src.len() + 8];
    let at = buf.as_ptr().align_offset(8);
    if at > 8 {
        candle_core::bail!("cannot align a buffer for {g:?} blocks");
    }
    buf[at..at + src.len()].copy_from_slice(src);
    let elems = src.len() / g.type_size() * g.block_size();
    let storage = QStorage::from_data(
        std::borrow::Cow::Borrowed(&buf[at..at + src.len()]),
        &Device::Cpu,
        g,
    )?;
    let t = QTensor::new(storage, elems)?
        .dequantize(&Device::Cpu)?
        .to_dtype(to)?;
    let bytes = tensor_to_bytes(&t)?;
    if bytes.len() != dst.len() {
        candle_core::bail!("{} bytes dequantized into {}", bytes.len(), dst.len());
    }
    dst.copy_from_slice(&bytes);
    Ok(())
}
