//! The CPU threads the CPU kernels run on: a pool of spinning workers for the quantized and
//! 16-bit matmuls' short parallel regions, and the rayon pools a decode step's Candle ops run
//! on ([`on_cpu_pool`], [`on_cpu_step_pool`]).
//!
//! A decode step on the CPU is some 200 matmuls of a few hundred microseconds each. Rayon's
//! idle workers sleep on a futex between them, and on a virtual machine waking one costs about
//! as much as a small matmul itself (docs/tuning.md, CPU threads). llama.cpp's threads spin
//! between its ops instead. These workers do the same: after a region they spin (yielding the
//! core now and then, so that a runnable thread is not starved) for `SPIN` before parking.
//!
//! `for_each_chunk_mut` is the workers' only entry point: `data` cut into chunks, `f(index, chunk)`
//! run for each on the calling thread and the workers, returning when every chunk is done.
//! One region runs at a time; a caller that finds the pool busy (another thread's region, or
//! a task of a region calling in again) runs its chunks itself.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_millis(5);

/// The threads a region runs on (the caller and the workers) asked for before the pool
/// started ([`ask_threads`]); unset: one per core the process may use.
static ASKED: OnceLock<usize> = OnceLock::new();

/// Asks for a pool of `threads` threads (the caller and the workers; at least 1). The pool is
/// one per process, made on the first region: the first ask before that sizes it, and the
/// returned value is the size it has or will have, which differs from `threads` when the pool
/// was sized by an earlier ask (or started without one).
pub fn ask_threads(threads: usize) -> usize {
    let _ = ASKED.set(threads.max(1));
    match POOL.get() {
        Some(pool) => pool.workers().len() + 1,
        None => *ASKED.get().expect("set above"),
    }
}

/// One region's chunk function over type-erased chunk pointers.
type ChunkFn<'a> = dyn Fn(usize) + Sync + 'a;

/// The region being run: the caller's task function, with its lifetime erased.
#[derive(Clone, Copy)]
struct Job {
    task: *const ChunkFn<'static>,
    chunks: usize,
}

// SAFETY: `task` points to a `Sync` closure; workers call it only between the region's
// publication and their check-in (`done`), while the caller keeps it alive (see `run`).
unsafe impl Send for Job {}

struct Pool {
    job: Mutex<Option<Job>>,
    /// Bumped once per region, after `job` is set.
    epoch: AtomicU64,
    /// The next chunk to claim.
    next: AtomicUsize,
    /// Workers that took the current region's job and have not finished with it.
    active: AtomicUsize,
    /// A task panicked in a worker during the current region.
    panicked: AtomicBool,
    /// Idle workers park at once instead of spinning, until the next region ([`park_idle_workers`]).
    hush: AtomicBool,
    /// One region at a time.
    busy: Mutex<()>,
    /// The worker threads, set once after they are spawned (empty if none could be).
    workers: OnceLock<Vec<Thread>>,
}

impl Pool {
    fn workers(&self) -> &[Thread] {
        self.workers.get().map_or(&[], Vec::as_slice)
    }
}

/// The pool, made on the first region.
static POOL: OnceLock<&'static Pool> = OnceLock::new();

fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let n = ASKED.get().copied().unwrap_or(cores).max(1) - 1;
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            job: Mutex::new(None),
            epoch: AtomicU64::new(0),
            next: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            hush: AtomicBool::new(false),
            busy: Mutex::new(()),
            workers: OnceLock::new(),
        }));
        let mut threads = Vec::new();
        for i in 0..n {
            let spawned = std::thread::Builder::new()
                // At most 15 characters on Linux: a longer name is cut, and a profile then
                // sees every worker as one thread.
                .name(format!("offload-spin-{i}"))
                .spawn(move || worker(pool));
            if let Ok(handle) = spawned {
                threads.push(handle.thread().clone());
            }
        }
        let _ = pool.workers.set(threads);
        pool
    })
}

fn worker(pool: &'static Pool) {
    let mut seen = 0u64;
    loop {
        let idle = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = pool.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                if idle.elapsed() > SPIN || pool.hush.load(Ordering::Acquire) {
                    std::thread::park_timeout(Duration::from_millis(50));
                } else {
                    std::thread::yield_now();
                }
            } else {
                std::hint::spin_loop();
            }
        }
        // Take the job and count in while holding its lock: the caller withdraws the job
        // under the same lock, then waits only for the workers counted in.
        let job = {
            let job = pool.job.lock().unwrap_or_else(|e| e.into_inner());
            if job.is_some() {
                pool.active.fetch_add(1, Ordering::AcqRel);
            }
            *job
        };
        let Some(job) = job else {
            continue;
        };
        // SAFETY: this worker counted itself in while the job was published; the caller does
        // not return (nor drop the closure) before `active` is back to zero.
        let task = unsafe { &*job.task };
        let r = catch_unwind(AssertUnwindSafe(|| loop {
            let i = pool.next.fetch_add(1, Ordering::AcqRel);
            if i >= job.chunks {
                break;
            }
            task(i);
        }));
        if r.is_err() {
            pool.panicked.store(true, Ordering::Release);
        }
        pool.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs `task(i)` for every `i < chunks` on this thread and the pool's workers.
fn run(chunks: usize, task: &ChunkFn<'_>) {
    let pool = pool();
    let guard = match pool.busy.try_lock() {
        Ok(g) if !pool.workers().is_empty() && chunks > 1 => g,
        _ => {
            (0..chunks).for_each(task);
            return;
        }
    };
    // SAFETY: only the lifetime is erased. The pointer is published for this region; a
    // worker uses it only after counting itself in (`active`) while it is published, and this
    // function withdraws it and waits for `active` to return to zero before it returns, so
    // `task` outlives every call through the pointer.
    let erased: *const ChunkFn<'static> =
        unsafe { std::mem::transmute::<*const ChunkFn<'_>, *const ChunkFn<'static>>(task) };
    pool.next.store(0, Ordering::Release);
    pool.panicked.store(false, Ordering::Release);
    pool.hush.store(false, Ordering::Release);
    *pool.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(Job {
        task: erased,
        chunks,
    });
    pool.epoch.fetch_add(1, Ordering::AcqRel);
    for w in pool.workers() {
        w.unpark();
    }
    let mine = catch_unwind(AssertUnwindSafe(|| loop {
        let i = pool.next.fetch_add(1, Ordering::AcqRel);
        if i >= chunks {
            break;
        }
        task(i);
    }));
    if mine.is_err() {
        // Let the workers stop claiming chunks, then pass the panic on.
        pool.next.store(chunks, Ordering::Release);
    }
    // Withdraw the job: a worker that has not taken it yet will not, and the ones that have
    // are finishing the chunks they claimed (no worker that was not scheduled holds us up).
    *pool.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let mut spins = 0u32;
    while pool.active.load(Ordering::Acquire) > 0 {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    let panicked = pool.panicked.load(Ordering::Acquire);
    drop(guard);
    if let Err(p) = mine {
        std::panic::resume_unwind(p);
    }
    if panicked {
        panic!("a task of the CPU matmul pool panicked in a worker");
    }
}

/// Lets the idle workers park now rather than spin out their `SPIN`, until the next region
/// wakes them: for a caller about to run work on another pool of threads (Candle's CPU
/// quantized matmul for block types this crate has no kernel for, such as the K-quants, and
/// Candle's GEMM), whose threads would otherwise share every core with these spinning ones.
pub fn park_idle_workers() {
    if let Some(pool) = POOL.get() {
        pool.hush.store(true, Ordering::Release);
    }
}

/// Runs `f` on a thread of rayon's pool when `device` is the CPU (and this thread is not one
/// already): the quantized matmuls and Candle's parallel CPU ops inside `f` then split their
/// work by joins whose other half this thread runs itself when no worker is free, instead of
/// injecting each op into the pool from outside and sleeping until a worker has run it. A
/// decode step is some 200 small ops; one injection per step replaces one per op.
pub fn on_cpu_pool<R: Send>(device: &candle_core::Device, f: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() && rayon::current_thread_index().is_none() {
        rayon::scope(|_| f())
    } else {
        f()
    }
}

/// The most rows of a step whose Candle ops [`on_cpu_step_pool`] runs on one thread: one, a
/// decode step of one sequence (with more rows, Candle's own matmul of F32 weights, which
/// splits its work over the current rayon pool, would run on one core).
pub const SERIAL_STEP_ROWS: usize = 1;

/// [`on_cpu_pool`] for a step of `rows` activation rows: a decode step of one sequence (at
/// most [`SERIAL_STEP_ROWS`]) runs `f` on a rayon pool of one thread, so that Candle's own CPU
/// ops inside it (norms, RoPE, attention's small matmuls, SiLU, softmax: vectors of a few
/// thousand values, and the one-row matmul of F32 weights, which Candle runs on one thread
/// anyway) run serially instead of each waking a sleeping rayon worker, which costs about as
/// much as the op on a virtual machine (docs/tuning.md, CPU threads). The quantized and
/// F16/BF16 matmuls keep every core through this module's spinning workers. Larger steps (prompts,
/// batches) use rayon's whole pool as [`on_cpu_pool`] does. The one-thread pool is the
/// process's: two threads decoding on the CPU at once take turns.
pub fn on_cpu_step_pool<R: Send>(
    device: &candle_core::Device,
    rows: usize,
    f: impl FnOnce() -> R + Send,
) -> R {
    static SERIAL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    if device.is_cpu() && rows <= SERIAL_STEP_ROWS && rayon::current_thread_index().is_none() {
        let pool = SERIAL.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .thread_name(|_| "candle-offload-step".into())
                .build()
                .ok()
        });
        if let Some(pool) = pool {
            return pool.install(f);
        }
    }
    on_cpu_pool(device, f)
}

/// Threads a region runs on: the pool's workers and the caller.
pub fn threads() -> usize {
    pool().workers().len() + 1
}

/// `f(i, chunk)` for each `chunk_len`-long chunk of `data` (the last one shorter), the chunks
/// shared out between this thread and the pool's spinning workers; returns when all are done.
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk_len: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunk_len = chunk_len.max(1);
    let len = data.len();
    let chunks = len.div_ceil(chunk_len);
    let base = SendPtr(data.as_mut_ptr());
    let task = |i: usize| {
        let start = i * chunk_len;
        let end = (start + chunk_len).min(len);
        let p = base;
        // SAFETY: chunk `i` is `start..end` of `data`, inside it (i < chunks); each chunk
        // index is claimed once per region (`next`), so no two calls form overlapping slices,
        // and `data` stays mutably borrowed by this function until `run` has waited for all.
        let chunk = unsafe { std::slice::from_raw_parts_mut(p.0.add(start), end - start) };
        f(i, chunk);
    };
    run(chunks, &task);
}

/// A raw pointer that may cross threads: each chunk it addresses goes to one thread only.
struct SendPtr<T>(*mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: see `for_each_chunk_mut`: the pointed-to chunks are disjoint per task and `T: Send`.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above; the pointer is only copied, never dereferenced outside a claimed chunk.
unsafe impl<T: Send> Sync for SendPtr<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element is visited once by the chunk that holds it, over many regions in a row,
    /// with uneven last chunks; nested calls (a task calling in) run inline.
    #[test]
    fn chunks_cover_the_data_once() {
        for len in [0usize, 1, 7, 64, 1000, 4097] {
            for chunk in [1usize, 3, 64, 5000] {
                let mut v = vec![0u32; len];
                for round in 0..50u32 {
                    for_each_chunk_mut(&mut v, chunk, |i, c| {
                        for (j, x) in c.iter_mut().enumerate() {
                            assert_eq!(*x, round, "element {} visited twice", i * chunk + j);
                            *x += 1;
                        }
                    });
                }
                assert!(v.iter().all(|&x| x == 50), "len {len} chunk {chunk}");
            }
        }
        let mut outer = vec![0u32; 8];
        for_each_chunk_mut(&mut outer, 2, |_, c| {
            let mut inner = vec![1u32; 10];
            for_each_chunk_mut(&mut inner, 3, |_, d| d.iter_mut().for_each(|x| *x *= 2));
            c.iter_mut().for_each(|x| *x = inner.iter().sum());
        });
        assert!(outer.iter().all(|&x| x == 20));
    }

    /// Workers told to park ([`park_idle_workers`]) come back for the next region, which the workers
    /// share again: every chunk done once, and some on another thread than the caller's (other
    /// tests use the pool at the same time: a region that finds it busy runs on the caller
    /// alone, so this tries a few times).
    #[test]
    fn parked_workers_wake_for_the_next_region() {
        let me = std::thread::current().id();
        let mut woke = pool().workers().is_empty();
        for _ in 0..50 {
            park_idle_workers();
            std::thread::sleep(Duration::from_millis(10));
            let mut v = vec![0u32; 64];
            let others = AtomicUsize::new(0);
            for_each_chunk_mut(&mut v, 1, |_, c| {
                c[0] += 1;
                if std::thread::current().id() != me {
                    others.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_micros(200));
            });
            assert!(v.iter().all(|&x| x == 1));
            if others.load(Ordering::Relaxed) > 0 {
                woke = true;
                break;
            }
        }
        assert!(woke, "no worker woke after park_idle_workers");
    }

    /// A panicking task reaches the caller as a panic, and the pool still works afterwards.
    #[test]
    fn a_panic_reaches_the_caller() {
        let mut v = vec![0u8; 64];
        let r = catch_unwind(AssertUnwindSafe(|| {
            for_each_chunk_mut(&mut v, 1, |i, _| {
                if i == 37 {
                    panic!("task 37");
                }
            })
        }));
        assert!(r.is_err());
        for_each_chunk_mut(&mut v, 8, |_, c| c.iter_mut().for_each(|x| *x = 1));
        assert!(v.iter().all(|&x| x == 1));
    }
}
