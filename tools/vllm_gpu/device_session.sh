#!/usr/bin/env bash
# Sets up a bare GPU machine for k3post's vLLM work in one go, then runs the command given:
#   source tools/vllm_gpu/device_session.sh PARTS_DIR EXTRA_DIR
# PARTS_DIR holds build.sh's dist/ (part.00, SHA256SUMS); EXTRA_DIR the wheels the machine lacks
# (torchao, datasets, dill, multiprocess) and smol-tok.tar.xz (SmolLM2's tokenizer), as
# tools/vllm_gpu/prepare_carry.sh leaves them. Installs vLLM into /tmp/site (skipped when the same
# bundle is already there), the wheels into /tmp/extra, and exports the environment: PYTHONPATH
# puts the bundle first, then the wheels, then the repository.
set -uo pipefail
_parts=${1:?usage: source device_session.sh PARTS_DIR EXTRA_DIR}
_extra=${2:?usage: source device_session.sh PARTS_DIR EXTRA_DIR}
eval "$(bash "$(dirname "${BASH_SOURCE[0]}")/install.sh" "$_parts")" || return 3
if [ ! -f /tmp/extra/.done ] && compgen -G "$_extra/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/extra \
    "$_extra"/*.whl && touch /tmp/extra/.done
fi
if [ -f "$_extra/smol-tok.tar.xz" ] && [ ! -d /tmp/smol-tok ]; then tar -C /tmp -xJf "$_extra/smol-tok.tar.xz"; fi
export PYTHONPATH=/tmp/site:/tmp/extra:$PWD
# Ray, when an earlier call to this machine unpacked tools/vllm_gpu/ray_trim.sh's tarball there
if [ -d /tmp/ray-site ]; then export PYTHONPATH=$PYTHONPATH:/tmp/ray-site; fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
