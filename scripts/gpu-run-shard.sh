#!/usr/bin/env bash
# gpu-run-shard.sh: on the GPU machine (kind nvidia-h200-x2), from the repository root, with the
# binaries packed by `scripts/gpu-pack.sh --tests --example bench_shard --example generate` in
# .gpu/: unpacks them, runs the GPU tests of training and sharding, writes the 7B-shaped
# checkpoint and runs the sharding benchmark. Results go to $OUT.
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
# (generate --devices needs a tokenizer, which the random 7B checkpoint lacks; bench_shard runs
# the same sharded path.)
timeout 300 /tmp/bin/bench_shard --model-dir /tmp/llama7b --json-out "$OUT/shard.json" 2>&1 | tee "$OUT/bench_shard.log" | grep -v "^ \|^device map\|^streamed"
