#!/usr/bin/env bash
# Fills the folder a vLLM device call carries beside the bundle (default .gpu-carry/, ignored by
# git) with what the bare GPU machine lacks and k3post's tests and benchmarks there need: torchao
# (QAT), datasets with dill and multiprocess, trl (bench/opd/opd_step_gpu.py --trl), math-verify
# with its parser (the evaluation test's math reward) and gguf (SmolLM2's GGUF, the GPU
# quickstart), as cp312 wheels at the versions the CPU runs use; and SmolLM2's tokenizer files as
# smol-tok.tar.xz (the benchmarks' --tokenizer).
# tools/vllm_gpu/device_session.sh installs them there. From the repository root:
#   bash tools/vllm_gpu/prepare_carry.sh [DIR]
set -euo pipefail
dir=${1:-.gpu-carry}
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p "$dir"
.venv/bin/pip download -q -d "$dir" --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 \
    "torchao==$(version torchao)" "datasets==$(version datasets)" "dill==$(version dill)" \
    "multiprocess==$(version multiprocess)" "trl==1.16.0" "math-verify==$(version math-verify)" \
    "latex2sympy2_extended==$(version latex2sympy2_extended)" \
    "antlr4-python3-runtime==$(version antlr4-python3-runtime)" "gguf==$(version gguf)"
tmp=$(mktemp -d)
.venv/bin/python - "$tmp/smol-tok" <<'PY'
import sys

from transformers import AutoTokenizer

from k3post.model.loading.load import converted_gguf_dir, smollm2_gguf_path

AutoTokenizer.from_pretrained(converted_gguf_dir(smollm2_gguf_path())).save_pretrained(sys.argv[1])
PY
tar -C "$tmp" -cJf "$dir/smol-tok.tar.xz" smol-tok
rm -rf "$tmp"
du -sh "$dir"
