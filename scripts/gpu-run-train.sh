#!/usr/bin/env bash
# gpu-run-train.sh: on the GPU machine, from the repository root, with bench_train packed in
# .gpu/ (scripts/gpu-pack.sh --example bench_train): the PyTorch peer then our training
# benchmark, in the same run. Results go to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/bin
for f in .gpu/*.xz; do n=$(basename "$f" .xz); xz -dc "$f" > "/tmp/bin/$n" && chmod +x "/tmp/bin/$n"; done
export PYTHONUNBUFFERED=1
timeout 150 python3 scripts/train_peer.py "$OUT/train_peer.json" > "$OUT/peer.log" 2>&1; echo "peer exit $?"; tail -12 "$OUT/peer.log"
P=; [ -s "$OUT/train_peer.json" ] && P="--peer $OUT/train_peer.json"
timeout 400 /tmp/bin/bench_train $P --json-out "$OUT/train.json" --max-seconds ${MAX_S:-330} "$@" > "$OUT/train.log" 2>&1
echo "bench_train exit $?"; tail -40 "$OUT/train.log"
