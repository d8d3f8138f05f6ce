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
#   8 GiB, Q4_K (QLoRA) at 4 and 6 GiB, one sequence of 1,024 tokens a step (at four, the
#   activations alone reserve 6 GiB) -> lora-7b.json ($LORA7B_ARGS: other bench_train
#   arguments in place of `--batch-size 1`).
# bitsandbytes (the QLoRA peer, NF4): its wheel (~43 MB) does not fit one call's carry beside
#   bench_train, so it travels in pieces: here, `pip download bitsandbytes --no-deps`, then
#   `split -b 14500000 WHEEL .gpu/bnb/bnb.part-` and `sha256sum WHEEL > .gpu/bnb/SHA256`; each
#   call stages the pieces it carries in /tmp/stage/bnb (which survives between chained calls).
# Call qlora (carry .gpu/bench_train.xz, .gpu/COMMIT and the last pieces):
#   `bash scripts/gpu_lora_session.sh qlora`: the wheel assembled, checked and installed; the
#   1B shape's QLoRA row, PEFT on bitsandbytes NF4 first, then ours -> lora-1b-qlora.json.
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
# The bitsandbytes pieces this call carries, kept for the next calls; installed once all are here.
bnb() {
  mkdir -p /tmp/stage/bnb
  cp .gpu/bnb/* /tmp/stage/bnb/ 2>/dev/null
  python3 -c "import bitsandbytes" 2>/dev/null && { echo "bitsandbytes is installed"; return 0; }
  [[ -f /tmp/stage/bnb/SHA256 ]] || { echo "bitsandbytes: pieces staged, no SHA256 yet"; return 1; }
  local whl; whl=/tmp/stage/$(awk '{print $2}' /tmp/stage/bnb/SHA256)
  cat /tmp/stage/bnb/bnb.part-* > "$whl"
  (cd /tmp/stage && sha256sum -c bnb/SHA256 --quiet 2>/dev/null) || { echo "bitsandbytes: pieces missing"; return 1; }
  python3 -m pip install --no-deps --no-index "$whl" > "$OUT/pip-bnb.log" 2>&1
  python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)"
}
case "$1" in
  call1)
    bnb
    if ! python3 -c "import peft" 2>/dev/null; then
      python3 -m pip install --no-deps --no-index .gpu/wheels/peft-*.whl > "$OUT/pip.log" 2>&1
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
  qlora)
    bnb || exit 1
    el "PEFT on bitsandbytes NF4, 1B shape"
    timeout "${PEER_S:-240}" python3 scripts/lora_peer.py "$OUT/lora-peer-1b-qlora.json" \
      --configs lora-q4_k-bf16 > "$OUT/lora-peer-1b-qlora.log" 2>&1
    echo "peer exit $?"; tail -3 "$OUT/lora-peer-1b-qlora.log"
    el "ours, 1B shape"
    train lora-1b-qlora --configs lora-q4_k-bf16 --peer "$OUT/lora-peer-1b-qlora.json"
    el "done"
    ;;
  call2)
    # shellcheck disable=SC2086 # LORA7B_ARGS is a list of arguments
    train lora-7b --layers 32 --hidden 4096 --heads 32 --kv-heads 32 --intermediate 11008 \
      --configs lora-q4_k-bf16,lora-q4_k-4gib-bf16,lora-bf16,lora-6gib-bf16,lora-8gib-bf16,lora-q4_k-6gib-bf16 \
      --max-seconds "${MAX_S:-420}" ${LORA7B_ARGS:---batch-size 1}
    el "done"
    ;;
  *) echo "usage: $0 call1 | qlora | call2" >&2; exit 2 ;;
esac
tar czf "$FINAL/$1.tgz" -C "$OUT" . ; ls -la "$FINAL"
