//! Continuous batching: a ragged step (several sequences, each with its own cache and
//! position, in one pass) against each sequence alone, for every family; the batcher's
//! admission, greedy outputs, cancellation and memory accounting.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_offload_models::batching::{
    BatchOptions, Batcher, FinishReason, Rejection, SamplingParams, SeqEvent, SeqRequest,
};
use candle_offload_models::generation::generate;
use candle_offload_models::{Cache, Llama, RaggedSeq};

use crate::models::{for_each_tiny, resident_model, Tiny};

pub(crate) fn prompt(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 37 + salt * 11 + 5) % 101) as u32)
        .collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
}

/// Three sequences through ragged steps that mix prompt chunks and decode tokens: a whole
/// prompt beside the first chunk of another; a decode token beside that prompt's rest and a
/// third prompt; then decode tokens of all three. Each sequence's logits equal those of the
/// same tokens run alone (F32, within 1e-4), for every family (sliding windows,
/// soft-capping, biases, MQA).
fn ragged_step_matches_each_sequence_alone(device: &Device) -> anyhow::Result<()> {
    for_each_tiny(&Tiny::ALL, "ragged", device, |dir| {
        let model = resident_model(dir, device, DType::F32)?;
        let (a, b, c) = (prompt(5, 0), prompt(9, 1), prompt(3, 2));
        // The steps: per sequence, the tokens it brings (empty: not in this step).
        let steps: Vec<[Vec<u32>; 3]> = vec![
            [a.clone(), b[..4].to_vec(), vec![]],
            [vec![17], b[4..].to_vec(), c.clone()],
            [vec![3], vec![44], vec![90]],
            [vec![8], vec![61], vec![2]],
        ];
        let mut caches: Vec<Cache> = (0..3).map(|_| model.new_cache()).collect();
        let mut got: Vec<Vec<Tensor>> = vec![Vec::new(); 3];
        for step in &steps {
            let (idx, mut seqs): (Vec<usize>, Vec<RaggedSeq>) = caches
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| !step[*i].is_empty())
                .map(|(i, cache)| {
                    (
                        i,
                        RaggedSeq {
                            id: i as u64,
                            tokens: step[i].clone(),
                            cache,
                        },
                    )
                })
                .unzip();
            let logits = model.forward_ragged(&mut seqs)?;
            anyhow::ensure!(logits.dims() == [idx.len(), 101], "{:?}", logits.dims());
            for (k, &i) in idx.iter().enumerate() {
                got[i].push(logits.get(k)?);
            }
        }
        for (i, want_steps) in got.iter().enumerate() {
            let mut cache = model.new_cache();
            let mut k = 0;
            for step in &steps {
                if step[i].is_empty() {
                    continue;
                }
                let ids = Tensor::new(step[i].as_slice(), device)?.unsqueeze(0)?;
                let want = model.forward(&ids, cache.len(), &mut cache)?.squeeze(0)?;
                let d = max_diff(&want_steps[k], &want)?;
                anyhow::ensure!(d < 1e-4, "sequence {i}, its step {k}: logits differ by {d}");
                k += 1;
            }
        }
        let e = model.forward_ragged(&mut []).unwrap_err();
        anyhow::ensure!(e.to_string().contains("no sequences"), "{e}");
        Ok(())
    })
}
test_device!(
    ragged_step_matches_each_sequence_alone,
    ragged_step_matches_each_sequence_alone_cpu,
    ragged_step_matches_each_sequence_alone_gpu
);

/// Ragged decode steps replayed from a CUDA graph (`set_ragged_graphs`) against the same
/// steps run eagerly by a twin model: three sequences read their prompts, decode six steps
/// together (the first captured, the others replayed), then two of them decode four more
/// (captured again for the new set) and a prompt chunk joins them (eager). Every step's
/// logits agree (F32, within 1e-4) and the caches end at the same positions. On the GPU every
/// family but Gemma 2 (soft-capped scores, which the decode kernel leaves to the composition)
/// captures twice and replays the other eight steps; on the CPU nothing is captured.
fn ragged_graphs_replay_the_eager_steps(device: &Device) -> anyhow::Result<()> {
    for_each_tiny(&Tiny::ALL, "ragged-graphs", device, |dir| {
        let graphs = resident_model(dir, device, DType::F32)?;
        graphs.set_ragged_graphs(true);
        let eager = resident_model(dir, device, DType::F32)?;
        eager.set_ragged_graphs(false);
        let mut ours: Vec<Cache> = (0..3).map(|_| graphs.new_cache()).collect();
        let mut theirs: Vec<Cache> = (0..3).map(|_| eager.new_cache()).collect();
        let mut steps: Vec<Vec<(usize, Vec<u32>)>> = vec![vec![
            (0, prompt(5, 0)),
            (1, prompt(9, 1)),
            (2, prompt(3, 2)),
        ]];
        for t in 0..6u32 {
            steps.push(
                (0..3)
                    .map(|i| (i, vec![(t * 7 + i as u32 * 13) % 101]))
                    .collect(),
            );
        }
        for t in 0..4u32 {
            steps.push(vec![
                (0, vec![(t * 5 + 3) % 101]),
                (2, vec![(t * 11 + 1) % 101]),
            ]);
        }
        steps.push(vec![(0, vec![4]), (2, vec![9]), (1, prompt(4, 3))]);
        for (k, step) in steps.iter().enumerate() {
            let run = |model: &Llama, caches: &mut Vec<Cache>| -> anyhow::Result<Tensor> {
                let mut taken: Vec<Option<&mut Cache>> = caches.iter_mut().map(Some).collect();
                let mut seqs = Vec::new();
                for (i, tokens) in step {
                    let cache = taken[*i].take().expect("each sequence once a step");
                    seqs.push(RaggedSeq {
                        id: *i as u64,
                        tokens: tokens.clone(),
                        cache,
                    });
                }
                Ok(model.forward_ragged(&mut seqs)?)
            };
            let got = run(&graphs, &mut ours)?;
            let want = run(&eager, &mut theirs)?;
            let d = max_diff(&got, &want)?;
            anyhow::ensure!(d < 1e-4, "step {k}: logits differ by {d}");
        }
        for (a, b) in ours.iter().zip(&theirs) {
            anyhow::ensure!(a.len() == b.len(), "caches at {} and {}", a.len(), b.len());
        }
        let stats = graphs.graph_stats();
        // Gemma 2's soft-capped scores are not the decode kernel's: its steps stay eager.
        let capped = dir.to_string_lossy().contains("-gemma2-");
        if !device.is_cuda() || capped {
            anyhow::ensure!(stats.ragged_captures == 0, "captured: {stats:?}");
        } else {
            anyhow::ensure!(
                stats.ragged_captures == 2 && stats.ragged_replays == 8,
                "{stats:?}"
            );
        }
        Ok(())
    })
}
test_device!(
    ragged_graphs_replay_the_eager_steps,
    ragged_graphs_replay_the_eager_steps_cpu,
    ragged_graphs_replay_the_eager_steps_gpu
);

/// Greedy tokens of each request through `generate`, alone.
fn alone(model: &Llama, req: &SeqRequest) -> anyhow::Result<Vec<u32>> {
    let mut greedy = candle_transformers::generation::LogitsProcessor::new(0, None, None);
    let (tokens, _) = generate(
        model,
        &req.prompt,
        req.max_new_tokens,
        &mut greedy,
        &req.end_tokens,
        |_| Ok(()),
    )?;
    Ok(tokens)
}

/// Each request's tokens and how it finished, by id.
pub(crate) type Outcomes = HashMap<u64, (Vec<u32>, Option<FinishReason>)>;

/// Runs the batcher until idle, submitting `later` requests at their steps; returns each
/// request's tokens and finish reason, checking the gauges at every step.
pub(crate) fn drain(
    batcher: &mut Batcher,
    mut later: Vec<(usize, u64, SeqRequest)>,
    cancel_at: Option<(usize, u64)>,
) -> anyhow::Result<Outcomes> {
    let mut out = Outcomes::new();
    let limit = batcher.options().kv_limit_bytes;
    for step in 0.. {
        later.retain(|(at, id, req)| {
            if *at == step {
                batcher.submit(*id, req.clone()).expect("a valid request");
                false
            } else {
                true
            }
        });
        if let Some((at, id)) = cancel_at {
            if at == step {
                anyhow::ensure!(batcher.cancel(id), "request {id} was not known");
            }
        }
        if batcher.is_idle() && later.is_empty() {
            break;
        }
        anyhow::ensure!(step < 500, "the batcher did not finish");
        for (id, ev) in batcher.step()? {
            let e = out.entry(id).or_default();
            match ev {
                SeqEvent::Token(t) => e.0.push(t),
                SeqEvent::Finished(r) => e.1 = Some(r),
            }
        }
        let g = batcher.gauges();
        anyhow::ensure!(g.kv_bytes <= limit, "{} KV bytes over {limit}", g.kv_bytes);
        anyhow::ensure!(
            g.running <= batcher.options().max_running,
            "{} running",
            g.running
        );
    }
    Ok(out)
}

/// The batcher over requests that arrive at different steps, with prompts longer than a
/// chunk, end tokens and a KV limit that holds two of them: greedy tokens equal each request
/// alone, no step exceeds the limit or the running count, a cancelled request frees its
/// memory, the gauges return to idle, and requests that can never run are refused; a
/// warm-up before them leaves nothing behind.
fn batcher_matches_requests_alone(device: &Device) -> anyhow::Result<()> {
    let kinds = [
        Tiny::Llama {
            tied: true,
            bias: true,
        },
        Tiny::Gemma2,
    ];
    for_each_tiny(&kinds, "batcher", device, |dir| {
        let model = Arc::new(resident_model(dir, device, DType::F32)?);
        let req = |n: usize, salt: usize, new: usize, end: Vec<u32>| SeqRequest {
            prompt: prompt(n, salt),
            max_new_tokens: new,
            sampling: SamplingParams::default(),
            end_tokens: end,
        };
        let reqs = [
            (0, 1, req(11, 0, 8, vec![])),
            (0, 2, req(4, 1, 6, vec![])),
            (2, 3, req(7, 2, 9, vec![])),
            (3, 4, req(20, 3, 5, vec![])),
            (3, 5, req(6, 4, 12, vec![])),
        ];
        let wants: Vec<Vec<u32>> = reqs
            .iter()
            .map(|(_, _, r)| alone(&model, r))
            .collect::<anyhow::Result<_>>()?;
        // An end token that request 5 produces: it must stop there.
        let end = wants[4][3];
        let mut reqs = reqs.to_vec();
        reqs[4].2.end_tokens = vec![end];
        let stop_at = wants[4].iter().position(|&t| t == end).unwrap_or(0) + 1;
        let opts = BatchOptions {
            max_running: 3,
            step_tokens: 12,
            prompt_chunk: 5,
            kv_limit_bytes: 0,
            max_len: 64,
        };
        let batcher = Batcher::new(model.clone(), opts);
        let two = batcher.kv_bytes(32) * 2;
        let mut batcher = Batcher::new(
            model.clone(),
            BatchOptions {
                kv_limit_bytes: two,
                ..opts
            },
        );
        // A server's warm-up first: it leaves the batcher idle, its memory and counts at
        // zero, and changes no request's tokens; a busy batcher refuses it.
        batcher.warm_up()?;
        let g = batcher.gauges();
        anyhow::ensure!(
            batcher.is_idle() && g.kv_bytes == 0 && g.steps == 0,
            "the warm-up left {g:?}"
        );
        // Nor do limits that leave no room for its requests stop it: a context of two
        // positions, a KV limit below its long prompt's cache.
        for tight in [
            BatchOptions { max_len: 2, ..opts },
            BatchOptions {
                kv_limit_bytes: batcher.kv_bytes(4),
                ..opts
            },
        ] {
            let mut b = Batcher::new(model.clone(), tight);
            b.warm_up()?;
            anyhow::ensure!(b.is_idle() && b.gauges().kv_bytes == 0, "{tight:?}");
        }
        batcher.submit(99, req(3, 9, 2, vec![]))?;
        anyhow::ensure!(batcher.warm_up().is_err(), "a busy batcher warmed up");
        anyhow::ensure!(batcher.cancel(99), "the request was not there to cancel");
        let got = drain(&mut batcher, reqs.clone(), None)?;
        for (k, (_, id, _)) in reqs.iter().enumerate() {
            let (tokens, reason) = &got[id];
            let want = if *id == 5 {
                &wants[k][..stop_at]
            } else {
                &wants[k][..]
            };
            anyhow::ensure!(
                tokens == want,
                "request {id}: batched {tokens:?}, alone {want:?}"
            );
            let want_reason = if *id == 5 {
                FinishReason::EndToken
            } else {
                FinishReason::Length
            };
            anyhow::ensure!(*reason == Some(want_reason), "request {id}: {reason:?}");
        }
        let g = batcher.gauges();
        anyhow::ensure!(
            (g.running, g.waiting, g.kv_bytes) == (0, 0, 0),
            "not idle: {g:?}"
        );
        anyhow::ensure!(g.steps > 0 && g.last_batch >= 1, "{g:?}");
        // A request cancelled while it decodes: the others finish, its memory is freed.
        let got = drain(&mut batcher, reqs[..3].to_vec(), Some((4, 2)))?;
        anyhow::ensure!(got[&1].0 == wants[0] && got[&3].0 == wants[2], "{got:?}");
        anyhow::ensure!(
            got[&2].1.is_none(),
            "the cancelled request finished: {got:?}"
        );
        anyhow::ensure!(batcher.gauges().kv_bytes == 0, "{:?}", batcher.gauges());
        // Requests that can never run.
        let refused = [
            (req(0, 0, 4, vec![]), "the prompt is empty"),
            (req(4, 0, 0, vec![]), "at least 1"),
            (req(60, 0, 5, vec![]), "exceed the context"),
        ];
        for (r, want) in refused {
            let e = batcher.submit(9, r).unwrap_err();
            anyhow::ensure!(e.to_string().contains(want), "{e}");
        }
        let small = Batcher::new(
            model.clone(),
            BatchOptions {
                kv_limit_bytes: batcher.kv_bytes(10),
                ..opts
            },
        );
        anyhow::ensure!(
            matches!(
                small.check(&req(8, 0, 8, vec![])),
                Err(Rejection::NeverFits { .. })
            ),
            "a request bigger than the KV memory was accepted"
        );
        batcher.submit(7, req(4, 0, 4, vec![]))?;
        anyhow::ensure!(
            batcher.submit(7, req(4, 0, 4, vec![])) == Err(Rejection::DuplicateId(7)),
            "a duplicate id was accepted"
        );
        anyhow::ensure!(batcher.cancel(7) && !batcher.cancel(7), "cancel twice");
        Ok(())
    })
}
test_device!(
    batcher_matches_requests_alone,
    batcher_matches_requests_alone_cpu,
    batcher_matches_requests_alone_gpu
);
