#!/usr/bin/env bash
# gpu-run-shard.sh: on the GPU machine (kind nvidia-h200-x2), from the repository root, with the
# binaries packed by `scripts/gpu-pack.sh --tests --example bench_shard --example generate` in
# .gpu/: unpacks them, runs the GPU tests of training and sharding, writes the 7B-shaped
# checkpoint, checks generate --devices 0,1 and runs the sharding benchmark. Results go to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/bin
for f in .gpu/*.xz; do n=$(basename "$f" .xz); xz -dc "$f" > "/tmp/bin/$n" && chmod +x "/tmp/bin/$n"; done
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpus.txt"
nvidia-smi topo -m | tee -a "$OUT/gpus.txt"
# GPU tests: training gradients, sharding (two GPUs, peer access on and off), the runtime's.
( cd /tmp && timeout 240 /tmp/bin/test-integration --test-threads 1 train sharding cuda:: offloaded_equals_resident_gpu ) \
  > "$OUT/tests.log" 2>&1; echo "tests exit $?" | tee -a "$OUT/tests.log"
grep -E "^test |test result" "$OUT/tests.log" | tail -30
t0=$(date +%s); python3 scripts/make_llama7b.py /tmp/llama7b > "$OUT/make7b.log" 2>&1; echo "7B written in $(( $(date +%s) - t0 )) s"
timeout 120 /tmp/bin/generate --model /tmp/llama7b --no-chat-template --prompt "Once upon a time" --max-new-tokens 8 \
  --devices 0,1 --gpu-memory-limit 4,6 --device-map balanced --save-device-map "$OUT/plan.json" > "$OUT/generate-2gpu.log" 2>&1
echo "generate --devices exit $?"; tail -25 "$OUT/generate-2gpu.log"
timeout 300 /tmp/bin/bench_shard --model-dir /tmp/llama7b --json-out "$OUT/shard.json" 2>&1 | tee "$OUT/bench_shard.log" | grep -v "^ \|^device map\|^streamed"
