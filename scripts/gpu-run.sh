#!/usr/bin/env bash
# gpu-run.sh: the scripted GPU session. Runs on the GPU machine, from the repository root, with
# the binaries packed in .gpu/ (scripts/gpu-pack.sh) and the run tool's `carry: [".gpu"]`:
#
#   bash scripts/gpu-run.sh STEP... [-- BENCH_TRAIN_ARGS...]
#
# Steps run in the order given, each under its own time limit (seconds, overridable through the
# variable named in brackets) so that one call stays under the run tool's 600 s:
#
#   gpus          nvidia-smi: the GPUs and their topology -> $OUT/gpus.txt
#   tests[=F,...] the integration tests on CUDA (test-integration) whose names match the
#                 filters F (default: train sharding cuda:: offloaded_equals_resident_gpu)
#                 -> $OUT/tests.log [TESTS_S=240]
#   parity[=N,..] reference checkpoints and logits from transformers (scripts/hf_reference.py,
#                 configurations N, default all) then the parity binary on them
#                 -> $OUT/parity.json, $OUT/parity.log [PARITY_S=240]
#   own_model     the bring-your-own-model example on GPU 0 (and 1) -> $OUT/own_model.log
#                 [OWN_S=60]
#   streaming     the link-efficiency benchmark at 4 and 12 GiB -> $OUT/streaming.json
#                 [STREAMING_S=180]
#   make7b        writes the 7B-shaped random checkpoint to /tmp/llama7b, in the background
#                 on the last GPU (shard waits for it) -> $OUT/make7b.log [MAKE7B_S=300]
#   peer          the PyTorch training peer (scripts/train_peer.py, extra arguments from
#                 $PEER_ARGS) -> $OUT/train_peer.json [PEER_S=100]
#   shard         bench_shard on /tmp/llama7b (needs make7b) -> $OUT/shard.json [SHARD_S=300]
#   llamacpp      builds llama.cpp (llama-bench, llama-quantize) from .gpu/llamacpp (a copy of
#                 ../shared/peer/llamacpp) into /tmp/llamacpp, in the background
#                 -> $OUT/llamacpp-build.log; with a build carried in .lcbin/ (the pieces
#                 llamacpp_save wrote, same pinned source), unpacks that instead
#   llamacpp_save waits for the build and writes its build/bin (binaries and libraries) as
#                 $OUT/lcbin.tar.xz.aa, .ab, ... (15 MiB pieces), for a later call to carry in
#                 .lcbin/ (4-5 minutes of building saved per call)
#   gguf7b        waits for that build, then writes the random-weight 7B LLaMA shape as an F16
#                 GGUF and quantizes it to $GGUF7B_TYPES (Q8_0 Q4_0 Q4_K_M) in /tmp/gguf
#                 [GGUF_S=400]
#   gguf13b       the same for the 13B shape ($GGUF13B_TYPES: Q4_K_M Q8_0; the F16 file is deleted after)
#   gguf_qwen3_8b the same for the Qwen3-8B shape (scripts/gguf_random_family.py qwen3: the
#                 converter's layout, q/k norms, a gpt2 vocabulary of 151936) in $GGUF_QWEN3_TYPES
#                 (Q4_K_M) -> /tmp/gguf/qwen3-8b-q4_k_m.gguf; the F16 file is deleted after
#   gguf_gemma3_12b the same for the Gemma-3-12B text shape (gemma3: tied head, local/global
#                 layers, a SentencePiece vocabulary of 262208) in $GGUF_GEMMA3_TYPES (Q4_K_M)
#                 -> /tmp/gguf/gemma3-12b-q4_k_m.gguf
#                 (both: more writer arguments from $GGUF_FAMILY_ARGS, e.g. --tiny for a dry run;
#                 on the H200 host: qwen3 F16 16.4 GB written in 12 s, Q4_K_M (4.7 GiB) in 95 s;
#                 gemma3 23.5 GB in 15 s, Q4_K_M (6.8 GiB) in 146 s. With the build (5.3 min)
#                 both do not fit one call: build once and keep it with llamacpp_save)
#   qbench[=W,..] bench_generate on /tmp/gguf/W.gguf (W: 7b-q4_0, 13b-q8_0, qwen3-8b-q4_k_m,
#                 gemma3-12b-q4_k_m, ...;
#                 quantized blocks unless f16) next to llama.cpp on the same file in the same
#                 process, budgets $QB_BUDGETS (4,8,12,full), prompts $QB_PROMPTS (64,512),
#                 prefetch depths $QB_DEPTHS (2; the library's default is 1), more
#                 bench_generate arguments from $QB_ARGS (default `--host-layers spread:auto`,
#                 generate's placement; bench_generate's own default streams only), once per
#                 qlinear_small kernel variant
#                 in $QB_VARIANTS (v1 v2 v2r2 v2r4 v3 v4; k / k-off: the K-quant kernel on converting to floats (v2) / off; k2: k at 2 columns a warp (Q4_K); or default: each block type's
#                 own, ops::DEFAULT_QLINEAR_VARIANTS; llama.cpp with the first only)
#                 -> $OUT/qbench-W[-V].json [QBENCH_S=300]
#   qonload[=W,..] bench_generate on /tmp/llama7b (needs make7b) quantized on load to W (q4_0,
#                 q8_0, ...; the library's cached GGUF, no llama.cpp needed), once per variant in
#                 $QB_VARIANTS, budgets $QB_BUDGETS (full), prompts $QB_PROMPTS (64)
#                 -> $OUT/qonload-7b-W[-V].json [QBENCH_S=300 per run]
#   decode[=V,..] bench_generate on /tmp/llama7b (needs make7b), budgets $DECODE_BUDGETS (12,full),
#                 prompt 64, once per variant V: default (fused ops, no event tracking),
#                 unfused (--unfused), tracking (--event-tracking), unfused-tracking (both: the
#                 engine before the decode-step work) -> $OUT/decode-V.json [DECODE_S=200]
#   breakdown[=V] ncu's GPU time per kernel of the full-budget decode step of variant V (default)
#                 on /tmp/llama7b (scripts/kernel_breakdown.py decode; set against decode-V.json when
#                 decode ran; another model from $BREAKDOWN_MODEL, e.g. /tmp/gguf/7b-q4_0.gguf
#                 with BREAKDOWN_ARGS=--quantized) -> $OUT/breakdown-V.json, .log [BREAKDOWN_S=300]
#   tiers         the storage tiers on /tmp/llama7b (needs make7b), GPU budget 4 GiB, host caps
#                 $TIER_CAPS (4,8) with the rest on the local disk: the disk's raw rate (dd,
#                 O_DIRECT, 64 MiB blocks, the checkpoint's files), then per cap bench_generate
#                 with O_DIRECT reads (cold by construction), through the page cache after
#                 dropping it (cold, where /proc/sys/vm/drop_caches is writable) and again
#                 (warm), and accelerate with max_memory cpu and an offload_folder (page cache
#                 dropped after writing it; ACC_DROP=each: before every token too). Rows from
#                 $TIER_ROWS (direct pagecache-cold pagecache-warm), O_DIRECT rows in more read
#                 shapes from $TIER_SHAPES ("8x16 4x32": threads x MiB), the disk's rate per
#                 shape first with PROBE_GB=N (scripts/disk_probe.py)
#                 -> $OUT/tiers-*.json, disk-probe.json, tiers.log [TIERS_S=540 in all]
#   managed       the managed engine (Unified Memory) against the explicit one on /tmp/llama7b
#                 at $MANAGED_BUDGETS (full; at 4 GiB the managed engine must refuse to stream),
#                 and the seed's UM table (smoke --um-table-mib
#                 600) -> $OUT/managed-{explicit,managed}.json, $OUT/um-table.json
#                 [MANAGED_S=240]
#   trainprof[=C,..] ncu's GPU time per kernel of one bench_train step of each configuration C
#                 (default none-bf16), split into forward, backward and optimizer and set against
#                 the unprofiled phase times of the same run (scripts/kernel_breakdown.py train;
#                 more bench_train arguments from $TRAINPROF_ARGS)
#                 -> $OUT/trainprof-C.json, .log [TRAINPROF_S=240 per configuration]
#   train         bench_train, next to the peer's JSON when peer ran, with --max-seconds
#                 $MAX_S (170) unless the arguments after `--` give one, and those
#                 arguments -> $OUT/train.json [TRAIN_S=260]
#
# Examples (binaries: `scripts/gpu-pack.sh --tests --bin bench_shard --bin bench_train`):
#   bash scripts/gpu-run.sh gpus tests make7b shard                  # kind nvidia-h200-x2
#   bash scripts/gpu-run.sh tests=train:: peer train
#   bash scripts/gpu-run.sh make7b peer shard train -- --offload-steps 1 --configs none-f32,offload-4gib-bf16
#   bash scripts/gpu-run.sh llamacpp llamacpp_save                    # once: keep $OUT/lcbin.* in .lcbin/
#   QB_BUDGETS=4 QB_PROMPTS=64 bash scripts/gpu-run.sh llamacpp gguf_qwen3_8b qbench=qwen3-8b-q4_k_m
#   QB_BUDGETS=4 QB_PROMPTS=64 bash scripts/gpu-run.sh llamacpp gguf_gemma3_12b qbench=gemma3-12b-q4_k_m
#   (both need ~8 minutes with the build: the build alone took 2.5-5 minutes on the H100 and
#   H200 hosts; carry a saved build in .lcbin/ where the 64 MiB allows)
set -uo pipefail
OUT="${OUT:-/tmp/out}"
BIN="${GPU_BIN:-/tmp/bin}"  # where the binaries are unpacked
export PYTHONUNBUFFERED=1

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

steps=()
while (($# > 0)); do
  case "$1" in
    --) shift; break ;;
    -h | --help) usage; exit 0 ;;
    gpus | tests | tests=* | parity | parity=* | own_model | streaming | make7b | peer | shard | train | llamacpp | llamacpp_save | gguf7b | gguf13b | gguf_qwen3_8b | gguf_gemma3_12b | qbench | qbench=* | qonload | qonload=* | decode | decode=* | breakdown | breakdown=* | trainprof | trainprof=* | tiers | managed)
      steps+=("$1"); shift ;;
    *) echo "gpu-run.sh: unknown step '$1' (steps: gpus tests[=F,...] parity[=N,...] own_model streaming make7b peer shard train llamacpp llamacpp_save gguf7b gguf13b gguf_qwen3_8b gguf_gemma3_12b qbench[=W,...] qonload[=W,...] decode[=V,...] breakdown[=V] trainprof[=C,...] tiers managed)" >&2; exit 2 ;;
  esac
done
train_args=("$@")
if ((${#steps[@]} == 0)); then
  echo "gpu-run.sh: no step given" >&2
  usage >&2
  exit 2
fi

mkdir -p "$OUT" "$BIN"
llamacpp_pid=
lc_bin=/tmp/llamacpp/build/bin
wait_llamacpp() {
  if [[ -n "$llamacpp_pid" ]]; then
    wait "$llamacpp_pid"
    llamacpp_pid=
    tail -2 "$OUT/llamacpp-build.log"
  fi
  [[ -x "$lc_bin/llama-bench" ]] || { echo "llama.cpp is not built (run the llamacpp step)"; return 1; }
}
# make_gguf NAME HIDDEN LAYERS INTER HEADS KV VOCAB TYPE...: /tmp/gguf/NAME-f16.gguf, quantized.
make_gguf() {
  local name=$1 shape=("${@:2:6}") types=("${@:8}")
  write_gguf "$name" .gpu/llamacpp/gguf_random_llama.py "${shape[@]}" || return 1
  quantize_gguf "$name" "${types[@]}"
}
# write_gguf NAME SCRIPT ARGS...: /tmp/gguf/NAME-f16.gguf from SCRIPT (a random-weight writer),
# unless it is there already.
write_gguf() {
  local name=$1 script=$2 t0
  mkdir -p /tmp/gguf
  [[ -s /tmp/gguf/$name-f16.gguf ]] && return 0
  t0=$(date +%s)
  PYTHONPATH=/tmp/llamacpp/gguf-py timeout "${GGUF_S:-400}" \
    python3 "$script" "/tmp/gguf/$name-f16.gguf" "${@:3}" || { rm -f "/tmp/gguf/$name-f16.gguf"; return 1; }
  echo "$name-f16.gguf written in $(($(date +%s) - t0)) s"
}
# quantize_gguf NAME TYPE...: /tmp/gguf/NAME-TYPE.gguf (lower case) from NAME-f16.gguf, for each
# TYPE not there already.
quantize_gguf() {
  local name=$1 t q t0
  local f16=/tmp/gguf/$name-f16.gguf
  for t in "${@:2}"; do
    local q=/tmp/gguf/$name-${t,,}.gguf
    [[ -s "$q" ]] && continue
    t0=$(date +%s)
    timeout "${GGUF_S:-400}" "$lc_bin/llama-quantize" "$f16" "$q" "$t" "$(nproc)" \
      >>"$OUT/quantize.log" 2>&1 || { rm -f "$q"; return 1; }
    echo "$name-${t,,}.gguf quantized in $(($(date +%s) - t0)) s"
  done
  ls -la /tmp/gguf
}
# family_gguf NAME ARCH TYPES: the random-weight GGUF of ARCH's shape (scripts/gguf_random_family.py)
# quantized to each of TYPES (a list), the F16 file deleted after.
family_gguf() {
  local name=$1 arch=$2 t0 rc t missing=0
  for t in $3; do [[ -s /tmp/gguf/$name-${t,,}.gguf ]] || missing=1; done
  ((missing)) || { echo "$name: already in /tmp/gguf ($3)"; return 0; }
  t0=$(date +%s)
  # shellcheck disable=SC2086 # $3 and GGUF_FAMILY_ARGS are lists
  write_gguf "$name" scripts/gguf_random_family.py "$arch" ${GGUF_FAMILY_ARGS:-} && quantize_gguf "$name" $3
  rc=$?
  rm -f "/tmp/gguf/$name-f16.gguf"
  echo "$name exit $rc after $(($(date +%s) - t0)) s ($(df -h /tmp | awk 'NR == 2 {print $4}') free)"
}

for f in .gpu/*.xz; do
  [[ -e "$f" ]] || { echo "gpu-run.sh: no packed binaries in .gpu/ (scripts/gpu-pack.sh, carry .gpu)" >&2; exit 2; }
  n=$(basename "$f" .xz)
  xz -dc "$f" >"$BIN/$n" && chmod +x "$BIN/$n"
done
need_bin() { [[ -x "$BIN/$1" ]] || { echo "$2: $1 was not packed (scripts/gpu-pack.sh $3)"; return 1; }; }

make7b_pid=
wait_make7b() {
  if [[ -n "$make7b_pid" ]]; then
    wait "$make7b_pid"
    make7b_pid=
    tail -1 "$OUT/make7b.log"
  fi
  [[ -f /tmp/llama7b/config.json ]] || { echo "no checkpoint in /tmp/llama7b (run make7b first)"; return 1; }
}
# bench_variants PREFIX W ARGS...: bench_generate ARGS once per qlinear_small kernel variant in
# $QB_VARIANTS (CANDLE_OFFLOAD_QLINEAR; "default" leaves it unset: each block type its default
# variant, ops::DEFAULT_QLINEAR_VARIANTS) -> $OUT/PREFIX-W[-V].json and
# .log; the arguments in the array first_args go to the first run only (and are then cleared).
first_args=()
bench_variants() {
  local prefix=$1 w=$2 v tag
  shift 2
  for v in ${QB_VARIANTS:-default}; do
    tag=$w; [[ "$v" == default ]] || tag=$w-$v
    # `k`: the K-quant kernel forced on, converting to floats (v2 for every type: for K-quant
    # files); `k-off`: the default variants with it off; `k2`: `k` at 2 output columns a warp
    # for Q4_K (ops::set_qlinear_k_rows). v3 / v4 on a K-quant file: x quantized to 8 bits.
    local kq= kr=
    case "$v" in k) kq=1 v=v2 ;; k-off) kq=0 v=default ;; k2) kq=1 kr=2 v=v2 ;; esac
    (cd /tmp && CANDLE_OFFLOAD_QLINEAR_K_ROWS=${kr:-${CANDLE_OFFLOAD_QLINEAR_K_ROWS:-}} CANDLE_OFFLOAD_QLINEAR_K=${kq:-${CANDLE_OFFLOAD_QLINEAR_K:-}} CANDLE_OFFLOAD_QLINEAR=${v/default/} timeout "${QBENCH_S:-300}" "$BIN/bench_generate" \
      "$@" "${first_args[@]}" --json-out "$OUT/$prefix-$tag.json") >"$OUT/$prefix-$tag.log" 2>&1
    echo "$prefix $tag exit $?"
    grep -v "^llama.cpp probe" "$OUT/$prefix-$tag.log" | tail -"${QB_TAIL:-20}"
    first_args=()
  done
}
variant_args() {
  case "$1" in
    default) ;;
    unfused) echo --unfused ;;
    tracking) echo --event-tracking ;;
    unfused-tracking) echo --unfused --event-tracking ;;
    *) echo "unknown variant '$1' (default unfused tracking unfused-tracking)" >&2; return 1 ;;
  esac
}

for step in "${steps[@]}"; do
  echo "== $step"
  case "$step" in
    gpus)
      nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpus.txt"
      nvidia-smi topo -m | tee -a "$OUT/gpus.txt"
      ;;
    tests | tests=*)
      need_bin test-integration tests --tests || continue
      filters=(train sharding cuda:: offloaded_equals_resident_gpu)
      [[ "$step" == tests=* ]] && IFS=, read -r -a filters <<<"${step#tests=}"
      # From /tmp: the tests must not rely on the build machine's paths.
      (cd /tmp && timeout "${TESTS_S:-240}" "$BIN/test-integration" --test-threads 1 "${filters[@]}") \
        >"$OUT/tests.log" 2>&1
      echo "tests exit $?" | tee -a "$OUT/tests.log"
      grep -E "^test |test result" "$OUT/tests.log" | tail -30
      ;;
    parity | parity=*)
      need_bin parity parity "--bin parity" || continue
      names=()
      [[ "$step" == parity=* ]] && IFS=, read -r -a names <<<"${step#parity=}"
      rm -rf /tmp/refs
      timeout "${PARITY_S:-240}" python3 scripts/hf_reference.py /tmp/refs "${names[@]}" >"$OUT/parity.log" 2>&1
      echo "references exit $?" | tee -a "$OUT/parity.log"
      (cd /tmp && timeout "${PARITY_S:-240}" "$BIN/parity" /tmp/refs/* --json-out "$OUT/parity.json") \
        >>"$OUT/parity.log" 2>&1
      echo "parity exit $?" | tee -a "$OUT/parity.log"
      tail -20 "$OUT/parity.log"
      ;;
    own_model)
      need_bin own_model own_model "--example own_model" || continue
      timeout "${OWN_S:-60}" "$BIN/own_model" --gpu >"$OUT/own_model.log" 2>&1
      echo "own_model exit $?" | tee -a "$OUT/own_model.log"
      tail -6 "$OUT/own_model.log"
      ;;
    streaming)
      need_bin streaming streaming "--bench streaming" || continue
      timeout "${STREAMING_S:-180}" "$BIN/streaming" --budgets 4,12 --json-out "$OUT/streaming.json" \
        >"$OUT/streaming.log" 2>&1
      echo "streaming exit $?"
      tail -12 "$OUT/streaming.log"
      ;;
    make7b)
      last_gpu=$(($(nvidia-smi -L 2>/dev/null | wc -l) - 1))
      ((last_gpu < 0)) && last_gpu=0
      (
        t0=$(date +%s)
        CUDA_VISIBLE_DEVICES=$last_gpu timeout "${MAKE7B_S:-300}" python3 scripts/make_llama7b.py /tmp/llama7b
        echo "7B exit $? after $(($(date +%s) - t0)) s"
      ) >"$OUT/make7b.log" 2>&1 &
      make7b_pid=$!
      echo "writing /tmp/llama7b in the background (GPU $last_gpu)"
      ;;
    peer)
      # shellcheck disable=SC2086 # PEER_ARGS is a list of arguments
      timeout "${PEER_S:-100}" python3 scripts/train_peer.py "$OUT/train_peer.json" ${PEER_ARGS:-} >"$OUT/peer.log" 2>&1
      echo "peer exit $?"
      ;;
    shard)
      need_bin bench_shard shard "--bin bench_shard" || continue
      wait_make7b || continue
      timeout "${SHARD_S:-300}" "$BIN/bench_shard" --model-dir /tmp/llama7b --json-out "$OUT/shard.json" \
        >"$OUT/bench_shard.log" 2>&1
      echo "bench_shard exit $?"
      grep -v "^ \|^device map\|^streamed\|^ dev" "$OUT/bench_shard.log" | tail -12
      ;;
    llamacpp)
      [[ -f .gpu/llamacpp/build.sh ]] || { echo "llamacpp: copy ../shared/peer/llamacpp to .gpu/llamacpp"; continue; }
      if compgen -G ".lcbin/lcbin.tar.xz.*" >/dev/null; then
        # A carried build of the same source: the source for gguf-py, then the binaries.
        mkdir -p /tmp/llamacpp/build
        tar xJf .gpu/llamacpp/llamacpp-src.tar.xz -C /tmp/llamacpp --strip-components=1
        cat .lcbin/lcbin.tar.xz.* | xz -dc | tar -C /tmp/llamacpp/build -xf -
        echo "llama.cpp unpacked from .lcbin: $(ls /tmp/llamacpp/build/bin | tr '\n' ' ')"
      fi
      bash .gpu/llamacpp/build.sh /tmp/llamacpp >"$OUT/llamacpp-build.log" 2>&1 &
      llamacpp_pid=$!
      echo "building llama.cpp in the background"
      ;;
    llamacpp_save)
      wait_llamacpp || continue
      t0=$(date +%s)
      tar -C /tmp/llamacpp/build -cf - bin | xz -T0 -6 | split -b 15M - "$OUT/lcbin.tar.xz."
      echo "llamacpp_save: $(ls -la "$OUT"/lcbin.tar.xz.* | awk '{s += $5} END {print s}') bytes in $(($(date +%s) - t0)) s"
      ;;
    gguf7b)
      wait_llamacpp || continue
      t0=$(date +%s)
      # shellcheck disable=SC2086 # GGUF7B_TYPES is a list
      make_gguf 7b 4096 32 11008 32 32 32000 ${GGUF7B_TYPES-Q8_0 Q4_0 Q4_K_M}
      echo "gguf7b exit $? after $(($(date +%s) - t0)) s"
      ;;
    gguf13b)
      wait_llamacpp || continue
      t0=$(date +%s)
      # shellcheck disable=SC2086 # GGUF13B_TYPES is a list
      make_gguf 13b 5120 40 13824 40 40 32000 ${GGUF13B_TYPES-Q4_K_M Q8_0} && rm -f /tmp/gguf/13b-f16.gguf
      echo "gguf13b exit $? after $(($(date +%s) - t0)) s"
      ;;
    gguf_qwen3_8b)
      wait_llamacpp || continue
      family_gguf qwen3-8b qwen3 "${GGUF_QWEN3_TYPES-Q4_K_M}"
      ;;
    gguf_gemma3_12b)
      wait_llamacpp || continue
      family_gguf gemma3-12b gemma3 "${GGUF_GEMMA3_TYPES-Q4_K_M}"
      ;;
    qonload | qonload=*)
      need_bin bench_generate qonload "--bin bench_generate" || continue
      wait_make7b || continue
      ws=(q4_0 q8_0)
      [[ "$step" == qonload=* ]] && IFS=, read -r -a ws <<<"${step#qonload=}"
      for w in "${ws[@]}"; do
        # The first run writes the cached GGUF next to /tmp/llama7b; the others read it.
        bench_variants qonload "7b-$w" --model-dir /tmp/llama7b --quantize "$w" --weights "7b-$w-on-load" \
          --budgets "${QB_BUDGETS:-full}" --prompt-lens "${QB_PROMPTS:-64}" --depths 2
      done
      ;;
    qbench | qbench=*)
      need_bin bench_generate qbench "--bin bench_generate" || continue
      wait_llamacpp || continue
      ws=(7b-q4_0 7b-q8_0)
      [[ "$step" == qbench=* ]] && IFS=, read -r -a ws <<<"${step#qbench=}"
      for w in "${ws[@]}"; do
        f=/tmp/gguf/$w.gguf
        [[ -s "$f" ]] || { echo "qbench: no $f (run gguf7b / gguf13b / gguf_qwen3_8b / gguf_gemma3_12b)"; continue; }
        q=(--quantized)
        [[ "$w" == *f16 ]] && q=()
        # shellcheck disable=SC2206 # QB_ARGS is a list of arguments
        q+=(${QB_ARGS---host-layers spread:auto})
        # llama.cpp runs with the first variant only (the same call for the others).
        first_args=(--llamacpp-bin "$lc_bin")
        bench_variants qbench "$w" --model-dir "$f" "${q[@]}" --weights "$w" \
          --budgets "${QB_BUDGETS:-4,8,12,full}" --prompt-lens "${QB_PROMPTS:-64,512}" \
          --depths "${QB_DEPTHS:-2}"
      done
      ;;
    decode | decode=*)
      need_bin bench_generate decode "--bin bench_generate" || continue
      wait_make7b || continue
      vs=(default)
      [[ "$step" == decode=* ]] && IFS=, read -r -a vs <<<"${step#decode=}"
      for v in "${vs[@]}"; do
        va=$(variant_args "$v") || continue
        # shellcheck disable=SC2086 # va is a list of arguments
        (cd /tmp && timeout "${DECODE_S:-200}" "$BIN/bench_generate" --model-dir /tmp/llama7b $va \
          --budgets "${DECODE_BUDGETS:-12,full}" --prompt-lens 64 --depths 2 --new-tokens 32 \
          --json-out "$OUT/decode-$v.json") >"$OUT/decode-$v.log" 2>&1
        echo "decode $v exit $?"
        tail -4 "$OUT/decode-$v.log"
      done
      ;;
    breakdown | breakdown=*)
      need_bin bench_generate breakdown "--bin bench_generate" || continue
      model=${BREAKDOWN_MODEL:-/tmp/llama7b}
      [[ -n "${BREAKDOWN_MODEL:-}" ]] || wait_make7b || continue
      v=default
      [[ "$step" == breakdown=* ]] && v=${step#breakdown=}
      va=$(variant_args "$v") || continue
      sj=()
      [[ -s "$OUT/decode-$v.json" ]] && sj=(--step-json "$OUT/decode-$v.json")
      # shellcheck disable=SC2086 # va and BREAKDOWN_ARGS are lists of arguments
      (cd /tmp && timeout "${BREAKDOWN_S:-300}" python3 "$OLDPWD/scripts/kernel_breakdown.py" \
        decode --bin "$BIN/bench_generate" --model-dir "$model" --steps 4 "${sj[@]}" \
        --out "$OUT/breakdown-$v.json" -- $va ${BREAKDOWN_ARGS:-}) >"$OUT/breakdown-$v.log" 2>&1
      echo "breakdown $v exit $?"
      rm -f "$OUT/breakdown-$v.ncu-rep"
      grep -A40 "kernels per token" "$OUT/breakdown-$v.log" | head -45
      ;;
    tiers)
      need_bin bench_generate tiers "--bin bench_generate" || continue
      wait_make7b || continue
      t_end=$(($(date +%s) + ${TIERS_S:-540}))
      # Seconds left of TIERS_S, at least 1 (`timeout 0` would mean no limit at all).
      left() { local l=$((t_end - $(date +%s))); echo $((l > 0 ? l : 1)); }
      drop_caches() { sync && echo 3 >/proc/sys/vm/drop_caches 2>/dev/null && echo dropped || echo kept; }
      # The disk's raw sequential rate: every checkpoint file, O_DIRECT, 64 MiB blocks.
      drop_caches >/dev/null
      t0=$(date +%s.%N); bytes=0
      for f in /tmp/llama7b/*.safetensors; do
        dd if="$f" of=/dev/null bs=64M iflag=direct status=none 2>>"$OUT/tiers.log" || dd if="$f" of=/dev/null bs=64M status=none
        bytes=$((bytes + $(stat -c %s "$f")))
      done
      raw=$(python3 -c "import time; print(f'{$bytes / (time.time() - $t0) / 1e9:.3f}')")
      echo "raw disk: $bytes bytes at $raw GB/s ($(df -h /tmp | tail -1))" | tee -a "$OUT/tiers.log"
      # The rate by request shape (threads x MiB per O_DIRECT read), $PROBE_GB per shape.
      if [[ -n "${PROBE_GB:-}" ]]; then
        COMMIT=$(git describe --always --dirty --abbrev=12 2>/dev/null || echo unknown) \
          timeout 120 python3 scripts/disk_probe.py "$OUT/disk-probe.json" "$PROBE_GB" /tmp/llama7b/*.safetensors 2>&1 | tee -a "$OUT/tiers.log"
      fi
      IFS=, read -r -a caps <<<"${TIER_CAPS:-4,8}"
      for cap in "${caps[@]}"; do
        run_tier() { # NAME STATE [ARGS...]
          local name=$1 state=$2; shift 2
          ((${TIERS_ACC_ONLY:-0})) && return
          [[ " ${TIER_ROWS:-direct pagecache-cold pagecache-warm} " == *" ${name%%-[0-9]*x*} "* ]] || return 0
          (cd /tmp && timeout "$(left)" "$BIN/bench_generate" --model-dir /tmp/llama7b --budgets 4             --prompt-lens 64 --new-tokens "${TIER_TOKENS:-6}" --cpu-memory-limit "$cap" --raw-disk-gbps "$raw"             --cache-state "$state" "${acc[@]}" "$@" --json-out "$OUT/tiers-$cap-$name.json") >>"$OUT/tiers.log" 2>&1
          echo "tiers cap $cap $name ($state) exit $?" | tee -a "$OUT/tiers.log"
          grep -E "^ +64 +4 |disk:|accelerate" "$OUT/tiers.log" | tail -3
        }
        # accelerate first, so that its JSON sits next to ours in every record of this cap.
        acc=()
        rm -rf /tmp/acc-offload
        ((${ACC_SKIP:-0})) || DROP_CACHES=${ACC_DROP:-1} timeout "$(( $(left) / 2 + 1 ))" python3 scripts/accelerate_peer.py /tmp/llama7b 4 64 "${ACC_TOKENS:-2}"           "$OUT/tiers-$cap-accelerate.json" "$cap" /tmp/acc-offload >>"$OUT/tiers.log" 2>&1
        echo "accelerate cap $cap exit $?" | tee -a "$OUT/tiers.log"
        rm -rf /tmp/acc-offload
        [[ -s "$OUT/tiers-$cap-accelerate.json" ]] && acc=(--peer "$OUT/tiers-$cap-accelerate.json")
        run_tier direct "cold (O_DIRECT)"
        # More O_DIRECT rows in other read shapes (THREADSxMIB, the disk tier's overrides).
        for shape in ${TIER_SHAPES:-}; do
          CANDLE_OFFLOAD_DISK_THREADS=${shape%x*} CANDLE_OFFLOAD_DISK_PIECE_MIB=${shape#*x} \
            run_tier "direct-$shape" "cold (O_DIRECT, $shape)"
        done
        state=$(drop_caches)
        run_tier pagecache-cold "$([[ $state == dropped ]] && echo cold || echo "not dropped")" --disk-page-cache
        run_tier pagecache-warm warm --disk-page-cache
      done
      ;;
    managed)
      need_bin bench_generate managed "--bin bench_generate" || continue
      wait_make7b || continue
      for e in explicit managed; do
        (cd /tmp && timeout "${MANAGED_S:-240}" "$BIN/bench_generate" --model-dir /tmp/llama7b --engine "$e" \
          --budgets "${MANAGED_BUDGETS:-full}" --prompt-lens 64 --new-tokens 16 \
          --json-out "$OUT/managed-$e.json") >"$OUT/managed-$e.log" 2>&1
        echo "managed: engine $e exit $?"
        tail -5 "$OUT/managed-$e.log"
      done
      # A budget the model does not fit: the managed engine refuses to stream (exit != 0).
      (cd /tmp && timeout 120 "$BIN/bench_generate" --model-dir /tmp/llama7b --engine managed --budgets 4 \
        --prompt-lens 64 --new-tokens 2) >"$OUT/managed-refused.log" 2>&1
      echo "managed at 4 GiB: exit $? (refusal expected)"
      tail -2 "$OUT/managed-refused.log"
      if need_bin smoke managed "--bin smoke"; then
        (cd /tmp && timeout 120 "$BIN/smoke" --copy-mib 64 --um-table-mib 600 --json-out "$OUT/um-table.json") \
          >"$OUT/um-table.log" 2>&1
        echo "um table exit $?"
        grep -A4 "Unified Memory table" "$OUT/um-table.log"
      fi
      ;;
    trainprof | trainprof=*)
      need_bin bench_train trainprof "--bin bench_train" || continue
      cs=none-bf16
      [[ "$step" == trainprof=* ]] && cs=${step#trainprof=}
      for c in ${cs//,/ }; do
        # shellcheck disable=SC2086 # TRAINPROF_ARGS is a list of arguments
        (cd /tmp && timeout "${TRAINPROF_S:-240}" python3 "$OLDPWD/scripts/kernel_breakdown.py" \
          train --bin "$BIN/bench_train" --config "$c" --out "$OUT/trainprof-$c.json" \
          -- ${TRAINPROF_ARGS:-}) >"$OUT/trainprof-$c.log" 2>&1
        echo "trainprof $c exit $?"
        # The report stays (for ncu --import); the run tool brings back what is asked for.
        grep -A60 "ms unprofiled" "$OUT/trainprof-$c.log" | head -70
      done
      ;;
    train)
      need_bin bench_train train "--bin bench_train" || continue
      peer=()
      [[ -s "$OUT/train_peer.json" ]] && peer=(--peer "$OUT/train_peer.json")
      limit=(--max-seconds "${MAX_S:-170}")
      [[ " ${train_args[*]} " == *" --max-seconds "* ]] && limit=()
      timeout "${TRAIN_S:-260}" "$BIN/bench_train" "${peer[@]}" --json-out "$OUT/train.json" \
        "${limit[@]}" "${train_args[@]}" >"$OUT/train.log" 2>&1
      echo "bench_train exit $?"
      tail -25 "$OUT/train.log"
      ;;
  esac
done
if [[ -n "$make7b_pid" ]]; then
  wait "$make7b_pid"
  tail -1 "$OUT/make7b.log"
fi
if [[ -n "$llamacpp_pid" ]]; then
  wait "$llamacpp_pid"
  tail -1 "$OUT/llamacpp-build.log"
fi
