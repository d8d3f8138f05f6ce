#!/usr/bin/env bash
# gpu_lora_session.sh: the GPU rows of the LoRA issue: our adapters checked in PEFT, and
# `bench_train`'s `lora-*` configurations against PEFT's LoRA on transformers
# (scripts/lora_peer.py) in the same call, in two chained calls of the GPU machine.
#
# Here, before the calls: `scripts/gpu-pack.sh --bin bench_train --tests` (CUDA), PEFT's wheel
# in .gpu/wheels (`pip download peft --no-deps -d .gpu/wheels`: the GPU machine reaches no
# registry), `git rev-parse --short=12 HEAD > .gpu/COMMIT`.
# Call 1 (carry .gpu/bench_train.xz, .gpu/test-integration.xz, .gpu/wheels, .gpu/COMMIT):
#   `bash scripts/gpu_lora_session.sh call1`
#   PEFT installed from the wheel where missing; the adapter tests/lora.rs saves
#   (`saved_adapter_reloads_bit_exactly` with LORA_PEFT_OUT) loaded in PEFT on the committed
#   base, its logits against ours (`scripts/peft_fixtures.py check`, 1e-4) -> peft-check.log;
#   the 1B shape resident, PEFT first (lora-bf16; lora-q4_k-bf16 runs bitsandbytes' NF4 where
#   it is installed, an error row otherwise), then ours with it as the peer -> lora-1b.json.
# Call 2 (carry .gpu/bench_train.xz, .gpu/COMMIT): `bash scripts/gpu_lora_session.sh call2`
#   the 7B shape: each base resident (the ideal's compute) and under budgets: BF16 at 6 and
#   8 GiB, Q4_K (QLoRA) at 4 and 6 GiB -> lora-7b.json ($LORA7B_ARGS: more bench_train
#   arguments, e.g. --batch-size 1).
# Each call leaves $OUT/CALL.tgz with its logs and JSON.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_CACHE_MAXSIZE=4294967296
FINAL=${OUT:-/tmp/out}; OUT=/tmp/res-$1; mkdir -p "$FINAL" "$OUT" /tmp/bin
R=$PWD
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
unpack() { [[ -x /tmp/bin/$1 ]] || { xz -dc ".gpu/$1.xz" > "/tmp/bin/$1" && chmod +x "/tmp/bin/$1"; }; }
train() { # train NAME ARGS...: bench_train -> $OUT/NAME.json, copied to $FINAL
  local name=$1; shift
  unpack bench_train
  (cd /tmp && timeout "${TRAIN_S:-400}" /tmp/bin/bench_train --json-out "$OUT/$name.json" "$@") \
    > "$OUT/$name.log" 2>&1
  echo "$name exit $?"; tail -14 "$OUT/$name.log"
  cp "$OUT/$name.json" "$FINAL/" 2>/dev/null
}
case "$1" in
  call1)
    if ! python3 -c "import peft" 2>/dev/null; then
      pip install --no-deps --no-index .gpu/wheels/peft-*.whl > "$OUT/pip.log" 2>&1
      echo "peft installed: $?"
    fi
    python3 -c "import peft, transformers, torch; print('peft', peft.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
    unpack test-integration
    el "our adapter in PEFT"
    rm -rf /tmp/lora-ours
    (LORA_PEFT_OUT=/tmp/lora-ours timeout 120 /tmp/bin/test-integration --exact \
      lora::saved_adapter_reloads_bit_exactly) > "$OUT/peft-check.log" 2>&1
    echo "test exit $?" | tee -a "$OUT/peft-check.log"
    python3 scripts/peft_fixtures.py check tests/fixtures/peft/base /tmp/lora-ours >> "$OUT/peft-check.log" 2>&1
    echo "check exit $?" | tee -a "$OUT/peft-check.log"; tail -4 "$OUT/peft-check.log"
    el "PEFT, 1B shape"
    timeout "${PEER_S:-240}" python3 scripts/lora_peer.py "$OUT/lora-peer-1b.json" \
      --configs "${LORA_CONFIGS:-lora-bf16,lora-q4_k-bf16}" > "$OUT/lora-peer-1b.log" 2>&1
    echo "peer exit $?"; tail -3 "$OUT/lora-peer-1b.log"
    el "ours, 1B shape"
    train lora-1b --configs "${LORA_CONFIGS:-lora-bf16,lora-q4_k-bf16}" --peer "$OUT/lora-peer-1b.json"
    el "done"
    ;;
  call2)
    # shellcheck disable=SC2086 # LORA7B_ARGS is a list of arguments
    train lora-7b --layers 32 --hidden 4096 --heads 32 --kv-heads 32 --intermediate 11008 \
      --configs lora-bf16,lora-bf16-6gib,lora-bf16-8gib,lora-q4_k-bf16,lora-q4_k-bf16-4gib,lora-q4_k-bf16-6gib \
      --max-seconds "${MAX_S:-420}" ${LORA7B_ARGS:-}
    el "done"
    ;;
  *) echo "usage: $0 call1 | call2" >&2; exit 2 ;;
esac
tar czf "$FINAL/$1.tgz" -C "$OUT" . ; ls -la "$FINAL"
