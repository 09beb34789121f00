#!/usr/bin/env bash
# One device call: the GPU tests, the vLLM benchmark, then the vLLM suite in the time left (and
# the bundle's smoke check with SMOKE=1 first), results under $OUT. From the repository root:
#   K3POST_COMMIT=<hash> bash tools/vllm_gpu/first_run.sh PARTS_DIR EXTRA_DIR
# Seconds: GPU_TESTS_S (300), BENCH_S (360), BUDGET_S (570, the whole call); GPU_TESTS_K: a -k filter.
# A cold engine build takes ~40 s in process and ~55 s in a process of its own (torch.compile).
START=$SECONDS
source "$(dirname "$0")/device_session.sh" "$1" "$2" || exit 3
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -1
left() { echo $(( ${BUDGET_S:-570} - (SECONDS - START) )); }
if [ -n "${SMOKE:-}" ]; then
  timeout 200 python3 tools/vllm_gpu/smoke.py --tokenizer /tmp/smol-tok --inproc > "$OUT/smoke.log" 2>&1
  echo "smoke rc=$?"; grep -E "stage .* (OK|FAILED)|bs=" "$OUT/smoke.log" | cut -c1-240
fi
run_tests() {  # name, seconds, pytest arguments...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m pytest "$@" -p no:cacheprovider -q -rs --durations=10 --timeout 290 --junitxml="$OUT/$name.xml" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$? after $((SECONDS - START)) s"; grep -E "passed|failed|FAILED|SKIPPED|Error" "$OUT/$name.log" | tail -12 | cut -c1-300
}
run_tests gpu-tests "${GPU_TESTS_S:-300}" tests/gpu/test_vllm_gpu.py ${GPU_TESTS_K:+-k "$GPU_TESTS_K"}
export K3POST_BENCH_RESULTS=$OUT/results; mkdir -p "$K3POST_BENCH_RESULTS"
timeout "${BENCH_S:-360}" python3 bench/engines/vllm_gpu.py --tokenizer /tmp/smol-tok > "$OUT/vllm_gpu.log" 2>&1
echo "bench rc=$? after $((SECONDS - START)) s"; grep -E "^\||s/GB|sleep|wake|Error|error" "$OUT/vllm_gpu.log" | tail -16 | cut -c1-300
[ "$(left)" -gt 30 ] && run_tests vllm-suite "$(left)" tests/vllm --ignore=tests/vllm/test_vllm_ray.py
