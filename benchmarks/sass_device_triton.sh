#!/usr/bin/env bash
# Before a device call: the core's and the plugins' sm_90 SASS tests (their kernels compiled
# for sm_90 on this CPU) under the device image's Triton, 3.6 beside its torch 2.11, where this
# machine has 3.7. A kernel that only the device's Triton rejects then fails here, not in a
# call that costs device time (a668ab7: a jit helper's defaulted constexpr string compiled with
# 3.7, not 3.6). .ci/run runs it after the tests.
# That Triton goes into a folder of its own, put first on PYTHONPATH: this Python's packages
# (the editable installs included) stay as they are, in a venv or not.
#   bash benchmarks/sass_device_triton.sh [pytest -k expression, default "sass"]
set -euo pipefail
version=${DEVICE_TRITON:-3.6.0}
target=${DEVICE_TRITON_DIR:-/tmp/qllm-triton-$version}
if [[ ! -f $target/triton/__init__.py ]]; then
    python -m pip install -q --no-deps --target "$target" "triton==$version"
fi
cd "$(dirname "$0")/.."
export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
python -c "import triton; print('triton', triton.__version__)"
exec python -m pytest -q -p no:cacheprovider tests plugins/*/tests -k "${1:-sass}"
