//! A model over several processes: ranks (threads here, each with its own transport, store
//! and model, joined over loopback TCP) split the layers as rank 0 plans, load only their own
//! units, and generate the same greedy tokens as one process; a rank that dies mid-run fails
//! the others with an error naming it, within the timeout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use candle_offload::dist::{free_port, NetConfig, TcpTransport, Transport};
use candle_offload::placement::PlacementMode;
use candle_offload::StoreConfig;
use candle_offload_models::generation::{generate, generate_ranks};
use candle_offload_models::llama::DeviceMapChoice;
use candle_offload_models::loader::{self, ModelFiles};
use candle_offload_models::{Llama, RankRequest};
use candle_transformers::generation::LogitsProcessor;

use crate::models::{write_tiny, Tiny};
use crate::util::{scratch, Scratch};

pub(crate) const PROMPT: [u32; 7] = [5, 17, 42, 3, 99, 64, 8];
pub(crate) const NEW: usize = 12;

/// The tiny checkpoint of `kind` in a fresh temporary directory (removed when the returned
/// [`Scratch`] is dropped), and its files.
pub(crate) fn tiny(kind: Tiny, test: &str) -> anyhow::Result<(Scratch, ModelFiles)> {
    let dir = scratch(&format!("dist-{test}-{}", kind.tag()));
    write_tiny(&dir, kind)?;
    let files = loader::from_dir(&dir)?;
    Ok((dir, files))
}

/// The greedy tokens of the whole model in this process, on `device`.
pub(crate) fn one_process(files: &ModelFiles, device: &Device) -> anyhow::Result<Vec<u32>> {
    let store = Arc::new(loader::load_store(files, DType::F32, device, None)?);
    let model = Llama::builder(files, store)
        .device(device)
        .max_len(PROMPT.len() + NEW)
        .build()?;
    let mut sampler = LogitsProcessor::new(0, None, None);
    Ok(generate(&model, &PROMPT, NEW, &mut sampler, &[], |_| Ok(()))?.0)
}

/// Rank `rank`'s model on `device`: joins, takes rank 0's split, loads only its units.
pub(crate) fn rank_model(
    files: &ModelFiles,
    transport: Arc<dyn Transport>,
    mode: PlacementMode,
    device: &Device,
) -> anyhow::Result<(Llama, usize)> {
    rank_model_for(files, transport, mode, device, PROMPT.len() + NEW)
}

/// [`rank_model`] for sequences of up to `max_len` positions.
fn rank_model_for(
    files: &ModelFiles,
    transport: Arc<dyn Transport>,
    mode: PlacementMode,
    device: &Device,
    max_len: usize,
) -> anyhow::Result<(Llama, usize)> {
    let cfg = &files.config;
    let map = Llama::plan_ranks(
        cfg,
        transport.as_ref(),
        &RankRequest {
            device,
            limit: None,
            dtype: DType::F32,
            prompt_len: max_len,
            max_len,
            choice: &DeviceMapChoice::Mode(mode),
            prefetch_depth: 1,
        },
    )?;
    let layers = map.devices[transport.rank()].layers();
    let store_cfg = StoreConfig {
        dtype: Some(DType::F32),
        only_units: Some(Llama::rank_units(cfg, layers.clone())),
        ..Default::default()
    };
    let store = Arc::new(loader::load_store_config(files, &store_cfg, device, true)?);
    let units = store.units().len();
    let model = Llama::builder(files, store)
        .rank(device, &map, transport)
        .dtype(DType::F32)
        .max_len(max_len)
        .build()?;
    assert_eq!(model.stages()[0].1, layers);
    Ok((model, units))
}

pub(crate) fn net(rank: usize, world: usize, port: u16, timeout: Duration) -> NetConfig {
    let mut c = NetConfig::new(rank, world, "127.0.0.1", port, timeout);
    // A dead peer is five silent beats (2.5 s): room for a loaded machine; the deaths these
    // tests cause close the connection, noticed at once.
    c.heartbeat = Duration::from_millis(500);
    c
}

/// Each rank's tokens and the units it loaded, in rank order.
fn on_ranks(files: &ModelFiles, world: usize) -> Vec<anyhow::Result<(Vec<u32>, usize)>> {
    let port = free_port().unwrap();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let files = files.clone();
            std::thread::spawn(move || -> anyhow::Result<(Vec<u32>, usize)> {
                let t = TcpTransport::connect(&net(rank, world, port, Duration::from_secs(30)))?;
                let (model, units) =
                    rank_model(&files, Arc::new(t), PlacementMode::Balanced, &Device::Cpu)?;
                let mut sampler = LogitsProcessor::new(0, None, None);
                let (tokens, _) =
                    generate_ranks(&model, &PROMPT, NEW, &mut sampler, &[], |_| Ok(()))?;
                Ok((tokens, units))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn ranks_generate_the_tokens_of_one_process() -> anyhow::Result<()> {
    for kind in [
        Tiny::Llama {
            tied: false,
            bias: false,
        },
        Tiny::Llama {
            tied: true,
            bias: true,
        },
        Tiny::Gemma2,
    ] {
        let (_dir, files) = tiny(kind, "tokens")?;
        let want = one_process(&files, &Device::Cpu)?;
        assert_eq!(want.len(), NEW);
        let layers = files.config.num_hidden_layers;
        for world in [2, 3] {
            let out = on_ranks(&files, world);
            let errors: Vec<String> = out
                .iter()
                .enumerate()
                .filter_map(|(r, o)| o.as_ref().err().map(|e| format!("rank {r}: {e:#}")))
                .collect();
            anyhow::ensure!(errors.is_empty(), "{kind:?}, {world} ranks: {errors:?}");
            let mut units = 0;
            for (rank, got) in out.into_iter().enumerate() {
                let (tokens, n) = got.map_err(|e| anyhow::anyhow!("{kind:?} rank {rank}: {e}"))?;
                assert_eq!(tokens, want, "{kind:?}, {world} ranks, rank {rank}");
                units += n;
            }
            // Each rank loaded only its layers, the first the embeddings, the last the norm and
            // the head (the embeddings again when tied).
            assert_eq!(units, layers + 3, "{kind:?}, {world} ranks");
        }
    }
    Ok(())
}

#[test]
fn a_rank_that_dies_fails_the_others_naming_it() -> anyhow::Result<()> {
    let (_dir, files) = tiny(
        Tiny::Llama {
            tied: false,
            bias: false,
        },
        "dies",
    )?;
    let port = free_port()?;
    let timeout = Duration::from_secs(20);
    let start = Instant::now();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let files = files.clone();
            std::thread::spawn(move || -> anyhow::Result<(Duration, String)> {
                let t = Arc::new(TcpTransport::connect(&net(rank, 2, port, timeout))?);
                let (model, _) =
                    rank_model(&files, t.clone(), PlacementMode::Balanced, &Device::Cpu)?;
                let mut sampler = LogitsProcessor::new(0, None, None);
                let mut seen = 0;
                let r = generate_ranks(&model, &PROMPT, NEW, &mut sampler, &[], |_| {
                    seen += 1;
                    if rank == 1 && seen == 3 {
                        // The last rank dies after its third token, without a goodbye.
                        t.abort();
                    }
                    Ok(())
                });
                let e = r.err().map(|e| e.to_string()).unwrap_or_default();
                Ok((start.elapsed(), e))
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (took, e0) = out[0].as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
    // Noticed by the closed connection, long before the timeout.
    assert!(*took < timeout / 2, "{took:?}: {e0}");
    assert!(e0.contains("rank 1"), "{e0}");
    assert!(e0.contains("died"), "{e0}");
    Ok(())
}

#[test]
fn a_rank_that_fails_tells_the_others_why() -> anyhow::Result<()> {
    let (_dir, files) = tiny(
        Tiny::Llama {
            tied: true,
            bias: false,
        },
        "fails",
    )?;
    let port = free_port()?;
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            let files = files.clone();
            std::thread::spawn(move || -> anyhow::Result<String> {
                let t = TcpTransport::connect(&net(rank, 3, port, Duration::from_secs(20)))?;
                let (model, _) =
                    rank_model(&files, Arc::new(t), PlacementMode::Balanced, &Device::Cpu)?;
                let mut sampler = LogitsProcessor::new(0, None, None);
                let mut seen = 0;
                let r = generate_ranks(&model, &PROMPT, NEW, &mut sampler, &[], |_| {
                    seen += 1;
                    if rank == 1 && seen == 2 {
                        candle_core::bail!("disk on fire");
                    }
                    Ok(())
                });
                Ok(r.err().map(|e| e.to_string()).unwrap_or_default())
            })
        })
        .collect();
    let out: Vec<String> = handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect::<anyhow::Result<_>>()?;
    assert!(out[1].contains("disk on fire"), "{}", out[1]);
    // Rank 2 waits on rank 1's hidden state and has its reason; rank 0 has it from rank 1
    // (sending to it) or through rank 2 (waiting on its token).
    assert!(out[2].contains("rank 1 failed: disk on fire"), "{}", out[2]);
    assert!(out[0].contains("failed: disk on fire"), "{}", out[0]);
    Ok(())
}

/// Continuous batching over ranks: rank 0's batcher sends each ragged step down the pipeline
/// (requests arriving at different steps, prompts longer than a chunk, one cancelled, the
/// warm-up's sequences dropped), the others follow until it stops; every request's greedy
/// tokens equal those of the same batcher over the whole model in one process.
#[test]
fn a_batcher_over_ranks_gives_the_tokens_of_one_process() -> anyhow::Result<()> {
    batcher_over_ranks(&Device::Cpu)
}

/// The same with every rank on GPU 0 (hidden states over TCP: NCCL takes one GPU a rank).
#[test]
fn a_batcher_over_ranks_on_one_gpu_gives_the_tokens_of_one_process() -> anyhow::Result<()> {
    match Device::new_cuda(0) {
        Ok(d) => batcher_over_ranks(&d),
        Err(_) => {
            eprintln!("skipped: no GPU");
            Ok(())
        }
    }
}

fn batcher_over_ranks(device: &Device) -> anyhow::Result<()> {
    use candle_offload_models::batching::{BatchOptions, Batcher, SamplingParams, SeqRequest};

    use crate::batching::{drain, prompt, Outcomes};

    let (_dir, files) = tiny(
        Tiny::Llama {
            tied: false,
            bias: true,
        },
        "batch",
    )?;
    let max_len = 64;
    let opts = BatchOptions {
        max_running: 3,
        step_tokens: 12,
        prompt_chunk: 5,
        kv_limit_bytes: u64::MAX,
        max_len,
    };
    let req = |n: usize, salt: usize, new: usize| SeqRequest {
        prompt: prompt(n, salt),
        max_new_tokens: new,
        sampling: SamplingParams::default(),
        end_tokens: vec![],
    };
    let reqs = vec![
        (0, 1, req(11, 0, 8)),
        (0, 2, req(4, 1, 6)),
        (2, 3, req(7, 2, 9)),
        (3, 4, req(20, 3, 5)),
        (3, 5, req(6, 4, 12)),
    ];
    let cancel = Some((6, 3));
    let run = |model: Llama| -> anyhow::Result<Outcomes> {
        let model = Arc::new(model);
        let mut batcher = Batcher::new(model.clone(), opts);
        batcher.warm_up()?;
        let out = drain(&mut batcher, reqs.clone(), cancel)?;
        model.stop_ranks()?;
        Ok(out)
    };
    let store = Arc::new(loader::load_store(&files, DType::F32, device, None)?);
    let whole = Llama::builder(&files, store)
        .device(device)
        .max_len(max_len)
        .build()?;
    let want = run(whole)?;
    assert_eq!(want.len(), 5);
    for world in [2, 3] {
        let port = free_port()?;
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (files, reqs, device) = (files.clone(), reqs.clone(), device.clone());
                std::thread::spawn(move || -> anyhow::Result<Option<Outcomes>> {
                    let t =
                        TcpTransport::connect(&net(rank, world, port, Duration::from_secs(30)))?;
                    let (model, _) = rank_model_for(
                        &files,
                        Arc::new(t),
                        PlacementMode::Balanced,
                        &device,
                        max_len,
                    )?;
                    if rank > 0 {
                        let steps = model.follow_steps()?;
                        anyhow::ensure!(steps > 0, "rank {rank} followed no step");
                        return Ok(None);
                    }
                    let model = Arc::new(model);
                    let mut batcher = Batcher::new(model.clone(), opts);
                    batcher.warm_up()?;
                    let out = drain(&mut batcher, reqs, cancel)?;
                    model.stop_ranks()?;
                    Ok(Some(out))
                })
            })
            .collect();
        for (rank, h) in handles.into_iter().enumerate() {
            let got = h
                .join()
                .unwrap()
                .map_err(|e| anyhow::anyhow!("{world} ranks, rank {rank}: {e:#}"))?;
            if let Some(got) = got {
                assert_eq!(got, want, "{world} ranks");
            }
        }
    }
    Ok(())
}
