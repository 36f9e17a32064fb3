#!/usr/bin/env bash
# One device-machine call: install qllm and its plugins (no network there), then run the
# stages named on the command line, logging each under $OUT (or ./gpu-out).
#   bash benchmarks/gpu_run.sh tests w1 w1-peer w2 w3 kernels
# Stages: tests (the CUDA tests), kernels (kernel micro-benchmarks), w1, w1-peer
# (transformers on the first 64 W1 prompts), w2, w3. Wheels in .whl/ (fla-core...) are
# installed first when present.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/qwen3 \
    -e plugins/qwen3_5 -e plugins/kernels_attention -e plugins/kernels_moe \
    -e plugins/kernels_gdn > "$out/install.log" 2>&1 || { tail "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$out/gpu.txt"
run() {  # run NAME COMMAND...: log to $out/NAME.log, print the last lines
    local name=$1; shift
    echo "=== $name: $*"
    "$@" > "$out/$name.log" 2>&1
    echo "exit $? ($name)"
    tr '\r' '\n' < "$out/$name.log" | grep -vE "graph/s|req/s|it/s" | tail -6
}
for stage in "$@"; do
    case $stage in
        tests) run tests python3 -m pytest -q -p no:cacheprovider tests/test_gpu_qwen3.py \
                   tests/test_kernels_attention.py tests/test_kernels_moe.py tests/test_kernels_gdn.py ;;
        kernels) run bench_attention python3 benchmarks/bench_attention.py
                 run bench_moe python3 benchmarks/bench_moe.py
                 run bench_gdn python3 benchmarks/bench_gdn.py ;;
        w1) run w1 python3 benchmarks/throughput.py --workload w1 ;;
        w1-peer) run w1_peer python3 benchmarks/throughput.py --workload w1 --engine transformers \
                     --peer-prompts 64 ;;
        w2) run w2 python3 benchmarks/throughput.py --workload w2 --max-num-seqs 200 \
                --max-model-len 3072 ;;
        w3) run w3 python3 benchmarks/throughput.py --workload w3 --max-num-seqs 1 \
                --max-model-len 1024 ;;
        *) echo "unknown stage $stage" ;;
    esac
done
