#!/usr/bin/env bash
# gpu_moe_session.sh: the GPU rows of the mixture-of-experts issue: bench_generate on a random
# Qwen3-30B-A3B-shaped GGUF (scripts/gguf_random_moe.py) against llama.cpp at the fewest
# `-ncmoe` that keeps its peak within each budget (`--llamacpp-moe`), in chained calls of the
# GPU machine (its /tmp survives ~30 s between calls).
#
# Here, before the calls: `scripts/gpu-pack.sh --bin bench_generate --tests` (CUDA), a copy of
# the pinned peer folder in .gpu/llamacpp, `git rev-parse --short=12 HEAD > .gpu/COMMIT`.
# Call 1 (carry .gpu/llamacpp, .gpu/test-integration.xz, .gpu/COMMIT; .gpu/bench_generate.xz
#   for a first run of ours while llama.cpp builds):
#   `bash scripts/gpu_moe_session.sh call1`
#   llama.cpp's CUDA build and a CPU-only llama-quantize in the background; the Q8_0 file of
#   ROUTING (uniform by default) written, then its Q4_K_M (`--allow-requantize`) in a detached
#   session that outlives the call; the expert-tier and batching tests on the GPU.
# Bench calls (carry .gpu/bench_generate.xz, .gpu/COMMIT):
#   `bash scripts/gpu_moe_session.sh bench WEIGHTS BUDGETS PROMPTS`
#   e.g. `bench q8_0 4,8,12 64`: ours and llama.cpp on /tmp/gguf/moe-ROUTING-WEIGHTS.gguf at
#   each budget and prompt length (POLICY=lfu, NO_PREFETCH=1 (the guessed experts' prefetch off) and GUESS=N (layers guessed ahead) for the other expert options,
#   SPLIT=fetch for every missing expert fetched instead of the split's choice,
#   PER_EXPERT=1 for each expert's own decode matmuls instead of the grouped launches,
#   ROUTE=host|device for who chooses a decode row's experts (auto by default),
#   NO_GRAPHS=1 for every decode step eager (no CUDA graph of the device-routed steps),
#   ADMIT=repeat for only the misses seen before within a window admitted (--expert-admit),
#   SLOTS=layers for the cache's slots in whole layers, the last first (--expert-slots),
#   LC_HINT=N,... for llama.cpp's layers with experts on the GPU at each budget from an earlier
#   run (--llamacpp-layers-hint: two probes instead of four or five, ~30 s each on these files;
#   the `llamacpp_ncmoe` of an earlier record is 48 less it))
#   -> $OUT/moe-ROUTING-WEIGHTS-pPROMPTS-POLICY.json (bench_generate's
#   records, each with the expert cache's hit rate, experts per token by place, host bytes per
#   token, the host's read rate and the physical bound).
#   On the H200, `bench q8_0 4,8,12 64` takes ~5 minutes: the file loads in ~40 s, and
#   llama.cpp's probes and runs (all before ours) take ~70 s a budget.
# Once llama.cpp is built (`bash scripts/gpu_moe_session.sh save` on the machine call1 left warm): its
#   binaries come back as lcbin.tar.xz.* pieces; kept in .lcbin/ here and carried with call1,
#   they replace the ~5-minute build.
# Another routing (`ROUTING=skewed bash scripts/gpu_moe_session.sh write`): the files of the
#   other routing, the old ones deleted first (the disk holds one routing's two files).
# Where a decode step's host time goes (`bash scripts/gpu_moe_session.sh spans BUDGETS`, carry
#   .gpu/bench_generate.xz; the Q8_0 file written, or WEIGHTS=q4_k_m's): ours alone at each budget with -vv and the
#   mixture-of-experts layers' spans (route and its wait for the device (its readback, .read,
#   and the rows' choice, .rows), guess, place (its split, and its device and host experts'
#   acquisitions), device (the routes' upload, .upload; the experts' launches, .experts; their
#   sum into the rows, .combine), to_host, host, merge), then scripts/span_times.py over the decode rows (PROMPT_LEN=512
#   MATCH_ROWS=512: over a 512-token prompt's layers instead, the untimed one's and the timed one's) ->
#   spans-ROUTING-BUDGET.json (a diagnostic, not a row; SPLIT, NO_PREFETCH and ROUTE as for bench).
#   SPANS_LOG replaces the log filter, e.g. adding `candle_offload=debug` for the runtime's
#   own spans inside `place` (offload.acquire, offload.h2d, offload.evict);
#   `candle_offload_models::layers::moe=trace` makes each layer wait for the GPU after each
#   phase (moe.wait.before, .resident, .streamed, .merge: the device's share of each; the
#   overlap between phases is then gone).
# Each call leaves $OUT/CALL.tgz with its logs (and the spans' and call1's JSON); a bench's
# JSON is written straight into $OUT, so that a call cut short keeps its rows.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_CACHE_MAXSIZE=4294967296
ROUTING=${ROUTING:-uniform}
# Q4=0: the Q8_0 file only (no Q4_K_M requantized from it, no CPU llama-quantize build).
Q4=${Q4:-1}
FINAL=${OUT:-/tmp/out}; OUT=/tmp/res-$1; mkdir -p "$FINAL" "$OUT" /tmp/gguf /tmp/bin
R=$PWD
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
gguf() { echo "/tmp/gguf/moe-$ROUTING-$1.gguf"; }

# The files of $ROUTING: the Q8_0 written directly, the Q4_K_M requantized from it once a
# CPU llama-quantize exists (built here, or by call1 already).
write() {
  rm -f /tmp/gguf/moe-*.gguf /tmp/gguf/moe-*.done /tmp/gguf/moe-*.part
  [[ -d /tmp/lcq/gguf-py ]] || { mkdir -p /tmp/lcq && tar xJf .gpu/llamacpp/llamacpp-src.tar.xz -C /tmp/lcq --strip-components=1; }
  cat > /tmp/moe-write.sh <<Q
set -x
t0=\$(date +%s)
PYTHONPATH=/tmp/lcq/gguf-py python3 $R/scripts/gguf_random_moe.py $(gguf q8_0).part --routing $ROUTING && mv $(gguf q8_0).part $(gguf q8_0) && touch $(gguf q8_0).done
echo "q8_0 written \$(( \$(date +%s)-t0 )) s"
[[ "$Q4" == 1 ]] || exit 0
cd $R && bash scripts/llamacpp_quantize.sh /tmp/lcq
/tmp/lcq/build/bin/llama-quantize --allow-requantize $(gguf q8_0) $(gguf q4_k_m).part Q4_K_M 16 > /tmp/moe-q4.log 2>&1 && mv $(gguf q4_k_m).part $(gguf q4_k_m) && touch $(gguf q4_k_m).done
echo "q4_k_m written \$(( \$(date +%s)-t0 )) s"
Q
  setsid bash /tmp/moe-write.sh > /tmp/moe-write.log 2>&1 < /dev/null &
}

case "$1" in
  call1)
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/gpus.txt"
    # gpu-run.sh's step: llama.cpp unpacked from a carried .lcbin/ (`save` below), or built.
    # gpu-run.sh unpacks every carried binary first: into a folder of its own, so that it
    # never writes one this script is running ("Text file busy").
    OUT=$OUT GPU_BIN=/tmp/bin-llamacpp-step nice -n 5 bash scripts/gpu-run.sh llamacpp > "$OUT/llamacpp.log" 2>&1 &
    lc=$!
    write
    xz -dc .gpu/test-integration.xz > /tmp/bin/test-integration && chmod +x /tmp/bin/test-integration
    el "tests"
    (cd /tmp && timeout "${TESTS_S:-200}" /tmp/bin/test-integration --test-threads 1 ${TESTS:-moe_ batching}) > "$OUT/tests.log" 2>&1
    echo "tests exit $?" | tee -a "$OUT/tests.log"; grep -E "test result|FAILED|panicked" "$OUT/tests.log" | tail -8
    # With .gpu/bench_generate.xz carried too: ours alone on the Q8_0 file at SMOKE_BUDGETS
    # (default 8 GiB), a first look while llama.cpp builds (its timing shares the CPU with it).
    if [[ -f .gpu/bench_generate.xz ]]; then
      xz -dc .gpu/bench_generate.xz > /tmp/bin/bench_generate && chmod +x /tmp/bin/bench_generate
      f=$(gguf q8_0); while [[ ! -f $f.done ]] && pgrep -f moe-write.sh >/dev/null; do sleep 2; done
      el "smoke"
      (cd /tmp && timeout "${SMOKE_S:-150}" /tmp/bin/bench_generate --model-dir "$f" --quantized \
        --weights smoke --budgets "${SMOKE_BUDGETS:-8}" --prompt-lens 64 --new-tokens "${SMOKE_TOKENS:-8}" \
        --json-out "$OUT/smoke.json") > "$OUT/smoke.log" 2>&1
      echo "smoke exit $?"; grep -E "^ +[0-9]+ |experts|rror" "$OUT/smoke.log" | tail -12
    fi
    el "waiting for llama.cpp"; wait $lc; tail -2 "$OUT/llamacpp.log"; grep -v "^+" /tmp/moe-write.log
    el "done"
    ;;
  write)
    write; sleep "${WRITE_WAIT_S:-60}"; grep -v "^+" /tmp/moe-write.log
    ;;
  save)
    # llama.cpp's binaries as $OUT/lcbin.tar.xz.* (15 MiB pieces): kept here in .lcbin/ and
    # carried, a later call1 unpacks them instead of building (~5 minutes of device time).
    OUT=$FINAL bash scripts/gpu-run.sh llamacpp_save
    ;;
  bench)
    w=$2 budgets=$3 prompts=$4
    f=$(gguf "$w")
    [[ -x /tmp/bin/bench_generate ]] || { xz -dc .gpu/bench_generate.xz > /tmp/bin/bench_generate && chmod +x /tmp/bin/bench_generate; }
    # Nothing else on the host while timing: a requantization beside a bench once cut
    # llama.cpp's decode to 0.8 tok/s. Wait for the writer, $f's and any other step of it
    # (Q4=0 skips its Q4_K_M one).
    while pgrep -f moe-write.sh >/dev/null; do el "waiting for the writer ($f)"; sleep 10; done
    grep -v "^+" /tmp/moe-write.log; ls -la /tmp/gguf
    [[ -n "${NO_PEER:-}" || -x /tmp/llamacpp/build/bin/llama-bench ]] || { echo "no llama-bench (call1 first)"; exit 1; }
    name="moe-$ROUTING-$w-p${prompts//,/-}-${POLICY:-lru}${NO_PREFETCH:+-no-prefetch}${GUESS:+-guess$GUESS}${SPLIT:+-split-$SPLIT}${ROUTE:+-route-$ROUTE}${PER_EXPERT:+-per-expert}${NO_GRAPHS:+-no-graphs}${ADMIT:+-admit-$ADMIT}${SLOTS:+-slots-$SLOTS}"
    # NO_PEER=1: ours alone (an A/B of our options, no rows).
    peer="--llamacpp-bin /tmp/llamacpp/build/bin --llamacpp-moe --llamacpp-reps 2"
    [[ -n "${NO_PEER:-}" ]] && { peer=""; name="$name-alone"; }
    # Fewer than 30 s left: nothing a run could finish (`timeout 0` would not limit it at all).
    (( ${BENCH_S:-560} >= 30 )) || { echo "bench $name skipped: BENCH_S=${BENCH_S:-560}"; exit 0; }
    el "bench $name at $budgets"
    (cd /tmp && timeout "${BENCH_S:-560}" /tmp/bin/bench_generate --model-dir "$f" --quantized \
      --weights "qwen3-30b-a3b-$w-$ROUTING" --model-name "qwen3-30b-a3b-$w" --routing "$ROUTING" \
      --budgets "$budgets" --prompt-lens "$prompts" \
      --new-tokens "${NEW_TOKENS:-16}" $peer --expert-policy "${POLICY:-lru}" --expert-prefetch ${NO_PREFETCH:+false} \
      ${GUESS:+--expert-guess-layers $GUESS} \
      ${PER_EXPERT:+--per-expert} ${NO_GRAPHS:+--no-graphs} --expert-split "${SPLIT:-auto}" --expert-route "${ROUTE:-auto}" \
      ${ADMIT:+--expert-admit $ADMIT} ${SLOTS:+--expert-slots $SLOTS} ${LC_HINT:+--llamacpp-layers-hint $LC_HINT} \
      --json-out "$FINAL/$name.json") > "$OUT/$name.log" 2>&1
    echo "bench exit $?"; grep -E "^ +[0-9]+ |experts:|llama.cpp -ngl" "$OUT/$name.log" | tail -20
    el "done"
    ;;
  spans)
    f=$(gguf "${WEIGHTS:-q8_0}")
    [[ -x /tmp/bin/bench_generate ]] || { xz -dc .gpu/bench_generate.xz > /tmp/bin/bench_generate && chmod +x /tmp/bin/bench_generate; }
    while pgrep -f moe-write.sh >/dev/null; do el "waiting for the writer ($f)"; sleep 5; done
    [[ -f $f ]] || { echo "no $f (write first)"; exit 1; }
    for b in ${2//,/ }; do
      name="spans-$ROUTING-${WEIGHTS:-q8_0}-${b}gib${PROMPT_LEN:+-p$PROMPT_LEN}${SPLIT:+-split-$SPLIT}${NO_PREFETCH:+-no-prefetch}${GUESS:+-guess$GUESS}${ROUTE:+-route-$ROUTE}${SLOTS:+-slots-$SLOTS}"
      el "$name"
      (cd /tmp && RUST_LOG="${SPANS_LOG:-warn,candle_offload_models::layers::moe=debug,candle_offload_models::causal::experts=debug}" timeout "${BENCH_S:-200}" \
        /tmp/bin/bench_generate --model-dir "$f" --quantized --weights "$name" --budgets "$b" \
        --prompt-lens "${PROMPT_LEN:-64}" --new-tokens "${NEW_TOKENS:-16}" --expert-split "${SPLIT:-auto}" \
        --expert-prefetch ${NO_PREFETCH:+false} ${GUESS:+--expert-guess-layers $GUESS} \
        --expert-route "${ROUTE:-auto}" ${SLOTS:+--expert-slots $SLOTS} -vv --json-out "$OUT/$name-bench.json") > "$OUT/$name.log" 2>&1
      echo "bench exit $?"; grep -E "^ +[0-9]+ |experts:" "$OUT/$name.log" | tail -4
      python3 "$R/scripts/span_times.py" "$OUT/$name.log" --parent moe.layer --match "rows=${MATCH_ROWS:-1}}" \
        --json "$FINAL/$name.json"
      xz -T4 "$OUT/$name.log"
    done
    el "done"
    ;;
  *) echo "usage: $0 call1 | write | save | bench WEIGHTS BUDGETS PROMPTS | spans BUDGETS" >&2; exit 2 ;;
esac
tar czf "$FINAL/$1.tgz" -C "$OUT" . ; ls -la "$FINAL"
