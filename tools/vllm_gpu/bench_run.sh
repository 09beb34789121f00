#!/usr/bin/env bash
# One device call of GPU benchmarks with vLLM; results under $OUT/results (copy the rows into
# bench/results/ here). From the repository root on the GPU machine:
#   K3POST_COMMIT=<hash> bash tools/vllm_gpu/bench_run.sh PARTS_DIR EXTRA_DIR WHAT
# WHAT: engines (bench/engines/vllm_gpu.py) or opd (bench/opd/opd_step_gpu.py: HF + TRL, then vLLM in
# sleep mode, batch 32, sync).
source "$(dirname "$0")/device_session.sh" "$1" "$2" || exit 3
export K3POST_BENCH_RESULTS=$OUT/results
mkdir -p "$K3POST_BENCH_RESULTS"
case ${3:-engines} in
  engines)
    timeout 560 python3 bench/engines/vllm_gpu.py --tokenizer /tmp/smol-tok 2>&1 | tee "$OUT/vllm_gpu.log" | grep -v Warning | tail -30 ;;
  opd)  # vLLM first: a failure there still leaves time for the baseline
    timeout "${VLLM_S:-240}" python3 bench/opd/opd_step_gpu.py --tokenizer /tmp/smol-tok --batches 32 --modes sync \
      --steps 3 --warmup 1 --engine vllm --sleep 2>&1 | tee "$OUT/opd_vllm.log" | grep -E "^\||setup|Error" | tail -20
    timeout "${HF_S:-300}" python3 bench/opd/opd_step_gpu.py --tokenizer /tmp/smol-tok --batches 32 --modes sync \
      --steps 3 --warmup 1 --trl 2>&1 | tee "$OUT/opd_hf.log" | grep -E "^\||setup|TRL|trl" | tail -20 ;;
esac
