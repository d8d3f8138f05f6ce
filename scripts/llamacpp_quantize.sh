#!/usr/bin/env bash
# llamacpp_quantize.sh DIR: a CPU-only llama-quantize from the pinned llama.cpp source, in DIR
# (extracted there from .gpu/llamacpp/llamacpp-src.tar.xz where DIR has no source yet; built where
# DIR/build/bin/llama-quantize is missing). The GPU session scripts' quantization steps run it
# beside llama.cpp's CUDA build, which takes longer.
set -euo pipefail
dir=${1:?usage: llamacpp_quantize.sh DIR}
src=${LLAMACPP_SRC:-.gpu/llamacpp/llamacpp-src.tar.xz}
[[ -d $dir/gguf-py ]] || { mkdir -p "$dir" && tar xJf "$src" -C "$dir" --strip-components=1; }
if [[ ! -x $dir/build/bin/llama-quantize ]]; then
  cmake -S "$dir" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF > "$dir.cmake.log" 2>&1
  cmake --build "$dir/build" -j "$(nproc)" --target llama-quantize > "$dir.build.log" 2>&1
fi
echo "$dir/build/bin/llama-quantize"
