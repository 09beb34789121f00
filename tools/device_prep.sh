#!/usr/bin/env bash
# Prepares what a GPU benchmark call carries to a bare GPU machine (Python 3.12, torch with CUDA,
# transformers; no pydantic or torchao, no network): the missing wheels in .gpu-wheels/ and SmolLM2's
# tokenizer files in .gpu-tokenizer/ (the bench scripts' --tokenizer). Both paths are ignored by git.
# There: python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl
#        export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
torchao=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torchao"))')
mkdir -p .gpu-wheels
.venv/bin/pip download -q -d .gpu-wheels --only-binary=:all: --python-version 3.12 --no-deps \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    pydantic pydantic-core annotated-types typing-inspection "torchao==$torchao"
.venv/bin/python - <<'PY'
from transformers import AutoTokenizer

from k3post.model.load import converted_gguf_dir, smollm2_gguf_path

AutoTokenizer.from_pretrained(converted_gguf_dir(smollm2_gguf_path())).save_pretrained(".gpu-tokenizer")
PY
du -sh .gpu-wheels .gpu-tokenizer
