//! The TCP transport on loopback, one thread per rank: tensors round-trip bit for bit, small
//! values and barriers, and every way a peer fails: never coming, dying, a world size or rank
//! that disagrees.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use super::*;

fn cfg(rank: usize, world: usize, port: u16, timeout_ms: u64) -> NetConfig {
    let mut c = NetConfig::new(
        rank,
        world,
        "127.0.0.1",
        port,
        Duration::from_millis(timeout_ms),
    );
    // A dead peer is five silent beats (1 s): room for a loaded machine.
    c.heartbeat = Duration::from_millis(200);
    c
}

/// Runs `f(transport)` on `world` ranks, one thread each, and returns their results in rank
/// order.
fn on_ranks<T: Send + 'static>(
    world: usize,
    timeout_ms: u64,
    f: impl Fn(TcpTransport) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let port = free_port().unwrap();
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let f = f.clone();
            std::thread::spawn(move || {
                let t = TcpTransport::connect(&cfg(r, world, port, timeout_ms)).unwrap();
                f(t)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// `n` values that fill the mantissa, the same on every call.
fn values(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.731).sin() * 1e3).collect()
}

fn samples() -> Vec<Tensor> {
    let dev = Device::Cpu;
    let x = Tensor::from_vec(values(105), (3, 5, 7), &dev).unwrap();
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        out.push(x.to_dtype(dtype).unwrap());
    }
    out.push(Tensor::new(&[1u32, 2, 3, u32::MAX], &dev).unwrap());
    out.push(Tensor::new(&[[-1i64, 5]], &dev).unwrap());
    out.push(Tensor::new(&[0u8, 255], &dev).unwrap());
    out.push(Tensor::new(2.5f32, &dev).unwrap());
    // A hidden state of a prompt: megabytes in one frame.
    out.push(Tensor::from_vec(values(512 * 1024), (1, 512, 1024), &dev).unwrap());
    out
}

fn bits(t: &Tensor) -> (DType, Vec<usize>, Vec<u8>) {
    let (_, bytes) = wire::encode(t, 0).unwrap();
    (t.dtype(), t.dims().to_vec(), bytes)
}

#[test]
fn tensors_round_trip_bit_for_bit_along_a_pipeline() {
    // Rank 0 sends each tensor to 1, which passes it on to 2, which sends it back to 0.
    let out = on_ranks(3, 10_000, |t| {
        let dev = Device::Cpu;
        let n = samples().len();
        match t.rank() {
            0 => {
                let sent = samples();
                for x in &sent {
                    t.send_tensor(1, x).unwrap();
                }
                (0..n)
                    .map(|_| bits(&t.recv_tensor(2, &dev).unwrap()))
                    .collect::<Vec<_>>()
            }
            r => {
                for _ in 0..n {
                    let x = t.recv_tensor(r - 1, &dev).unwrap();
                    t.send_tensor((r + 1) % 3, &x).unwrap();
                }
                Vec::new()
            }
        }
    });
    let want: Vec<_> = samples().iter().map(bits).collect();
    assert_eq!(out[0].len(), want.len());
    for (got, want) in out[0].iter().zip(&want) {
        assert_eq!(got.0, want.0);
        assert_eq!(got.1, want.1);
        assert!(
            got.2 == want.2,
            "{:?} {:?} changed on the way",
            want.0,
            want.1
        );
    }
}

#[test]
fn broadcasts_gathers_and_barriers() {
    let out = on_ranks(3, 10_000, |t| {
        let ids = broadcast_tokens(&t, 2, &[7, 8, t.rank() as u32]).unwrap();
        let plan: Vec<usize> =
            broadcast_json(&t, 0, (t.rank() == 0).then_some(&vec![0usize, 10, 20])).unwrap();
        let all: Vec<u64> = gather_json(&t, 0, &(100 + t.rank() as u64)).unwrap();
        t.barrier().unwrap();
        t.barrier().unwrap();
        (ids, plan, all)
    });
    for (r, (ids, plan, all)) in out.iter().enumerate() {
        assert_eq!(ids, &vec![7, 8, 2], "rank {r}");
        assert_eq!(plan, &vec![0, 10, 20], "rank {r}");
        if r == 0 {
            assert_eq!(all, &vec![100, 101, 102]);
        } else {
            assert!(all.is_empty());
        }
    }
}

#[test]
fn a_rank_that_never_comes_is_a_timeout_naming_it() {
    let port = free_port().unwrap();
    // Ranks 0 and 1 of 3 come; rank 2 never does.
    let h1 = std::thread::spawn(move || TcpTransport::connect(&cfg(1, 3, port, 800)));
    let t0 = Instant::now();
    let e = TcpTransport::connect(&cfg(0, 3, port, 800)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(matches!(e, DistError::Timeout { rank: 2, .. }), "{e}");
    assert!(e.to_string().contains("rank 2"), "{e}");
    // Rank 1 waited for the table, which never came: it names rank 0.
    let e1 = h1.join().unwrap().unwrap_err();
    assert_eq!(e1.peer(), Some(0), "{e1}");

    // Nobody listens: a rank above 0 gives up after its timeout, naming rank 0.
    let port = free_port().unwrap();
    let t0 = Instant::now();
    let e = TcpTransport::connect(&cfg(1, 2, port, 500)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert!(matches!(e, DistError::Timeout { rank: 0, .. }), "{e}");
}

#[test]
fn a_rank_that_dies_is_noticed_by_its_peers_within_the_timeout() {
    let out = on_ranks(3, 5_000, |t| match t.rank() {
        1 => {
            // Works one step, then dies without a goodbye.
            t.send_tensor(0, &Tensor::new(&[1f32], &Device::Cpu).unwrap())
                .unwrap();
            std::thread::sleep(Duration::from_millis(100));
            t.abort();
            None
        }
        r => {
            if r == 0 {
                t.recv_tensor(1, &Device::Cpu).unwrap();
            }
            let t0 = Instant::now();
            let e = t.recv_tensor(1, &Device::Cpu).unwrap_err();
            Some((e, t0.elapsed()))
        }
    });
    for (r, got) in out.iter().enumerate() {
        let Some((e, took)) = got else { continue };
        assert!(*took < Duration::from_secs(4), "rank {r} took {took:?}");
        assert!(
            matches!(e, DistError::PeerLost { rank: 1, .. }),
            "rank {r}: {e}"
        );
        assert!(e.to_string().contains("died"), "rank {r}: {e}");
    }
}

#[test]
fn a_peer_that_leaves_and_a_silent_wait_are_errors_not_hangs() {
    let out = on_ranks(2, 600, |t| {
        if t.rank() == 1 {
            drop(t);
            return None;
        }
        let e = t.recv_bytes(1).unwrap_err();
        Some(e)
    });
    let e = out[0].as_ref().unwrap();
    assert!(e.to_string().contains("left"), "{e}");
    // Both alive, but the awaited message never comes: a timeout naming the peer.
    let out = on_ranks(2, 600, |t| {
        let r = if t.rank() == 0 {
            Some(t.recv_tensor(1, &Device::Cpu).unwrap_err())
        } else {
            None
        };
        // Rank 1 stays until rank 0 gave up.
        std::thread::sleep(Duration::from_millis(900));
        r
    });
    let e = out[0].as_ref().unwrap();
    assert!(matches!(e, DistError::Timeout { rank: 1, .. }), "{e}");
}

#[test]
fn wrong_world_sizes_and_duplicate_ranks_are_refused() {
    // Rank 1 thinks there are 3 ranks, rank 0 that there are 2.
    let port = free_port().unwrap();
    let h = std::thread::spawn(move || TcpTransport::connect(&cfg(1, 3, port, 3000)));
    let e0 = TcpTransport::connect(&cfg(0, 2, port, 3000)).unwrap_err();
    assert!(e0.to_string().contains("world size 3"), "{e0}");
    let e1 = h.join().unwrap().unwrap_err();
    assert!(e1.to_string().contains("refused"), "{e1}");

    // Two processes both say they are rank 1.
    let port = free_port().unwrap();
    let a = std::thread::spawn(move || TcpTransport::connect(&cfg(1, 3, port, 3000)));
    let b = std::thread::spawn(move || TcpTransport::connect(&cfg(1, 3, port, 3000)));
    let e0 = TcpTransport::connect(&cfg(0, 3, port, 3000)).unwrap_err();
    assert!(e0.to_string().contains("rank 1 joined twice"), "{e0}");
    assert!(a.join().unwrap().is_err());
    assert!(b.join().unwrap().is_err());

    // Settings refused before any socket.
    for (rank, world) in [(2, 2), (0, 0)] {
        let e = TcpTransport::connect(&cfg(rank, world, 1, 100)).unwrap_err();
        assert!(matches!(e, DistError::InvalidConfig { .. }), "{e}");
    }
    // One rank alone needs no socket.
    let t = TcpTransport::connect(&cfg(0, 1, 1, 100)).unwrap();
    t.barrier().unwrap();
    assert_eq!(broadcast_tokens(&t, 0, &[5]).unwrap(), vec![5]);
}

#[test]
fn a_rank_that_fails_tells_the_others_why() {
    let out = on_ranks(3, 5_000, |t| {
        if t.rank() == 2 {
            t.fail("disk on fire");
            return None;
        }
        Some(t.recv_tensor(2, &Device::Cpu).unwrap_err())
    });
    for (r, e) in out.iter().enumerate().take(2) {
        let e = e.as_ref().unwrap();
        assert!(
            matches!(e, DistError::Remote { rank: 2, .. }),
            "rank {r}: {e}"
        );
        assert_eq!(e.to_string(), "rank 2 failed: disk on fire");
    }
}
