#!/usr/bin/env bash
# gpu-pack.sh: build chosen CUDA binaries (release) and pack them into .gpu/ for the GPU machine,
# which has no Rust. Each binary is stripped and xz-compressed to .gpu/<name>.xz:
#   --example NAME  -> .gpu/NAME.xz
#   --bin NAME      -> .gpu/NAME.xz
#   --bench NAME    -> .gpu/NAME.xz
#   --tests         -> .gpu/test-<target>.xz for every test executable of the workspace
#                      (the integration binary: test-integration; library unit tests:
#                      test-candle_offload, test-candle_offload_models)
# .gpu/ is git-ignored; the device run tool carries it only when called with carry [".gpu"].
# The carried tree is limited to 64 MiB; one cuda binary is ~5 MiB packed.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/gpu-pack.sh [--example NAME]... [--bin NAME]... [--bench NAME]... [--tests] [--clean]

Builds the chosen binaries with --release --features cuda (CUDA 13.0 build-only toolkit from
scripts/cuda-toolkit.sh) and writes stripped, xz-compressed copies to .gpu/<name>.xz.
  --example NAME  an example (examples/NAME.rs); repeatable
  --bin NAME      a benchmark binary (bench/src/bin/NAME.rs: bench_generate, bench_train,
                  bench_shard, parity, batch_parity, smoke); repeatable
  --bench NAME    a cargo bench of the benchmark crate (bench/benches/); repeatable
  --tests         every test executable of the workspace, as test-<target-name>
  --clean         delete .gpu/*.xz from earlier packs first (otherwise they are kept)
  --features LIST more features of the benchmark crate for --bin/--bench builds,
                  comma-separated (cuda is always on), e.g. host-profile for
                  bench_train --host-profile
  --keep-symbols  keep the symbol tables (strip debug info only): what an in-process
                  profiler such as --host-profile needs to name functions (larger packs)
Environment: CARGO_TARGET_DIR (default ~/.cache/candle-offload/target-cuda-release),
CUDA_COMPUTE_CAP (default 90), CUDA_PIP_PREFIX (see scripts/cuda-toolkit.sh).
EOF
}

die() { echo "gpu-pack: $*" >&2; exit 1; }

examples=() bins=() benches=() tests=0 clean=0 features=cuda keep_symbols=0
while (($# > 0)); do
  case "$1" in
    --example) (($# >= 2)) || die "--example needs a NAME"; examples+=("$2"); shift 2 ;;
    --example=*) examples+=("${1#*=}"); shift ;;
    --bin) (($# >= 2)) || die "--bin needs a NAME"; bins+=("$2"); shift 2 ;;
    --bin=*) bins+=("${1#*=}"); shift ;;
    --bench) (($# >= 2)) || die "--bench needs a NAME"; benches+=("$2"); shift 2 ;;
    --bench=*) benches+=("${1#*=}"); shift ;;
    --tests) tests=1; shift ;;
    --clean) clean=1; shift ;;
    --features) (($# >= 2)) || die "--features needs a LIST"; features="cuda,$2"; shift 2 ;;
    --features=*) features="cuda,${1#*=}"; shift ;;
    --keep-symbols) keep_symbols=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
if ((${#examples[@]} + ${#bins[@]} + ${#benches[@]} + tests == 0)); then
  usage >&2
  die "nothing to pack: give --example NAME, --bin NAME, --bench NAME and/or --tests"
fi
for n in "${examples[@]}" "${bins[@]}" "${benches[@]}"; do
  [[ "$n" =~ ^[A-Za-z0-9_-]+$ ]] || die "bad target name '$n' (letters, digits, _ and - only)"
done

for tool in cargo python3 strip xz; do
  command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found (needed to build and pack)"
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# shellcheck source=cuda-toolkit.sh
source scripts/cuda-toolkit.sh || die "could not set up the CUDA build toolkit (see above)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/candle-offload/target-cuda-release}"
echo "gpu-pack: CARGO_TARGET_DIR=$CARGO_TARGET_DIR CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP" >&2

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
list="$work/binaries.tsv"   # name <TAB> path of the built executable
: > "$list"

# Reads cargo's JSON messages on stdin, prints "name<TAB>executable" for the wanted artifacts.
#   pick KIND NAME : the artifact of the target NAME whose kinds include KIND (example, bin, bench)
#   pick tests     : every test-harness executable, named test-<target-name>
pick() {
  python3 -c '
import json, sys
mode = sys.argv[1]
name = sys.argv[2] if len(sys.argv) > 2 else ""
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        continue
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    target = msg.get("target", {})
    if mode == "tests":
        if msg.get("profile", {}).get("test"):
            print("test-%s\t%s" % (target["name"], msg["executable"]))
    elif target.get("name") == name and mode in target.get("kind", []):
        print("%s\t%s" % (name, msg["executable"]))
' "$@"
}

# Runs a cargo command with JSON output to a file (diagnostics still rendered on stderr).
cargo_json() {
  local out="$1"; shift
  echo "gpu-pack: cargo $*" >&2
  cargo "$@" --message-format=json-render-diagnostics > "$out" || die "cargo $* FAILED"
}

# Adds exactly one artifact of kind $1 named $2 from JSON file $3 to the list.
add_one() {
  local found
  found="$(pick "$1" "$2" < "$3")"
  [[ -n "$found" ]] || die "cargo built no executable for $1 '$2' (is the name right?)"
  [[ $(printf '%s\n' "$found" | wc -l) -eq 1 ]] || die "several executables for $1 '$2': $found"
  # A copy now: a later build (cargo test builds the examples too, with other features) can
  # overwrite the executable at the same path.
  local name="${found%%$'\t'*}" exe="${found#*$'\t'}"
  cp "$exe" "$work/built-$name" || die "cannot copy $exe"
  printf '%s\t%s\n' "$name" "$work/built-$name" >> "$list"
}

for n in "${examples[@]}"; do
  cargo_json "$work/example-$n.json" build --release --features cuda --example "$n"
  add_one example "$n" "$work/example-$n.json"
done
for n in "${bins[@]}"; do
  cargo_json "$work/bin-$n.json" build --release -p candle-offload-bench --features "$features" --bin "$n"
  add_one bin "$n" "$work/bin-$n.json"
done
for n in "${benches[@]}"; do
  cargo_json "$work/bench-$n.json" bench --no-run -p candle-offload-bench --features "$features" --bench "$n"
  add_one bench "$n" "$work/bench-$n.json"
done
if ((tests)); then
  cargo_json "$work/tests.json" test --release --features cuda --workspace --no-run
  pick tests < "$work/tests.json" >> "$list"
  grep -q '^test-' "$list" || die "cargo test --no-run reported no test executables"
fi

dups="$(cut -f1 "$list" | sort | uniq -d)"
[[ -z "$dups" ]] || die "two binaries would get the same name: $dups"

mkdir -p .gpu
if ! grep -qxF '/.gpu/' .gitignore 2>/dev/null; then
  [[ ! -s .gitignore || -z "$(tail -c 1 .gitignore)" ]] || echo >> .gitignore
  echo '/.gpu/' >> .gitignore
fi
if ((clean)); then
  rm -f .gpu/*.xz
fi

while IFS=$'\t' read -r name exe; do
  [[ -x "$exe" ]] || die "built executable missing: $exe"
  if ((keep_symbols)); then
    strip --strip-debug -o "$work/$name" "$exe" || die "strip failed on $exe"
  else
    strip -o "$work/$name" "$exe" || die "strip failed on $exe"
  fi
  xz -T2 -6 -c "$work/$name" > "$work/$name.xz" || die "xz failed on $name"
  mv -f "$work/$name.xz" ".gpu/$name.xz"
  printf 'gpu-pack: %-36s %8s stripped -> %8s packed (%s)\n' ".gpu/$name.xz" \
    "$(du -h "$work/$name" | cut -f1)" "$(du -h ".gpu/$name.xz" | cut -f1)" "$exe" >&2
  rm -f "$work/$name"
done < "$list"

total_bytes="$(du -sb .gpu | cut -f1)"
total_mib="$(awk -v b="$total_bytes" 'BEGIN { printf "%.1f", b / 1048576 }')"
echo
echo "Packed into .gpu/ (total $total_mib MiB of the 64 MiB the run tool carries):"
ls -l .gpu/
if ((total_bytes > 48 * 1048576)); then
  echo "WARNING: .gpu is $total_mib MiB, close to the 64 MiB limit of the carried tree;" \
    "use --clean or pack fewer binaries." >&2
fi
cat <<'EOF'

On the GPU machine (run tool with carry [".gpu"]), unpack everything with:

mkdir -p /tmp/bin && for f in .gpu/*.xz; do n=$(basename "$f" .xz); xz -dc "$f" > /tmp/bin/$n && chmod +x /tmp/bin/$n; done

then run e.g. /tmp/bin/NAME ... and write results under $OUT. The first start of each binary
spends ~5 s JIT-compiling PTX: warm up before timing.
EOF
