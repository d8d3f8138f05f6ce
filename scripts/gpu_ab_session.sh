#!/usr/bin/env bash
# gpu_ab_session.sh: the GPU rows of a before/after comparison of two builds (the redesign's
# acceptance: 7B Q4_K_M and Q8_0 at 4 GiB, 7B F16 all on the GPU, none-bf16 training), plus
# the GPU tests, in two chained calls of the GPU machine (its /tmp survives ~30 s between calls).
#
# Here, before the calls: pack both builds (scripts/gpu-pack.sh in a worktree of each commit)
#   .gpu/before/{bench_generate,bench_train}.xz   .gpu/after/{bench_generate,bench_train}.xz
#   .gpu/test-integration.xz .gpu/test-candle_offload_kernels.xz (the after build's --tests)
#   .gpu/llamacpp/ (a copy of the pinned peer folder)
# Call 1 (carry .gpu/llamacpp, this script's copy in .gpu, both bench_train packs and the two
# test packs; ~60 MiB with the tree): `bash .gpu/gpu_ab_session.sh call1`
#   llama.cpp's CUDA build in the background; the F16 7B GGUF, a CPU-only llama-quantize and
#   the Q4_K_M/Q8_0 files in a detached session (they outlive the call); the GPU tests, then
#   the training A/B (scripts/gpu_ab.py train, PyTorch peer from scripts/train_peer.py).
# Call 2 (carry both bench_generate packs): `bash .gpu/gpu_ab_session.sh call2`
#   the generate A/B per row (ROWS="q4km q8 f16"), each row's JSON copied to $OUT as it ends.
# Then, here: each ab-gen-ROW.json into benches/results/DATE/ with an index entry, listed in
# scripts/current_results.py's SOURCES["generate-gpu-ab"] (its rows replace the older ones).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_CACHE_MAXSIZE=4294967296
FINAL=${OUT:-/tmp/out}; OUT=/tmp/res-$1; mkdir -p "$FINAL" "$OUT" /tmp/ab/before /tmp/ab/after /tmp/gguf /tmp/bin
R=$PWD
unpack() { for b in "$@"; do for s in before after; do
  [[ -x /tmp/ab/$s/$b ]] || { xz -dc .gpu/$s/$b.xz > /tmp/ab/$s/$b && chmod +x /tmp/ab/$s/$b; }; done; done; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
case "$1" in
  call1)
    nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/gpus.txt"
    nice -n 5 bash .gpu/llamacpp/build.sh /tmp/llamacpp > "$OUT/llamacpp-build.log" 2>&1 &
    lc=$!
    mkdir -p /tmp/lcq && tar xJf .gpu/llamacpp/llamacpp-src.tar.xz -C /tmp/lcq --strip-components=1
    cat > /tmp/quant.sh <<'Q'
set -x
t0=$(date +%s)
PYTHONPATH=/tmp/lcq/gguf-py python3 GGUFW /tmp/gguf/7b-f16.gguf.part 4096 32 11008 32 32 32000 && mv /tmp/gguf/7b-f16.gguf.part /tmp/gguf/7b-f16.gguf
echo "f16 written $(( $(date +%s)-t0 )) s"
bash SCRIPTS/llamacpp_quantize.sh /tmp/lcq
echo "quantize built $(( $(date +%s)-t0 )) s"
/tmp/lcq/build/bin/llama-quantize /tmp/gguf/7b-f16.gguf /tmp/gguf/7b-q4_k_m.gguf.part Q4_K_M 16 > /tmp/q4.log 2>&1 && mv /tmp/gguf/7b-q4_k_m.gguf.part /tmp/gguf/7b-q4_k_m.gguf
/tmp/lcq/build/bin/llama-quantize /tmp/gguf/7b-f16.gguf /tmp/gguf/7b-q8_0.gguf.part Q8_0 16 > /tmp/q8.log 2>&1 && mv /tmp/gguf/7b-q8_0.gguf.part /tmp/gguf/7b-q8_0.gguf
echo "quantized $(( $(date +%s)-t0 )) s"; touch /tmp/gguf/done
Q
    sed -i -e "s#GGUFW#$R/.gpu/llamacpp/gguf_random_llama.py#" -e "s#SCRIPTS#$R/scripts#" /tmp/quant.sh
    setsid bash /tmp/quant.sh > /tmp/quant.log 2>&1 < /dev/null &
    xz -dc .gpu/test-integration.xz > /tmp/bin/test-integration && chmod +x /tmp/bin/test-integration
    el "tests"
    (cd /tmp && timeout ${TESTS_S:-240} /tmp/bin/test-integration --test-threads 1 ${TESTS:-gpu cuda}) > "$OUT/tests.log" 2>&1
    echo "tests exit $?" | tee -a "$OUT/tests.log"; grep -E "test result|FAILED|panicked" "$OUT/tests.log" | tail -8
    xz -dc .gpu/test-candle_offload_kernels.xz > /tmp/bin/test-kernels && chmod +x /tmp/bin/test-kernels
    (cd /tmp && timeout 90 /tmp/bin/test-kernels --test-threads 1 linear::layer attention::step gpu cuda) > "$OUT/tests-kernels.log" 2>&1
    echo "kernel tests exit $?" | tee -a "$OUT/tests-kernels.log"; grep -E "test result|FAILED|panicked" "$OUT/tests-kernels.log" | tail -4
    el "train"
    unpack bench_train
    timeout 120 python3 scripts/train_peer.py "$OUT/train_peer.json" --configs none-bf16 > "$OUT/train_peer.log" 2>&1; echo "peer exit $?"
    timeout ${TRAIN_S:-240} python3 scripts/gpu_ab.py train --before /tmp/ab/before --after /tmp/ab/after --rounds "${ROUNDS:-5}" \
      --peer "$OUT/train_peer.json" --out "$OUT/ab-train.json" -- --configs none-bf16 --steps 3 > "$OUT/ab-train.log" 2>&1
    echo "train exit $?"; grep -E "step_s|peak" "$OUT/ab-train.log" | tail -3
    el "waiting for llama.cpp"; wait $lc; tail -1 "$OUT/llamacpp-build.log"; cat /tmp/quant.log | grep -v "^+"
    el "done"
    ;;
  call2)
    unpack bench_generate
    [[ -f /tmp/gguf/done ]] || { el "waiting for quantize"; while [[ ! -f /tmp/gguf/done ]] && pgrep -f quant.sh >/dev/null; do sleep 2; done; }
    cat /tmp/quant.log | grep -v "^+"; ls -la /tmp/gguf
    for row in ${ROWS:-f16 q4km q8}; do
      case $row in
        q4km) a=(--model-dir /tmp/gguf/7b-q4_k_m.gguf --quantized --weights 7b-q4_k_m --budgets 4) ;;
        q8) a=(--model-dir /tmp/gguf/7b-q8_0.gguf --quantized --weights 7b-q8_0 --budgets 4) ;;
        f16) a=(--model-dir /tmp/gguf/7b-f16.gguf --weights 7b-f16 --budgets full) ;;
      esac
      el "gen $row"
      (cd /tmp && timeout ${GEN_S:-250} python3 "$R/scripts/gpu_ab.py" generate --before /tmp/ab/before --after /tmp/ab/after \
        --rounds "${ROUNDS:-5}" --peer-rounds 1 --llamacpp-bin /tmp/llamacpp/build/bin --out "$OUT/ab-gen-$row.json" -- "${a[@]}" \
        --prompt-lens 64 --host-layers spread:auto --depths 1 --llamacpp-reps 2) > "$OUT/ab-gen-$row.log" 2>&1
      echo "gen $row exit $?"; grep -E "^budget" "$OUT/ab-gen-$row.log" | tail -3
      cp "$OUT/ab-gen-$row.json" "$OUT/ab-gen-$row.log" "$FINAL/" 2>/dev/null
    done
    el "done"
    ;;
esac
cp /tmp/quant.log /tmp/q4.log "$OUT/" 2>/dev/null; tar czf "$FINAL/$1.tgz" -C "$OUT" . ; ls -la "$FINAL"
