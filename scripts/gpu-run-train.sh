#!/usr/bin/env bash
# gpu-run-train.sh: on the GPU machine, from the repository root, with the test binaries and
# bench_train packed in .gpu/ (scripts/gpu-pack.sh --tests --example bench_train): the training
# tests on CUDA, then the PyTorch peer and our training benchmark in the same run. Extra
# arguments go to bench_train. Results go to $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/bin
for f in .gpu/*.xz; do n=$(basename "$f" .xz); xz -dc "$f" > "/tmp/bin/$n" && chmod +x "/tmp/bin/$n"; done
export PYTHONUNBUFFERED=1
if [[ -x /tmp/bin/test-integration ]]; then
  ( cd /tmp && timeout 120 /tmp/bin/test-integration --test-threads 1 train:: ) > "$OUT/tests.log" 2>&1
  echo "tests exit $?"; grep -E "^test |test result" "$OUT/tests.log" | tail -12
fi
timeout 100 python3 scripts/train_peer.py "$OUT/train_peer.json" ${PEER_ARGS:-} > "$OUT/peer.log" 2>&1; echo "peer exit $?"
P=; [ -s "$OUT/train_peer.json" ] && P="--peer $OUT/train_peer.json"
timeout 260 /tmp/bin/bench_train $P --json-out "$OUT/train.json" --max-seconds ${MAX_S:-170} "$@" > "$OUT/train.log" 2>&1
echo "bench_train exit $?"; tail -16 "$OUT/train.log"
