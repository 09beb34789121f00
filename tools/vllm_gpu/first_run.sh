#!/usr/bin/env bash
# One device call: the bundle's smoke check, then the vLLM suite and the GPU tests, each bounded,
# results under $OUT. Run from the repository root on the GPU machine:
#   bash tools/vllm_gpu/first_run.sh PARTS_DIR EXTRA_DIR
source "$(dirname "$0")/device_session.sh" "$1" "$2" || exit 3
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -1
timeout "${SMOKE_S:-200}" python3 tools/vllm_gpu/smoke.py --tokenizer /tmp/smol-tok --inproc > "$OUT/smoke.log" 2>&1
echo "smoke rc=$?"
grep -E "stage .* (OK|FAILED)|bs=|missing modules" "$OUT/smoke.log" | cut -c1-240
run_tests() {  # name, seconds, pytest arguments...
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m pytest "$@" -p no:cacheprovider -q -rs --timeout 170 --junitxml="$OUT/$name.xml" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; tail -25 "$OUT/$name.log" | cut -c1-300
}
run_tests gpu-tests "${GPU_S:-150}" tests/gpu/test_vllm_gpu.py
run_tests vllm-suite "${SUITE_S:-160}" tests/vllm --ignore=tests/vllm/test_vllm_ray.py
