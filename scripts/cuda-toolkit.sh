#!/usr/bin/env bash
# cuda-toolkit.sh: a CUDA 13.0 *build-only* toolkit from PyPI wheels, for compiling this workspace
# with `--features cuda` (candle-core's CUDA backend, cudarc, candle-kernels) on a machine with
# no GPU and no CUDA installed: the development machine and CI.
#
#   source scripts/cuda-toolkit.sh            # install if missing, then export the env into this shell
#   bash   scripts/cuda-toolkit.sh            # install if missing, then print the export lines
#   eval "$(bash scripts/cuda-toolkit.sh)"    # same as sourcing
#
# Idempotent: a stamp file records the pinned package set; a second run does no network access
# and takes well under a second. Environment knobs:
#   CUDA_PIP_PREFIX   where to install (default ~/.cache/candle-offload/cuda-pip-13.0, so CI caches it
#                     with the rest of ~/.cache/candle-offload). When it is not set and that default
#                     is not installed yet, an identical install in /opt/cuda-pip-13.0 (same stamp;
#                     override with CUDA_PIP_SHARED_PREFIX) is reused instead of downloading ~670 MB.
#   CUDA_COMPUTE_CAP  target GPU (default 90 = H100/H200 -> nvcc sm_90a)
#   CUDAFORGE_THREADS parallel nvcc jobs in candle-kernels' build script (default: nproc)
#   PYTHON            the python with pip that fetches the wheels (default python3)
#
# What it builds under the prefix:
#   site/                 pip --target install of the pinned wheels (nvidia/cu13/{bin,include,lib,nvvm})
#   cuda/                 a CUDA_PATH-like root made of symlinks into site/:
#     bin -> nvcc, ptxas, fatbinary, nvlink, cudafe++ ...     include/ (cuda.h, crt/, cccl/, cublas ...)
#     nvvm/ (cicc, libdevice)   lib64/ (lib -> lib64): libX.so.N + dev symlinks libX.so
#     lib64/stubs/libcuda.so(.1)  generated stub of the driver API (the wheels ship no libcuda);
#                            every entry point returns CUDA_ERROR_NO_DEVICE (100), so a binary
#                            linked here can even be started on this GPU-less machine.
# Only the build uses these files: the binary's NEEDED sonames (libcuda.so.1, libcudart.so.13,
# libcublas.so.13, libcublasLt.so.13, libcurand.so.10, libnvrtc.so.13) come from the GPU machine
# (driver + CUDA 13 toolkit). Based on the shared tools/cuda-env.sh; see docs/cuda-build.md there.

_cuda_tk_install() {   # runs in its own bash process: bash cuda-toolkit.sh --install PKG...
  set -euo pipefail
  local prefix="$CUDA_TK_PREFIX" py="$CUDA_TK_PY" want="$CUDA_TK_WANT"
  local root="$prefix/cuda" cu13="$prefix/site/nvidia/cu13"
  mkdir -p "$prefix" || { echo "cuda-toolkit: cannot create $prefix (set CUDA_PIP_PREFIX to a writable dir)" >&2; exit 1; }

  # Two builds starting at once (two terminals, CI + local) must not install over each other.
  if command -v flock >/dev/null 2>&1; then
    exec 9>"$prefix/.install.lock"
    flock 9
    if [[ -x "$root/bin/nvcc" && "$(cat "$prefix/.cuda-env-stamp" 2>/dev/null)" == "$want" ]]; then
      exit 0   # the other process finished the install while we waited
    fi
  fi

  command -v gcc >/dev/null 2>&1 || { echo "cuda-toolkit: gcc is required (nvcc host compiler, libcuda stub)" >&2; exit 1; }
  "$py" -m pip --version >/dev/null 2>&1 \
    || { echo "cuda-toolkit: '$py -m pip' does not work; install pip or set PYTHON=/path/to/python3" >&2; exit 1; }

  # 1. wheels -> site/ (fresh tmp dir, then rename: pip --target cannot merge into an existing
  #    nvidia/ namespace dir across separate runs, so always install the whole set at once).
  #    --no-cache-dir: the installed prefix is the cache; keeping the 670 MB of wheels too is waste.
  rm -rf "$prefix/site.tmp"
  "$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir --no-deps --no-compile \
      --target "$prefix/site.tmp" "$@" >&2
  rm -rf "$prefix/site" "$root" "$prefix/.cuda-env-stamp"
  mv "$prefix/site.tmp" "$prefix/site"

  # 2. CUDA_PATH-like root of symlinks
  mkdir -p "$root/lib64/stubs" "$root/targets/x86_64-linux"
  ln -sfn "$cu13/bin" "$root/bin"
  ln -sfn "$cu13/include" "$root/include"
  ln -sfn "$cu13/nvvm" "$root/nvvm"
  ln -sfn lib64 "$root/lib"
  ln -sfn ../../include "$root/targets/x86_64-linux/include"
  ln -sfn ../../lib64 "$root/targets/x86_64-linux/lib"
  local f base
  for f in "$cu13"/lib/*.so.* "$cu13"/lib/*.a; do
    [[ -e "$f" ]] || continue
    base="$(basename "$f")"
    ln -sfn "$f" "$root/lib64/$base"
    case "$base" in
      *.so.*) ln -sfn "$base" "$root/lib64/${base%%.so.*}.so" ;;   # libcublas.so -> libcublas.so.13
    esac
  done

  # 3. libcuda stub (the wheels ship no libcuda): every CUresult-returning driver entry point of
  #    cuda.h, in all its #define'd spellings (_v2/_v3, _ptds/_ptsz) plus the legacy names.
  local tmp; tmp="$(mktemp -d)"
  _names() {
    printf '#include <cuda.h>\n' | gcc -E -P -x c "$@" -I"$cu13/include" - | tr -s ' \t\n' ' ' |
      grep -oE '\bCUresult (CUDAAPI )?cu[A-Za-z0-9_]+ ?\(' | sed -E 's/^CUresult (CUDAAPI )?//; s/ ?\($//'
  }
  _names > "$tmp/n1"
  _names -DCUDA_API_PER_THREAD_DEFAULT_STREAM=1 > "$tmp/n2"
  grep -ohE 'CUDAAPI cu[A-Za-z0-9_]+ ?\(' "$cu13/include/cuda.h" | sed -E 's/^CUDAAPI //; s/ ?\($//' > "$tmp/n3"
  printf '%s\n' cuProfilerInitialize cuProfilerStart cuProfilerStop > "$tmp/n4"   # cudaProfiler.h is not shipped
  sort -u "$tmp"/n[1-4] > "$tmp/names.txt"
  [[ $(wc -l < "$tmp/n1") -gt 400 && $(wc -l < "$tmp/names.txt") -gt 400 ]] \
    || { echo "cuda-toolkit: stub symbol extraction failed (see $tmp)" >&2; exit 1; }
  awk '{printf "int %s(void) { return 100; /* CUDA_ERROR_NO_DEVICE */ }\n", $1}' "$tmp/names.txt" > "$tmp/libcuda_stub.c"
  gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$root/lib64/stubs/libcuda.so.1" "$tmp/libcuda_stub.c"
  ln -sfn libcuda.so.1 "$root/lib64/stubs/libcuda.so"
  cp "$tmp/names.txt" "$root/lib64/stubs/libcuda.symbols.txt"
  rm -rf "$tmp"

  "$root/bin/nvcc" --version | grep -q 'release 13.0' \
    || { echo "cuda-toolkit: $root/bin/nvcc is not CUDA 13.0" >&2; exit 1; }
  printf '%s' "$want" > "$prefix/.cuda-env-stamp"   # last: only a complete install is stamped
}

_cuda_tk_self="$(readlink -f "${BASH_SOURCE[0]}")"
if [[ "${BASH_SOURCE[0]}" == "$0" && "${1:-}" == "--install" ]]; then
  shift; _cuda_tk_install "$@"; exit 0
fi

# True if $1 holds a complete install of exactly the package set $2.
_cuda_tk_ready() {
  [[ -x "$1/cuda/bin/nvcc" && -e "$1/cuda/lib64/stubs/libcuda.so" \
     && "$(cat "$1/.cuda-env-stamp" 2>/dev/null)" == "$2" ]]
}

_cuda_tk_main() {
  local py="${PYTHON:-python3}"
  # Pinned to CUDA 13.0 (driver 580 / CUDA 13.0 on the GPU machine). nvcc 13.1+ would emit
  # PTX ISA > 9.0, which a 13.0 driver cannot JIT (CUDA_ERROR_UNSUPPORTED_PTX_VERSION).
  local pkgs=(
    nvidia-cuda-nvcc==13.0.88     # nvcc, ptxas, fatbinary, nvlink, cudafe++, bin2c
    nvidia-nvvm==13.0.88          # nvvm/bin/cicc + libdevice (nvcc needs it; not in nvcc wheel)
    nvidia-cuda-crt==13.0.88      # include/crt/*.h (host_config.h, math_functions.h ...)
    nvidia-cuda-runtime==13.0.96  # cuda.h, cuda_runtime*.h, cuda_fp16/bf16/fp8.h, libcudart.so.13
    nvidia-cuda-cccl==13.0.85     # include/cccl (cub/thrust/libcu++), include/nv/target
    nvidia-cublas==13.0.0.19      # cublas*.h, libcublas.so.13, libcublasLt.so.13 (419 MB wheel)
    nvidia-curand==10.4.0.35      # curand*.h, libcurand.so.10
    nvidia-cuda-nvrtc==13.0.48    # nvrtc.h, libnvrtc.so.13
  )
  # Same stamp text as the shared cuda-env.sh, so that an install made by either one is reused.
  local want; want="v2 ${pkgs[*]}"

  local prefix
  if [[ -n "${CUDA_PIP_PREFIX:-}" ]]; then
    prefix="$CUDA_PIP_PREFIX"
  else
    prefix="${HOME:?cuda-toolkit: HOME is not set; set CUDA_PIP_PREFIX}/.cache/candle-offload/cuda-pip-13.0"
    local shared="${CUDA_PIP_SHARED_PREFIX:-/opt/cuda-pip-13.0}"
    if ! _cuda_tk_ready "$prefix" "$want" && _cuda_tk_ready "$shared" "$want"; then
      echo "cuda-toolkit: reusing the identical install in $shared" >&2
      prefix="$shared"
    fi
  fi
  local root="$prefix/cuda"

  if ! _cuda_tk_ready "$prefix" "$want"; then
    echo "cuda-toolkit: installing the CUDA 13.0 build pieces into $prefix (~670 MB download, 1.2 GB installed)" >&2
    # run in a child bash so that `set -e` really applies (it is ignored in a `( ... ) || x` subshell)
    CUDA_TK_PREFIX="$prefix" CUDA_TK_PY="$py" CUDA_TK_WANT="$want" \
      bash "$_cuda_tk_self" --install "${pkgs[@]}" \
      || { echo "cuda-toolkit: install into $prefix FAILED (network? disk space? see above)" >&2; return 1; }
  fi

  CUDA_TK_EXPORTS=(
    "CUDA_ROOT=$root"            # cudarc link search (also CUDA_HOME / CUDA_PATH)
    "CUDA_PATH=$root"
    "CUDA_HOME=$root"            # cudaforge nvcc lookup fallback
    "CUDA_TOOLKIT_ROOT_DIR=$root"
    "NVCC=$root/bin/nvcc"        # cudaforge (candle-kernels build.rs) nvcc lookup
    "CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}"   # required; 90 -> -gencode=arch=compute_90a,code=sm_90a (H100/H200)
    "CUDARC_CUDA_VERSION=13000"  # pin cudarc's API level to 13.0 (= target driver), skips `nvcc --version` parse
    "CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}"  # candle-kernels nvcc jobs; cudaforge default = 50% of cores
    "PATH=$root/bin:$(printf '%s' "$PATH" | tr ':' '\n' | { grep -vxF "$root/bin" || true; } | paste -sd: -)"
    "LIBRARY_PATH=$root/lib64:$root/lib64/stubs$(printf '%s' "${LIBRARY_PATH:-}" | tr ':' '\n' | { grep -vxE "$root/lib64(/stubs)?|" || true; } | sed 's/^/:/' | tr -d '\n')"
  )
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  # sourced: export into the caller's shell (does not touch the caller's `set` options);
  # `source` returns non-zero on failure, so a caller under `set -e` stops there.
  if _cuda_tk_main; then
    for _kv in "${CUDA_TK_EXPORTS[@]}"; do export "${_kv?}"; done
    unset _kv CUDA_TK_EXPORTS
    # To *start* a cuda binary on this GPU-less machine (it will report "no device"):
    #   LD_LIBRARY_PATH=$CUDA_ROOT/lib64:$CUDA_ROOT/lib64/stubs ./target/release/x
  else
    return 1
  fi
else
  set -euo pipefail
  _cuda_tk_main
  for _kv in "${CUDA_TK_EXPORTS[@]}"; do printf 'export %q\n' "$_kv"; done
fi
