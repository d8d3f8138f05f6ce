//! The NCCL transport: on the CPU, what a rank without a GPU or with another transport is
//! told; on one GPU, tensors sent to itself over NCCL and the initialisation's deadline when a
//! rank never comes; on two GPUs, tensors both ways and two ranks generating the tokens of one
//! process. The GPU tests need NCCL (as the doctor finds it) and say so when it is missing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_offload::dist::{
    free_port, DistError, NcclTransport, TcpTransport, TensorPath, Transport,
};
use candle_offload::doctor::find_nccl;
use candle_offload::placement::PlacementMode;
use candle_offload_models::generation::generate_ranks;
use candle_transformers::generation::LogitsProcessor;

use crate::dist::{net, one_process, rank_model, tiny, NEW, PROMPT};
use crate::models::Tiny;

/// NCCL's library as the binaries find it, or `None` (the test then says why it skips).
fn nccl_library() -> Option<String> {
    let dirs = candle_offload_suite::dist::nccl_search_dirs(|k| std::env::var(k).ok());
    let found = find_nccl(&dirs).found.map(|f| f.path);
    if found.is_none() {
        eprintln!("skipped: NCCL (libnccl.so.2) not found");
    }
    found
}

/// GPU `ordinal`, or `None` (no CUDA build, or no such GPU).
fn gpu(ordinal: usize) -> Option<Device> {
    let d = Device::new_cuda(ordinal).ok();
    if d.is_none() {
        eprintln!("skipped: no GPU {ordinal}");
    }
    d
}

#[test]
fn nccl_on_a_rank_without_a_gpu_is_an_error_on_every_rank() {
    let port = free_port().unwrap();
    let t0 = Instant::now();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let cfg = net(rank, 2, port, Duration::from_secs(20));
                NcclTransport::connect(&cfg, &Device::Cpu, "libnccl.so.2").unwrap_err()
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let e = h.join().unwrap();
        let text = e.to_string();
        // Its own error, or the peer's, which it sent before leaving.
        assert!(
            matches!(e, DistError::Nccl { .. } | DistError::Remote { .. }),
            "rank {rank}: {e}"
        );
        assert!(text.contains("Cpu"), "rank {rank}: {text}");
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[test]
fn a_tcp_rank_and_an_nccl_rank_are_refused_at_the_rendezvous() {
    let port = free_port().unwrap();
    let zero = std::thread::spawn(move || {
        TcpTransport::connect(&net(0, 2, port, Duration::from_secs(10))).unwrap_err()
    });
    let one = NcclTransport::connect(
        &net(1, 2, port, Duration::from_secs(10)),
        &Device::Cpu,
        "libnccl.so.2",
    )
    .unwrap_err();
    let zero = zero.join().unwrap();
    for e in [zero.to_string(), one.to_string()] {
        assert!(e.contains("over NCCL, rank 0 over TCP"), "{e}");
    }
}

/// Every dtype a hidden state or token can have, a few shapes, sent by rank 0 of one to
/// itself over NCCL: the same bits back, on the GPU.
#[test]
fn nccl_carries_tensors_bit_for_bit_on_one_gpu() -> anyhow::Result<()> {
    let (Some(dev), Some(lib)) = (gpu(0), nccl_library()) else {
        return Ok(());
    };
    let port = free_port()?;
    let t = NcclTransport::connect(&net(0, 1, port, Duration::from_secs(60)), &dev, &lib)?;
    let base = Tensor::arange(0f32, 2. * 3. * 4., &dev)?.reshape((2, 3, 4))?;
    let odd = Tensor::new(&[f32::NAN, f32::INFINITY, -0.0, 1e-40, -3.5, 65504.0], &dev)?;
    for dtype in [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F64,
        DType::U32,
        DType::U8,
        DType::I64,
    ] {
        for x in [&base, &odd] {
            let x = x.to_dtype(dtype)?;
            let back = t.loopback(&x)?;
            assert!(back.device().same_device(&dev));
            assert_eq!((back.dtype(), back.dims()), (dtype, x.dims()));
            let (a, b) = (bits(&x)?, bits(&back)?);
            assert_eq!(a, b, "{dtype:?}");
        }
    }
    // Strided input is sent contiguous; an empty tensor and a host tensor come back on the GPU.
    let strided = base.transpose(0, 2)?;
    assert_eq!(bits(&t.loopback(&strided)?)?, bits(&strided.contiguous()?)?);
    let empty = Tensor::zeros((0, 5), DType::F16, &dev)?;
    assert_eq!(t.loopback(&empty)?.dims(), &[0, 5]);
    let host = Tensor::new(&[1u32, 2, 3], &Device::Cpu)?;
    let back = t.loopback(&host)?;
    assert!(back.device().is_cuda());
    assert_eq!(back.to_vec1::<u32>()?, [1, 2, 3]);
    Ok(())
}

fn bits(t: &Tensor) -> anyhow::Result<Vec<u8>> {
    let flat = t.flatten_all()?.to_device(&Device::Cpu)?;
    Ok(match t.dtype() {
        DType::U8 => flat.to_vec1::<u8>()?,
        DType::U32 => flat
            .to_vec1::<u32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::I64 => flat
            .to_vec1::<i64>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F16 => flat
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::BF16 => flat
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::F32 => flat
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F64 => flat
            .to_vec1::<f64>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        other => anyhow::bail!("{other:?}"),
    })
}

/// Rank 1 joins over TCP and takes NCCL's unique id but never creates its communicator: rank
/// 0's initialisation gives up at the timeout with an error that says so, and returns.
#[test]
fn nccl_initialisation_gives_up_at_the_timeout() -> anyhow::Result<()> {
    let (Some(dev), Some(lib)) = (gpu(0), nccl_library()) else {
        return Ok(());
    };
    let port = free_port()?;
    let timeout = Duration::from_secs(4);
    let silent = std::thread::spawn(move || -> anyhow::Result<()> {
        let mut cfg = net(1, 2, port, timeout);
        cfg.tensors = TensorPath::Nccl;
        let t = TcpTransport::connect(&cfg)?;
        let id = t.broadcast_bytes(0, &[])?;
        assert_eq!(id.len(), 128);
        // Alive (heartbeats) but never in NCCL, until rank 0 has given up.
        std::thread::sleep(timeout * 2);
        Ok(())
    });
    let t0 = Instant::now();
    let e = NcclTransport::connect(&net(0, 2, port, timeout), &dev, &lib).unwrap_err();
    let took = t0.elapsed();
    assert!(took >= timeout && took < timeout * 2, "{took:?}: {e}");
    assert!(matches!(e, DistError::Nccl { .. }), "{e}");
    assert!(e.to_string().contains("not ready after"), "{e}");
    silent.join().unwrap()?;
    Ok(())
}

/// Two GPUs, one rank each: tensors both ways over NCCL, then a dead peer noticed while
/// waiting on it.
#[test]
fn nccl_carries_tensors_between_two_gpus() -> anyhow::Result<()> {
    let (Some(_), Some(_), Some(lib)) = (gpu(0), gpu(1), nccl_library()) else {
        return Ok(());
    };
    let port = free_port()?;
    let timeout = Duration::from_secs(30);
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let lib = lib.clone();
            std::thread::spawn(move || -> anyhow::Result<Vec<f32>> {
                let dev = Device::new_cuda(rank)?;
                let t = NcclTransport::connect(&net(rank, 2, port, timeout), &dev, &lib)?;
                let peer = 1 - rank;
                let mine = Tensor::arange(0f32, 1024., &dev)?.affine(1.0, rank as f64 * 1e4)?;
                let mut got = Vec::new();
                for round in 0..3 {
                    // Rank 0 sends first, rank 1 receives first: no deadlock either way.
                    if rank == 0 {
                        t.send_tensor(peer, &mine.affine(1.0, round as f64)?)?;
                        got = t.recv_tensor(peer, &dev)?.to_vec1::<f32>()?;
                    } else {
                        got = t.recv_tensor(peer, &dev)?.to_vec1::<f32>()?;
                        t.send_tensor(peer, &mine.affine(1.0, round as f64)?)?;
                    }
                }
                t.barrier()?;
                Ok(got)
            })
        })
        .collect();
    let out: Vec<Vec<f32>> = handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect::<anyhow::Result<_>>()?;
    // Each has the other's last tensor (round 2).
    assert_eq!(out[0][5], 1e4 + 5.0 + 2.0);
    assert_eq!(out[1][5], 5.0 + 2.0);
    Ok(())
}

/// Two GPUs, one rank each, over NCCL: the greedy tokens of one process on one GPU.
#[test]
fn two_ranks_over_nccl_generate_the_tokens_of_one_gpu() -> anyhow::Result<()> {
    let (Some(dev0), Some(_), Some(lib)) = (gpu(0), gpu(1), nccl_library()) else {
        return Ok(());
    };
    let (_dir, files) = tiny(
        Tiny::Llama {
            tied: false,
            bias: false,
        },
        "nccl",
    )?;
    let want = one_process(&files, &dev0)?;
    let port = free_port()?;
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (files, lib) = (files.clone(), lib.clone());
            std::thread::spawn(move || -> anyhow::Result<Vec<u32>> {
                let dev = Device::new_cuda(rank)?;
                let t = NcclTransport::connect(
                    &net(rank, 2, port, Duration::from_secs(60)),
                    &dev,
                    &lib,
                )?;
                let (model, _) = rank_model(&files, Arc::new(t), PlacementMode::Balanced, &dev)?;
                let mut sampler = LogitsProcessor::new(0, None, None);
                Ok(generate_ranks(&model, &PROMPT, NEW, &mut sampler, &[], |_| Ok(()))?.0)
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let got = h.join().unwrap()?;
        assert_eq!(got, want, "rank {rank}");
    }
    Ok(())
}
