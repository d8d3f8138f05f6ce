//! How units are laid out: tensors grouped into units, each unit one buffer with its tensors
//! at aligned offsets ([`TensorMeta`]), and the device sizes of GGML tensors evened out across
//! layers of mixed block types ([`pad_block_classes`]).

use std::collections::HashMap;

use candle_core::{DType, Shape};

use super::config::StoreConfig;
use super::format::WeightFormat;
use crate::error::{Error, Result};
use crate::sys;

/// Alignment of each tensor inside a unit's buffer (whose start is aligned to
/// `sys::TIER_ALIGN`, a multiple of it).
pub(super) const TENSOR_ALIGN: usize = 256;

const _: () = assert!(sys::TIER_ALIGN.is_multiple_of(TENSOR_ALIGN));

/// Where one tensor lives inside its unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Full name, as in the checkpoint.
    pub name: String,
    /// How its bytes are laid out.
    pub format: WeightFormat,
    /// The Candle dtype of its values ([`WeightFormat::value_dtype`]: the stored dtype of a
    /// dense tensor, F32 for GGML blocks).
    pub dtype: DType,
    /// Shape.
    pub shape: Shape,
    /// Byte offset in the unit's buffer.
    pub offset: usize,
    /// Byte length in host memory.
    pub nbytes: usize,
    /// Bytes it takes on the device when it streams (what the budget counts for a unit that
    /// comes and goes): [`WeightFormat::device_bytes`], or for GGML blocks of a layer unit the
    /// most any layer unit of the same shapes takes at this position (its buffer then holds
    /// whole blocks past its own, zeroed, so that layers of mixed block types free and
    /// allocate the same sizes as they stream).
    pub device_bytes: usize,
    /// Bytes it takes on the device when its unit stays there for good (uploaded once, never
    /// replaced): [`WeightFormat::device_bytes`], without the streaming padding.
    pub own_device_bytes: usize,
}

/// One tensor of a source, before it is placed.
pub(super) struct Pending {
    pub(super) name: String,
    pub(super) format: WeightFormat,
    pub(super) shape: Shape,
}

/// One unit laid out, before it is placed.
pub(super) struct UnitLayout {
    /// The unit's name (`model.layers.7`).
    pub(super) name: String,
    /// Its layer index, for units made by a layer prefix.
    pub(super) layer: Option<usize>,
    /// The indices of its tensors among the source's, in load order.
    pub(super) members: Vec<usize>,
    /// Its tensors' places in its buffer.
    pub(super) tensors: Vec<TensorMeta>,
    /// The buffer's length (tensors plus alignment padding).
    pub(super) len: usize,
}

/// Groups `pending` into units by `cfg.grouping` (the non-layer units first, by name, then the
/// layers by index) and lays each unit out: its tensors in the store's formats at
/// [`TENSOR_ALIGN`] offsets, their device sizes evened out across layers of mixed block types
/// ([`pad_block_classes`]). A GGML tensor whose rows are not whole blocks is refused, naming it.
pub(super) fn lay_out(pending: &[Pending], cfg: &StoreConfig) -> Result<Vec<UnitLayout>> {
    // Group into units, keeping layer units in index order.
    let mut groups: Vec<(String, Option<usize>, Vec<usize>)> = Vec::new();
    let mut group_of: HashMap<String, usize> = HashMap::new();
    for (i, p) in pending.iter().enumerate() {
        let (unit, layer) = cfg.grouping.unit_of(&p.name);
        let g = *group_of.entry(unit.clone()).or_insert_with(|| {
            groups.push((unit, layer, Vec::new()));
            groups.len() - 1
        });
        groups[g].2.push(i);
    }
    if let Some(only) = &cfg.only_units {
        groups.retain(|(unit, _, _)| only.contains(unit));
    }
    groups.sort_by(|a, b| match (a.1, b.1) {
        (Some(x), Some(y)) => (x, &a.0).cmp(&(y, &b.0)),
        (None, Some(_)) => std::cmp::Ordering::Less,
        (Some(_), None) => std::cmp::Ordering::Greater,
        (None, None) => a.0.cmp(&b.0),
    });

    // Every unit is laid out before any is placed: the host cap is checked against the largest.
    let mut layouts = Vec::with_capacity(groups.len());
    for (unit_name, layer, members) in groups {
        let mut tensors = Vec::with_capacity(members.len());
        let mut len = 0usize;
        for &i in &members {
            let p = &pending[i];
            let format = match (p.format, cfg.dtype) {
                (WeightFormat::Dense(s), Some(d)) if s.is_float() && d.is_float() => {
                    WeightFormat::Dense(d)
                }
                (f, _) => f,
            };
            len = len.next_multiple_of(TENSOR_ALIGN);
            let nbytes = format
                .host_bytes(&p.shape)
                .map_err(|reason| Error::InvalidConfig {
                    field: format!("tensor {}", p.name),
                    reason,
                })?;
            tensors.push(TensorMeta {
                name: p.name.clone(),
                format,
                dtype: format.value_dtype(),
                shape: p.shape.clone(),
                offset: len,
                nbytes,
                device_bytes: format.device_bytes(nbytes),
                own_device_bytes: format.device_bytes(nbytes),
            });
            len += nbytes;
        }
        layouts.push(UnitLayout {
            name: unit_name,
            layer,
            members,
            tensors,
            len,
        });
    }
    pad_block_classes(layouts.iter_mut().map(|l| (l.layer, &mut l.tensors)));
    Ok(layouts)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Evens out the device bytes of GGML tensors across layer units of one shape.
///
/// Layer units whose tensors have the same shapes in the same order stream through the same
/// room on the device, one replacing another. When their block types differ (a Q4_K_M file
/// keeps some layers' `attn_v` and `ffn_down` in Q6_K, the others in Q4_K), the driver's
/// memory pool cannot serve the incoming tensor from the outgoing one's freed block and maps
/// new memory while keeping the old, and the device peak passes the budget (docs/tuning.md).
/// So each GGML tensor of such a class is allocated (and budgeted) at one size for its
/// position: the largest, rounded up to a multiple of every member's block size (5040 bytes for
/// Q4_K and Q6_K), which each member's buffer of whole blocks takes exactly. Every unit then
/// frees exactly what the next one allocates. Units of one block type per position (all of
/// Q4_0, Q8_0, F16 ... files) are unchanged.
fn pad_block_classes<'a>(units: impl Iterator<Item = (Option<usize>, &'a mut Vec<TensorMeta>)>) {
    let mut classes: HashMap<Vec<Vec<usize>>, Vec<&'a mut Vec<TensorMeta>>> = HashMap::new();
    for (layer, tensors) in units {
        if layer.is_some() {
            let key = tensors.iter().map(|t| t.shape.dims().to_vec()).collect();
            classes.entry(key).or_default().push(tensors);
        }
    }
    for members in classes.values_mut() {
        let Some(width) = members.first().map(|m| m.len()) else {
            continue;
        };
        for i in 0..width {
            let blocks = members
                .iter()
                .all(|m| matches!(m[i].format, WeightFormat::Ggml(_)));
            let largest = members
                .iter()
                .map(|m| m[i].own_device_bytes)
                .max()
                .unwrap_or(0);
            if !blocks || members.iter().all(|m| m[i].own_device_bytes == largest) {
                continue;
            }
            // One size every member's buffer can take exactly: a buffer is whole blocks of its
            // type (Candle's row padding is whole blocks too), so the size is the first common
            // multiple of the block sizes at or past the largest.
            let common = members
                .iter()
                .map(|m| m[i].format.block_bytes())
                .fold(1, |l, b| l / gcd(l, b) * b);
            let size = largest.next_multiple_of(common);
            for m in members.iter_mut() {
                m[i].device_bytes = size;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::*;
    #[test]
    fn layers_of_mixed_block_types_take_one_size_per_position() {
        let meta = |name: &str, format: WeightFormat, dims: (usize, usize)| {
            let shape = Shape::from(dims);
            let nbytes = format.host_bytes(&shape).unwrap();
            TensorMeta {
                name: name.into(),
                format,
                dtype: format.value_dtype(),
                shape,
                offset: 0,
                nbytes,
                device_bytes: format.device_bytes(nbytes),
                own_device_bytes: format.device_bytes(nbytes),
            }
        };
        let (q4k, q6k) = (
            WeightFormat::Ggml(GgmlDType::Q4K),
            WeightFormat::Ggml(GgmlDType::Q6K),
        );
        let f32 = WeightFormat::Dense(DType::F32);
        // A Q4_K_M pattern: `v` in Q6_K in one layer, Q4_K in the other; norms dense.
        let layer = |v: WeightFormat| {
            vec![
                meta("q", q4k, (8, 512)),
                meta("v", v, (8, 512)),
                meta("norm", f32, (1, 512)),
            ]
        };
        let mut units = [
            (Some(0), layer(q6k)),
            (Some(1), layer(q4k)),
            // Not a layer: left alone even with the same shapes.
            (None, layer(q4k)),
            // Another shape: a class of its own.
            (Some(2), vec![meta("v", q4k, (4, 512))]),
        ];
        let before: Vec<Vec<usize>> = units
            .iter()
            .map(|(_, ts)| ts.iter().map(|t| t.device_bytes).collect())
            .collect();
        pad_block_classes(units.iter_mut().map(|(l, ts)| (*l, ts)));
        let after = |u: usize, i: usize| units[u].1[i].device_bytes;
        // `v`: both layers take the Q6_K layer's size rounded up to whole blocks of both types
        // (a multiple of 144 and 210: 5040 bytes).
        let q6 = before[0][1];
        assert_eq!(after(0, 1), after(1, 1), "one size");
        assert!(
            after(0, 1) >= q6 && after(0, 1) < q6 + 5040,
            "{} vs {q6}",
            after(0, 1)
        );
        assert_eq!(after(0, 1) % 5040, 0, "whole blocks of both types");
        // Positions of one type, dense tensors, other units: unchanged.
        for (u, sizes) in before.iter().enumerate() {
            for (i, &b) in sizes.iter().enumerate() {
                if i != 1 || u > 1 {
                    assert_eq!(units[u].1[i].device_bytes, b, "unit {u} tensor {i}");
                }
            }
        }
    }
}
