#!/usr/bin/env bash
# Before a device call: the core's and the plugins' sm_90 SASS tests (their kernels compiled
# for sm_90 on this CPU) under the device image's Triton, 3.6 beside its torch 2.11, where this
# machine has 3.7. A kernel that only the device's Triton rejects then fails here, not in a
# call that costs device time (a668ab7: a jit helper's defaulted constexpr string compiled with
# 3.7, not 3.6).
# The venv sees this one's packages (the editable installs included) and overrides triton.
#   bash benchmarks/sass_device_triton.sh [pytest -k expression, default "sass"]
set -euo pipefail
version=${DEVICE_TRITON:-3.6.0}
venv=${DEVICE_TRITON_VENV:-/tmp/qllm-triton-$version}
if [[ ! -x $venv/bin/python ]]; then
    python -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install -q --no-deps "triton==$version"
fi
cd "$(dirname "$0")/.."
"$venv/bin/python" -c "import triton; print('triton', triton.__version__)"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests plugins/*/tests -k "${1:-sass}"
