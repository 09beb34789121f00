#!/usr/bin/env bash
# Ray for the lent GPU machine, which has none: the cp312 wheel of the version the CPU runs use,
# trimmed to what k3post's actors need, with jsonschema and its own needs (the only ones of Ray's
# requirements that machine lacks), packed as one xz tarball small enough for one device call
# (the vLLM bundle goes in the next call to the same warm machine).
#   here:  bash tools/vllm_gpu/ray_trim.sh [DIR]          -> DIR/ray-site.tar.xz (default .gpu-ray/, ignored)
#   there: tar -C /tmp -xJf .gpu-ray/ray-site.tar.xz      -> /tmp/ray-site, first on PYTHONPATH
# Cut, each with why it can go: ray/jars (Java workers), the dashboard's web client (the dashboard
# agent each node starts is Python and stays), ray/rllib, data, serve, train, tune, llm, air
# (libraries k3post does not import), and the wheel's tests.
set -euo pipefail
root=$PWD
dir=$root/${1:-.gpu-ray}
version() { "$root/.venv/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
tmp=$(mktemp -d)
"$root/.venv/bin/pip" download -q -d "$tmp/whl" --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "ray==$(version ray)" "jsonschema==$(version jsonschema)" "jsonschema-specifications==$(version jsonschema-specifications)" \
    "referencing==$(version referencing)" "rpds-py==$(version rpds-py)"
mkdir -p "$tmp/ray-site"
for wheel in "$tmp"/whl/*.whl; do (cd "$tmp/ray-site" && unzip -q -o "$wheel"); done
cd "$tmp/ray-site"
rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/data ray/serve ray/train ray/tune ray/llm ray/air ray/tests
find . -name "__pycache__" -prune -exec rm -rf {} +
cd "$tmp"
mkdir -p "$dir"
XZ_OPT="-9 -T2" tar -cJf "$dir/ray-site.tar.xz" ray-site
cd "$root" && rm -rf "$tmp"
du -sh "$dir/ray-site.tar.xz"
