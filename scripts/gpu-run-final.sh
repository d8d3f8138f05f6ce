#!/usr/bin/env bash
# gpu-run-final.sh: on the GPU machine (nvidia-h200-x2), with bench_train and bench_shard packed
# in .gpu/: the training benchmark next to its PyTorch peer (GPU 0), then the 7B-shaped
# checkpoint and the sharding benchmark (both GPUs). Each step has its own time limit so the
# whole call stays under the tool's 600 s. Results go to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/bin
for f in .gpu/*.xz; do n=$(basename "$f" .xz); xz -dc "$f" > "/tmp/bin/$n" && chmod +x "/tmp/bin/$n"; done
export PYTHONUNBUFFERED=1
( CUDA_VISIBLE_DEVICES=1 timeout 90 python3 scripts/make_llama7b.py /tmp/llama7b > "$OUT/make7b.log" 2>&1; echo "7B exit $?" >> "$OUT/make7b.log" ) &
timeout 100 python3 scripts/train_peer.py "$OUT/train_peer.json" > "$OUT/peer.log" 2>&1; echo "peer exit $?"
wait; tail -1 "$OUT/make7b.log"
timeout 150 /tmp/bin/bench_shard --model-dir /tmp/llama7b --json-out "$OUT/shard.json" > "$OUT/bench_shard.log" 2>&1
echo "bench_shard exit $?"; grep -v "^ \|^device map\|^streamed\|^ dev" "$OUT/bench_shard.log" | tail -12
P=; [ -s "$OUT/train_peer.json" ] && P="--peer $OUT/train_peer.json"
timeout 250 /tmp/bin/bench_train $P --json-out "$OUT/train.json" --offload-steps 1 \
  --configs none-f32,layer-f32,sqrt-f32,none-f16,layer-f16,sqrt-f16,none-bf16,layer-bf16,sqrt-bf16,offload-4gib-bf16 \
  --max-seconds 150 > "$OUT/train.log" 2>&1
echo "bench_train exit $?"; tail -25 "$OUT/train.log"
