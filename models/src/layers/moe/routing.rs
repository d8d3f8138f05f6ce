//! A router's choice of experts, as transformers makes it: softmax of the logits in F32, the
//! top k (largest first, ties to the lower index), renormalised where the model asks, and the
//! rows of a batch grouped by the expert they go to. Pure functions of the logits; a prompt's
//! rows are routed on the CPU kernels' worker threads ([`route_rows`]).

use std::collections::BTreeMap;

/// How a router's logits choose experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Routing {
    /// Experts in the layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Divide the chosen experts' probabilities by their sum (Mixtral always; Qwen3-MoE when
    /// `norm_topk_prob`).
    pub renormalize: bool,
}

#[cfg(test)]
impl Routing {
    /// `top_k` of `experts`, renormalised or not (the tests' shorthand).
    pub(crate) fn of(experts: usize, top_k: usize, renormalize: bool) -> Self {
        Self {
            experts,
            top_k,
            renormalize,
        }
    }
}

/// One token's experts and their weights, as transformers' routers compute them: softmax of
/// the logits in F32, the `top_k` largest probabilities (largest first), divided by their sum
/// when `renormalize`. Exact ties go to the lower expert index (torch's `topk` leaves their
/// order unspecified; the weights are the same either way).
pub fn route_row(logits: &[f32], r: Routing) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // The numerators on the stack where the router is no wider than a layer's usual experts,
    // by the kernels' vectorized `exp`.
    let (mut stack, mut heap) = ([0f32; EXPS_ON_STACK], Vec::new());
    let exps: &mut [f32] = if logits.len() <= EXPS_ON_STACK {
        &mut stack[..logits.len()]
    } else {
        heap.resize(logits.len(), 0.0);
        &mut heap
    };
    exps.copy_from_slice(logits);
    candle_offload::kernels::activation::exp_shifted_in_place(exps, max);
    let sum: f32 = exps.iter().sum();
    let mut chosen: Vec<(usize, f32)> = top_k_order(exps, r.top_k)
        .into_iter()
        .map(|e| (e, exps[e] / sum))
        .collect();
    if r.renormalize {
        let total: f32 = chosen.iter().map(|(_, p)| p).sum();
        for (_, p) in &mut chosen {
            *p /= total;
        }
    }
    chosen
}

/// The indices of the `k` largest of `values`, largest first; NaN last; ties by index: a
/// full sort's first `k`, kept in a sorted list of at most `k` (a prompt routes every row,
/// and `k` is a few of a hundred or more experts).
fn top_k_order(values: &[f32], k: usize) -> Vec<usize> {
    let before = |a: usize, b: usize| {
        values[b]
            .partial_cmp(&values[a])
            .unwrap_or_else(|| values[a].is_nan().cmp(&values[b].is_nan()))
            .then(a.cmp(&b))
            == std::cmp::Ordering::Less
    };
    let mut top: Vec<usize> = Vec::with_capacity(k + 1);
    for i in 0..values.len() {
        // Most values fall at or below the k-th: a plain comparison (false for NaN either
        // side, and a tie goes to the lower index, the k-th's) settles them before `before`.
        if top.len() == k
            && top
                .last()
                .is_none_or(|&last| values[i] <= values[last] || !before(i, last))
        {
            continue;
        }
        let at = top.partition_point(|&t| before(t, i));
        top.insert(at, i);
        top.truncate(k);
    }
    top
}

/// Experts whose numerators [`route_row`] keeps on the stack (wider routers use the heap).
const EXPS_ON_STACK: usize = 256;

/// Rows a worker routes at a time ([`route_rows`]); a batch of at most this many is routed on
/// the calling thread.
pub const ROUTE_CHUNK_ROWS: usize = 32;

/// [`route_row`] of each row of `logits` (row-major, `stride` values a row), on its values
/// `at..at + width`. Batches of more than [`ROUTE_CHUNK_ROWS`] rows are shared out in chunks
/// of that many over the CPU kernels' worker threads (`kernels::pool`): a 512-token prompt is
/// 512 routings a layer, about a millisecond on one core.
pub fn route_rows(
    logits: &[f32],
    stride: usize,
    (at, width): (usize, usize),
    routing: Routing,
) -> Vec<Vec<(usize, f32)>> {
    let row = |i: usize| route_row(&logits[i * stride + at..i * stride + at + width], routing);
    let rows = logits.len().checked_div(stride).unwrap_or(0);
    if rows <= ROUTE_CHUNK_ROWS {
        return (0..rows).map(row).collect();
    }
    let mut out: Vec<Vec<(usize, f32)>> = vec![Vec::new(); rows];
    candle_offload::kernels::pool::for_each_chunk_mut(&mut out, ROUTE_CHUNK_ROWS, |c, chunk| {
        for (j, slot) in chunk.iter_mut().enumerate() {
            *slot = row(c * ROUTE_CHUNK_ROWS + j);
        }
    });
    out
}

/// For each expert some row of a batch is routed to (in expert order), the rows and their
/// weights.
pub fn group_by_expert(routes: &[Vec<(usize, f32)>]) -> BTreeMap<usize, (Vec<u32>, Vec<f32>)> {
    // Gathered per expert index first: one map entry an expert, not one lookup a route.
    let mut dense: Vec<(Vec<u32>, Vec<f32>)> = Vec::new();
    for (row, choice) in routes.iter().enumerate() {
        for &(e, w) in choice {
            if e >= dense.len() {
                dense.resize_with(e + 1, Default::default);
            }
            dense[e].0.push(row as u32);
            dense[e].1.push(w);
        }
    }
    dense
        .into_iter()
        .enumerate()
        .filter(|(_, g)| !g.0.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Expected values printed by transformers' router code (torch 2.15: softmax in F32,
    /// `topk`, renormalised or not) on the same logits.
    #[test]
    fn routes_as_transformers() {
        let close = |got: Vec<(usize, f32)>, want: &[(usize, f32)]| {
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want) {
                assert!(
                    g.0 == w.0 && (g.1 - w.1).abs() < 1e-6,
                    "{got:?} != {want:?}"
                );
            }
        };
        let a = [0.3f32, -1.2, 2.5, 0.9, 2.4, -0.1];
        close(
            route_row(&a, Routing::of(6, 2, false)),
            &[(2, 0.4316793), (4, 0.3905996)],
        );
        close(
            route_row(&a, Routing::of(6, 2, true)),
            &[(2, 0.5249791), (4, 0.4750208)],
        );
        let b = [-0.5f32, 0.25, 0.1, -2.0, 0.7, 0.69, 3.0, -1.0];
        close(
            route_row(&b, Routing::of(8, 4, false)),
            &[
                (6, 0.7279492),
                (4, 0.0729833),
                (5, 0.0722571),
                (1, 0.0465362),
            ],
        );
        close(
            route_row(&b, Routing::of(8, 4, true)),
            &[
                (6, 0.7914849),
                (4, 0.0793533),
                (5, 0.0785637),
                (1, 0.0505979),
            ],
        );
        // Top-1 renormalised is weight 1 (Mixtral's top-1 configs).
        assert_eq!(route_row(&a, Routing::of(6, 1, true)), [(2, 1.0)]);
        // Large logits do not overflow.
        let big = route_row(&[1000.0, 999.0, -1000.0], Routing::of(3, 2, false));
        assert_eq!(big[0].0, 0);
        assert!((big[0].1 - 1.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
    }

    proptest! {
        /// The kept top k is a full sort's first k, NaN, ties and k past the length included.
        #[test]
        fn top_k_is_a_full_sorts_first_k(
            values in proptest::collection::vec(
                prop_oneof![
                    4 => (-4i8..4).prop_map(f32::from),
                    4 => -10.0f32..10.0,
                    1 => Just(f32::NAN),
                ],
                0..40,
            ),
            k in 0usize..45,
        ) {
            let mut order: Vec<usize> = (0..values.len()).collect();
            order.sort_by(|&a, &b| {
                values[b]
                    .partial_cmp(&values[a])
                    .unwrap_or_else(|| values[a].is_nan().cmp(&values[b].is_nan()))
                    .then(a.cmp(&b))
            });
            order.truncate(k);
            prop_assert_eq!(top_k_order(&values, k), order);
        }
    }

    #[test]
    fn ties_choose_the_lower_index_with_equal_weights() {
        let got = route_row(&[1.0, 3.0, 3.0, 3.0, 0.0], Routing::of(5, 2, true));
        assert_eq!(got, [(1, 0.5), (2, 0.5)]);
        let flat = route_row(&[0.0; 8], Routing::of(8, 3, false));
        assert_eq!(flat.iter().map(|c| c.0).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(flat.iter().all(|c| (c.1 - 0.125).abs() < 1e-7));
    }

    proptest! {
        /// A batch routed in chunks over the workers is each row routed alone, whatever the
        /// row count (one chunk, several, a short last one) and the slice of each row.
        #[test]
        fn rows_route_as_each_row_alone(
            rows in 0usize..100,
            (experts, at, extra) in (1usize..24, 0usize..5, 0usize..5),
            k in 1usize..6,
            renormalize: bool,
            seed: u64,
        ) {
            let stride = at + experts + extra;
            let mut s = seed | 1;
            let logits: Vec<f32> = (0..rows * stride)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s % 64) as f32 / 8.0 - 4.0
                })
                .collect();
            let r = Routing::of(experts, k.min(experts), renormalize);
            let got = route_rows(&logits, stride, (at, experts), r);
            prop_assert_eq!(got.len(), rows);
            for (i, g) in got.iter().enumerate() {
                prop_assert_eq!(g, &route_row(&logits[i * stride + at..i * stride + at + experts], r));
            }
        }
    }

    #[test]
    fn groups_rows_by_expert_in_expert_order() {
        let routes = vec![vec![(3, 0.6), (1, 0.4)], vec![(1, 0.9), (0, 0.1)]];
        let g = group_by_expert(&routes);
        assert_eq!(g.keys().copied().collect::<Vec<_>>(), [0, 1, 3]);
        assert_eq!(g[&1], (vec![0, 1], vec![0.4, 0.9]));
        assert_eq!(g[&3], (vec![0], vec![0.6]));
    }
}
