#!/usr/bin/env bash
# gpu_serve_session.sh: the GPU rows of the OpenAI-server issue, `serve` against llama.cpp's
# llama-server on the same Llama-3-8B-shaped Q4_K_M GGUF (random weights; token-id prompts,
# EOS ignored), in three chained calls of the GPU machine (its /tmp survives ~30 s between
# calls).
#
# Here, before the calls: `scripts/gpu-pack.sh --example serve --tests` (CUDA), a copy of the
# pinned peer folder in .gpu/llamacpp, `git rev-parse --short=12 HEAD > .gpu/COMMIT` (the
# build's commit, for the records), this script run from the tree.
# Call 1 (carry .gpu/llamacpp, serve.xz, test-integration.xz): `bash scripts/gpu_serve_session.sh call1`
#   llama.cpp's CUDA build with llama-server in the background; the F16 8B GGUF, a CPU-only
#   llama-quantize and the Q4_K_M file in a detached session (they outlive the call); the
#   batching tests on the GPU (ragged steps and the batcher against each sequence alone).
# Call 2 (carry serve.xz): `bash scripts/gpu_serve_session.sh call2`
#   both servers all on the GPU, concurrency 1, 4 and 16 -> serve-full.json
# Call 3 (carry serve.xz): `bash scripts/gpu_serve_session.sh call3`
#   both at a 6 GiB budget ($SERVE_BUDGET), llama-server's -ngl searched down until its peak
#   fits -> serve-6gib.json
# Call steps (carry serve.xz; after call1): `bash scripts/gpu_serve_session.sh steps`
#   ours alone all on the GPU at concurrency $SERVE_CONC, with -vv and the batcher's step spans,
#   then scripts/serve_steps.py: each kind of step's count and time -> steps.json (a
#   diagnostic, not a row).
# Call parity (carry batch_parity.xz; after call1): `bash scripts/gpu_serve_session.sh parity`
#   16 requests' 32 greedy tokens alone and in one batch (bench batch_parity): where they first
#   differ and the logit margin there -> parity.json.
# The environment reaches both servers: e.g. CANDLE_OFFLOAD_RAGGED_GRAPHS=1 SERVE_TAG=-graphs
# for ours with the ragged steps' graphs, its files named with the tag, or
# CANDLE_OFFLOAD_QLINEAR_SMALL_ROWS=2 SERVE_TAG=-mmvq for steps of 3-8 sequences through
# Candle's MMVQ kernels.
# Each call leaves $OUT/CALL.tgz with its logs and JSON.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_CACHE_MAXSIZE=4294967296
FINAL=${OUT:-/tmp/out}; OUT=/tmp/res-$1; mkdir -p "$FINAL" "$OUT" /tmp/gguf /tmp/bin
R=$PWD
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
[[ -x /tmp/bin/serve ]] || { xz -dc .gpu/serve.xz > /tmp/bin/serve && chmod +x /tmp/bin/serve; }
F=/tmp/gguf/8b-q4_k_m.gguf
CONC=${SERVE_CONC:-1,4,16}
NP=${CONC##*,}
# The same context per slot on both sides: the longest prompt and the new tokens.
OURS="/tmp/bin/serve --model $F --parallel $NP --ctx-size 640 --port 8081 --model-name 8b"
PEER="/tmp/llamacpp/build/bin/llama-server -m $F --port 8082 -c $((NP * 640)) -np $NP --cont-batching -fa on -a 8b"
bench() { # bench NAME ARGS...: scripts/serve_bench.py -> $OUT/NAME.json, copied to $FINAL
  local name=$1 commit; shift
  # The servers' build, read here: the benchmark runs from /tmp.
  commit=$(cat "$R/.gpu/COMMIT" 2>/dev/null)
  (cd /tmp && timeout "${SERVE_S:-540}" python3 "$R/scripts/serve_bench.py" --concurrency "$CONC" \
    --model-name 8b --gpu --id-high 128000 --commit "$commit" --out "$OUT/$name.json" --log-prefix "$OUT/$name-" "$@") \
    > "$OUT/$name.log" 2>&1
  echo "$name exit $?"; tail -20 "$OUT/$name.log"
  cp "$OUT/$name.json" "$FINAL/" 2>/dev/null
}
case "$1" in
  call1)
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/gpus.txt"
    LLAMACPP_TARGETS="llama-bench llama-quantize llama-server" nice -n 5 \
      bash .gpu/llamacpp/build.sh /tmp/llamacpp > "$OUT/llamacpp-build.log" 2>&1 &
    lc=$!
    mkdir -p /tmp/lcq && tar xJf .gpu/llamacpp/llamacpp-src.tar.xz -C /tmp/lcq --strip-components=1
    cat > /tmp/quant.sh <<'Q'
set -x
t0=$(date +%s)
PYTHONPATH=/tmp/lcq/gguf-py python3 GGUFW /tmp/gguf/8b-f16.gguf.part 4096 32 14336 32 8 128256 && mv /tmp/gguf/8b-f16.gguf.part /tmp/gguf/8b-f16.gguf
echo "f16 written $(( $(date +%s)-t0 )) s"
bash SCRIPTS/llamacpp_quantize.sh /tmp/lcq
echo "quantize built $(( $(date +%s)-t0 )) s"
/tmp/lcq/build/bin/llama-quantize /tmp/gguf/8b-f16.gguf /tmp/gguf/8b-q4_k_m.gguf.part Q4_K_M 16 > /tmp/q4.log 2>&1 && mv /tmp/gguf/8b-q4_k_m.gguf.part /tmp/gguf/8b-q4_k_m.gguf
rm -f /tmp/gguf/8b-f16.gguf
echo "quantized $(( $(date +%s)-t0 )) s"; touch /tmp/gguf/done
Q
    sed -i -e "s#GGUFW#$R/.gpu/llamacpp/gguf_random_llama.py#" -e "s#SCRIPTS#$R/scripts#" /tmp/quant.sh
    setsid bash /tmp/quant.sh > /tmp/quant.log 2>&1 < /dev/null &
    xz -dc .gpu/test-integration.xz > /tmp/bin/test-integration && chmod +x /tmp/bin/test-integration
    el "tests"
    (cd /tmp && timeout "${TESTS_S:-240}" /tmp/bin/test-integration --test-threads 1 ${TESTS:-batching ragged}) > "$OUT/tests.log" 2>&1
    echo "tests exit $?" | tee -a "$OUT/tests.log"; grep -E "test result|FAILED|panicked" "$OUT/tests.log" | tail -8
    el "waiting for llama.cpp"; wait $lc; tail -1 "$OUT/llamacpp-build.log"; grep -v "^+" /tmp/quant.log
    el "done"
    ;;
  parity)
    [[ -f /tmp/gguf/done ]] || { echo "no GGUF (call1 first)"; exit 1; }
    [[ -x /tmp/bin/batch_parity ]] || { xz -dc .gpu/batch_parity.xz > /tmp/bin/batch_parity && chmod +x /tmp/bin/batch_parity; }
    el "alone against batched"
    (cd /tmp && timeout "${SERVE_S:-300}" /tmp/bin/batch_parity --model "$F" --requests 16 \
      --new-tokens 32 --id-high 128000 --json-out "$OUT/parity.json") > "$OUT/parity.log" 2>&1
    echo "parity exit $?"; tail -20 "$OUT/parity.log"
    cp "$OUT/parity.json" "$FINAL/" 2>/dev/null
    el "done"
    ;;
  steps)
    [[ -f /tmp/gguf/done ]] || { echo "no GGUF (call1 first)"; exit 1; }
    el "ours alone, step spans"
    (cd /tmp && RUST_LOG="warn,candle_offload_models::batching=debug" timeout "${SERVE_S:-300}" \
      python3 "$R/scripts/serve_bench.py" --concurrency "$CONC" --model-name 8b --gpu --id-high 128000 \
      --commit "$(cat "$R/.gpu/COMMIT" 2>/dev/null)" --out "$OUT/steps-bench.json" --log-prefix "$OUT/steps-" \
      --ours "${OURS/--port 8081/--port 8083} -vv" --port-ours 8083) > "$OUT/steps-bench.log" 2>&1
    echo "bench exit $?"
    python3 "$R/scripts/serve_steps.py" "$OUT/steps-ours.log" --json "$OUT/steps.json"
    cp "$OUT/steps.json" "$FINAL/" 2>/dev/null
    el "done"
    ;;
  call2 | call3)
    [[ -f /tmp/gguf/done ]] || { el "waiting for quantize"; while [[ ! -f /tmp/gguf/done ]] && pgrep -f quant.sh >/dev/null; do sleep 2; done; }
    grep -v "^+" /tmp/quant.log; ls -la /tmp/gguf
    [[ -x /tmp/llamacpp/build/bin/llama-server ]] || { echo "no llama-server (call1 first)"; exit 1; }
    if [[ $1 == call2 ]]; then
      el "all on the GPU"; bench "serve-full${SERVE_TAG:-}" --ours "$OURS" --peer "$PEER -ngl 99"
    else
      b=${SERVE_BUDGET:-6}
      el "$b GiB"; bench "serve-${b}gib${SERVE_TAG:-}" --budget-gib "$b" --ours "$OURS --gpu-memory-limit $b" \
        --peer "$PEER -ngl {ngl}" --peer-ngl-search "${SERVE_NGL:-31,29,27,25,23,21,19,17}"
    fi
    el "done"
    ;;
esac
cp /tmp/quant.log /tmp/q4.log "$OUT/" 2>/dev/null; tar czf "$FINAL/$1.tgz" -C "$OUT" . ; ls -la "$FINAL"
