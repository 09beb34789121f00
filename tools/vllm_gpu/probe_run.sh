#!/usr/bin/env bash
# One device call to find where a sleeping vLLM engine stalls: tools/vllm_gpu/sleep_probe.py in the
# set-ups named (each under its watchdog), then the pytest node ids given, verbose, with vLLM's INFO
# log. Logs under $OUT. From the repository root on the GPU machine:
#   PROBES="own-sleep:--compile own:--compile" bash tools/vllm_gpu/probe_run.sh PARTS EXTRA [NODE ...]
START=$SECONDS
source "$(dirname "$0")/device_session.sh" "$1" "$2" || exit 3
shift 2
export VLLM_LOGGING_LEVEL=INFO PYTHONFAULTHANDLER=1
n=0
for probe in ${PROBES:-own-sleep:--compile}; do
  n=$((n + 1)); setup=${probe%%:*}; flags=${probe#*:}; [ "$flags" = "$probe" ] && flags=
  timeout "${PROBE_S:-230}" python3 tools/vllm_gpu/sleep_probe.py "$setup" $flags --after "${WATCH_S:-200}" \
    > "$OUT/probe-$n-$setup.log" 2>&1
  echo "probe $setup $flags rc=$? after $((SECONDS - START)) s"
  grep -E "sleep-probe|Error|error|Traceback|File \"" "$OUT/probe-$n-$setup.log" | grep -v Warning | tail -40 | cut -c1-220
done
if [ $# -gt 0 ]; then
  timeout "${TESTS_S:-240}" python3 -m pytest "$@" -p no:cacheprovider -v -s -rs --timeout 230 > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after $((SECONDS - START)) s"
  grep -E "PASSED|FAILED|SKIPPED|Error|Timeout|File \"|INFO .*(took|Compil|graph|sleep|wake)" "$OUT/tests.log" | tail -40 | cut -c1-220
fi
