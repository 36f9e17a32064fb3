#!/usr/bin/env bash
# One device-machine call: install qllm and its plugins (no network there), then run the
# stages named on the command line, logging each under $OUT (or ./gpu-out).
#   bash benchmarks/gpu_run.sh gpu-tests w1 profile-w1 kernel-tests
# Stages (each killed after its time limit, so one hang does not cost the call):
#   gpu-tests: Qwen3 and Qwen3.5 model tests on CUDA (prefill-graph-tests: the prefill
#   CUDA-graph ones alone); kernel-tests: kernel parity tests
#   (moe-tests: the MoE ones alone, stopping at the first failure; quick-kernel-tests: the MoE
#   align, parity, table-entry, forced-config, graph and compile cases, the GDN conv, q/k L2 norm,
#   prefill, decode (alone and with the gated norm), gated-norm and compile cases and the q/k
#   norm + RoPE cases (alone and storing K/V), which fit a
#   short call where the whole kernel-tests stage does not; linear-tests: the
#   linear (GEMV) plugin's tests);
#   kernels: kernel micro-benchmarks; bandwidth: the HBM read bandwidth reached by access
#   pattern (bench_bandwidth.py: the rooflines' ceiling); bench-linear: the GEMV's
#   launch-config sweep at the Qwen3.5-35B-A3B projection shapes (JSON lines, best config
#   per shape and row count; bench-linear-1: at W3's one row only); gemv-sweep-w3: the sweep
#   at one row written to the GEMV's table for this GPU (kernels_linear's swept_gemv.json, also
#   copied to $OUT), then W3 with the rule's configs and with the table's (QLLM_GEMV_SWEPT),
#   each with its decode-step profile ($OUT/w3-gemv-swept-0, -1);
#   bench-linear-200: those shapes at W2's 200 rows, cuBLAS against Inductor's max-autotune
#   GEMM (whether a Triton GEMM can beat cuBLAS there);
#   pdl: programmatic dependent launch (QLLM_PDL, qllm/plugins/pdl.py) of the decode path's
#   kernels: bench_pdl.py (a 40-layer decode step's GEMV chain in a CUDA graph, PDL off, on,
#   cuBLAS; then with --chain gemv, the GEMVs alone, every kernel PDL-launched), then the PDL
#   tests (bits equal to PDL off, CUDA-graph replays, the SASS; with the slot MoE's and the GDN
#   decode's parity; pdl-tests: these alone); PDL is on in steps of at most
#   16 rows unless QLLM_PDL=0 in the environment (the end-to-end measure:
#   QLLM_PDL=0 bash benchmarks/gpu_run.sh w3, against a plain w3 in the same call);
#   pdl-launch: when a PDL-launched kernel starts against the releases of the one before
#   (bench_pdl_launch.py: why W3's slot down starts only as the gate-up ends), and where
#   the profiler puts that start;
#   bench-int8: the 8-bit kernels against bf16 at those shapes (1 and 200 rows) and the MoE
#   (1 and 4 tokens), JSON lines, then decode_step lines (W3's dense + MoE time per format);
#   bench-int8-sweep: the 8-bit GEMV's launch-config sweep at one row (best per shape);
#   bench-int8-sweep-rows: the same at 2 and 4 rows (decode batches the GEMV also serves);
#   bench-int8-sweep-moe: the same for the MoE slot path's two GEMMs at 1 and 4 tokens;
#   bench-int8-sweep-sorted: the tiles of the int8 MoE's sorted path (the op's from 5 tokens,
#   its table in qllm_kernels_int8/configs/int8/) at W2's 200 tokens and a 16,384-token prefill
#   step: per GEMM the five fastest and the table's, then the whole op at the best against the
#   table's tiles and bf16 (3 JSON lines per token count; about 3 minutes of sweeping);
#   bench-int8-sweep-sorted-full: the same at 200 tokens over kernels_moe's full grid (8 warps,
#   BLOCK_K 256, 2-5 stages; about 3.5 minutes);
#   bench-fp8-sweep-sorted: the same on the fp8 (W8A8, 128x128 block scales) sorted path
#   (bench_int8.py --format fp8: BLOCK_K within the scale block, BLOCK_M 32 and 64 beside the
#   bf16 table's 16 at 200 tokens, 64 beside its 128 at 16,384; against the fp8 rule, bf16
#   and the int8 op; about 5.5 minutes of sweeping); sass-moe: no GPU, the sorted MoE's
#   grouped GEMM (int8, fp8) compiled for sm_90 by the image's Triton at the table configs
#   and at BLOCK_M 32 / 64 / 128 (sass_moe.py: MMA kind, registers, spills, K loop, MMAs in
#   flight at its waits; JSON lines, the last a one-line summary);
#   bench-int8-gemm: the dense 8-bit kernels against bf16 at 16, 64, 200 and 512 rows (the two
#   W8A16 GEMMs, shared-B and swap-AB, side by side); bench-int8-sweep-gemm: the swap-AB
#   GEMM's launch-config sweep at 200 rows (best per shape, the rule's, the shared-B GEMM's,
#   cuBLAS's); bench-int8-sweep-gemm-more: the same at 16, 64 and 512 rows;
#   QLLM_INT8_GEMM=shared_b (or swap_ab) in the environment runs the int8 stages (w2-int8
#   included) on that W8A16 GEMM at every row count (default auto: plugins/kernels_int8 ops.py);
#   w1, w2, w3: throughput.py, then a decode-step profile
#   on the same engine (W1 batch 256 x 1,100, W2 200 x 2,000, W3 1 x 512; files in $OUT);
#   w3-slot-tiles: W3 (with its profile) once per trial of the slot MoE's one-token entry in
#   $SLOT_TILES (default "up=2,2048,4,1 up=1,2048,2,1"; a trial is GEMM=BLOCK_N,BLOCK_K,
#   num_warps,num_stages, persistent=PER_SM or prefetch=1, several joined by +, set by
#   bench_moe.py --set-entry), logs in
#   $OUT/w3-slot-<trial>, the table restored after each; run w3 in the same call for the
#   shipped entry;
#   w3-gemv-tiles: W3 (with its profile) once per trial of one-row GEMV configs in
#   $GEMV_TILES (default "out_proj=4,2048,4,1 out_proj=4,4096,8,1": the rule before
#   a4ba911 and whole K on 8 warps; a trial is SHAPE=BLOCK_N,BLOCK_K,num_warps,num_stages, or
#   several joined by +, written to this GPU's table by bench_linear.py --set-config and
#   taken unless QLLM_GEMV_SWEPT=0), logs in $OUT/w3-gemv-<trial>, the table restored after
#   each; run w3 in the same call for the rule's configs;
#   w3-cublas: W3 with the projections on cuBLAS (the linear op pinned to torch), the GEMV's
#   baseline; w3-autotune: the same with Inductor's GEMM autotuning in the decode layers;
#   w1-sampling-torch: W1 with its draws on the plain-torch sample_tokens (the kernel's baseline);
#   sampling-tests: the sampling kernel's tests (CUDA ones included);
#   w1-peer, w2-peer, w3-peer:
#   transformers on the same workload; w1-sync: W1 without async scheduling; w1-logprobs:
#   W1 with the top-5 log-probs of every token; bench-logprobs: the per-step cost of
#   log-probs and penalties at batch 256 (test_bench_logprobs.py); w2, w3 and
#   their profiles keep the GDN state in bf16, as vLLM's anchors do (WORKLOADS.md), and
#   w2-fp32-state runs W2 with the fp32 default; w2-256: W2 at max_num_seqs=256 and
#   max_model_len=4096 (the outside harness's settings); w2-int8, w2-fp8, w3-int8, w3-fp8:
#   W2 / W3 with 8-bit weights (qllm-kernels-int8; w2-int8-experts, w2-fp8-experts: on the
#   experts alone; w3-int8 and w3-fp8 profile their decode step into $OUT/w3-int8, -fp8);
#   startup-w2-cold: W2's start-up alone, twice, each on an emptied compile cache
#   (QLLM_CACHE_DIR=/tmp/qllm-startup-N): autotuned kernels' configs compiled one by one
#   (QLLM_PARALLEL_AUTOTUNE=0), then in parallel (the default); STARTUP_MODES=1 runs only the
#   default; the start-up lines say what Triton compiled; fla-configs-w2: W2's start-up with
#   fla's kernels autotuned, then the configs they picked, packed as $OUT/fla_configs.tgz
#   (fla_configs/<GPU name>/*.json: unpack it into plugins/kernels_gdn/qllm_kernels_gdn/ to
#   ship it; one file, as the call returns few; on the device,
#   fla-configs-ship does, for the stages after it);
#   startup-w2-fla-configs: W2's start-up on an emptied cache without, then with, the fla
#   configs shipped for this GPU (QLLM_FLA_CONFIGS=0, 1; FLA_MODES=1 runs only the latter);
#   startup-w2-ahead: the same without, then with, the graph buckets' Triton kernels compiled
#   ahead in threads (QLLM_COMPILE_AHEAD=0, 1; AHEAD_MODES picks); core-gpu-tests: the tests
#   of compiling ahead (with the tiny hybrid model's, which gpu-tests leaves out), parallel
#   autotuning, the start-up's autotune report and the shipped fla configs;
#   w2-no-prefix-cache: W2 with the hybrid prefix cache off (0 state checkpoints; on by
#   default, as in w2); prefix-cache:
#   prefix_cache.py (64 requests sharing a 4,000-token prompt, cache off then on);
#   prefix-cache-branch: the cache-on half with two system prompts, one pass each (is the
#   first branch step's cost one-time?);
#   prefix-cache-tests: the hybrid prefix cache's CUDA test (cache on vs off, fp32, a
#   checkpoint saved in a 608-token round through fla);
#   int8-tests: that plugin's kernel, accuracy and weight-format tests; config-tests: the Qwen3.5 config variants (a shared
#   expert of another size) on CUDA; profile-w1/w2/w3,
#   profile-w1-small: W1's decode step at 16 and 64 sequences of 1,500 tokens (the run's
#   tail; profile_step.py, files in $OUT/w1-b16, -b64);
#   profile-w1-prefill, profile-w2-prefill: profile_step.py;
#   profile-w3-prefill: W3's 512-token prompt from admission to its first token, through
#   the prefill graph and then eagerly (profile_step.py --phase prefill);
#   ncu-gdn: Nsight Compute counters of the GDN decode kernel at batch 200 (bf16 state in
#   consecutive slots, as in W2; the sweep's first config, the default 16 x 1 warp);
#   decode-modes-w1, decode-modes-w2, decode-modes-w3: decode_modes.py, today's decode
#   (regional compile, the engine's CUDA graphs) against whole-model
#   torch.compile(mode="reduce-overhead") on one engine (W1 256 x 1,100, W2 200 x 2,000,
#   W3 1 x 512; W2 and W3 with the bf16 state), a run on an emptied compile cache
#   (/tmp/qllm-decode-modes-wN) and then one on the cache it filled; decode-modes-wN-cold
#   and -warm run one of the two alone, with a longer limit (W2's pair may not fit one call:
#   run -warm in the next call, while the machine is still held, or it finds the cache cold);
#   state-dtype: bf16 vs fp32 recurrent state at the real geometry (variant_accuracy.py, 4
#   layers); accuracy-int8, accuracy-fp8: 8-bit weights vs bf16 the same way; accuracy-bf16:
#   bf16 vs fp32 the same way (the scale to read the others against); tune-moe: quick MoE
#   block-size sweep for the token counts in $TUNE_TOKENS (default "1 256") over the BLOCK_M
#   values in $TUNE_BLOCK_M (default all; 1 is the small-batch path) over the tile grid
#   $TUNE_GRID (default quick; decode: the weight-streaming tiles), the rewritten table
#   copied to $OUT.
# base, head: switch the tree to the base side of a comparison prepared by
#   `bash benchmarks/ab_base.sh prepare REV` (carry .ab-base), or back to the change; the
#   stages after each switch log under $OUT/base-N or $OUT/head-N (N counts the switches),
#   so `w3 base w3 head w3` measures the change, its base and the change again in one call;
#   base:DIR and head:DIR do the same with a base prepared into DIR (`prepare REV DIR`;
#   go back to head before another base: `base:.ab-a w3 head:.ab-a base w3 head w3`).
# Wheels in .whl/ (fla-core...) are installed first when present, into /tmp/site on this
# script's PYTHONPATH: a command run after this script, outside it, needs
# PYTHONPATH=/tmp/site too, or it runs without fla (session 14's last W2 did).
# A call brings back at most 8 files of $OUT (the device tool's limit), so at the end the stages'
# logs and profiles leave in one archive, $OUT/gpu_run.tgz (gpu_run-2.tgz for a second run into
# the same $OUT; `tar xzf` it here), the files it holds removed; what the caller put in $OUT
# before this script ran stays beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
root_out=${OUT:-gpu-out}
out=$root_out
switches=0
mkdir -p "$out"
callers_files=" $(ls -A "$root_out" | tr '\n' ' ') "
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/qwen3 \
    -e plugins/qwen3_5 -e plugins/kernels_attention -e plugins/kernels_moe \
    -e plugins/kernels_gdn -e plugins/kernels_linear -e plugins/kernels_int8 \
    -e plugins/kernels_sampling > "$out/install.log" 2>&1 \
    || { tail "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$out/gpu.txt"
# Tests print their reports as they go (-s), and a test past 150 s (300 s for the model tests,
# whose first case builds the real-geometry checkpoint) fails alone (pytest-timeout, on the
# GPU image) so that the summary still comes back.
PYTEST_GPU="-v -s --tb=short -p no:cacheprovider --timeout 150 --durations 0"
run() {  # run NAME SECONDS COMMAND...: log to $out/NAME.log, print the last lines
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    echo "exit $? ($name, $((SECONDS - start)) s)"
    tr '\r' '\n' < "$out/$name.log" | grep -vE "graph/s|req/s|it/s" | tail -${TAIL:-8}
}
w3_profiled() {  # w3_profiled NAME DIR [OPTION...]: W3 (one sequence, the bf16 GDN state),
    local name=$1 dir=$2; shift 2  # then its decode-step profile into DIR
    mkdir -p "$dir"
    run "$name" 200 python3 benchmarks/throughput.py --workload w3 --max-num-seqs 1 \
        --max-model-len 1024 --recurrent-state-dtype bfloat16 "$@" \
        --profile-decode 1 512 --profile-out "$dir"
}
moe_table=plugins/kernels_moe/qllm_kernels_moe/configs/E=256,N=1024,K=2048.json
gemv_table=plugins/kernels_linear/qllm_kernels_linear/swept_gemv.json
w3_table_trials() {  # w3_table_trials TABLE NAME FILE "TRIAL ..." SETTER...: per trial, SETTER
    # with the trial's fields (joined by +) writes them into TABLE (its output in FILE), then W3
    # and its profile into $out/w3-NAME-<trial>; TABLE is put back as it was (absent: removed)
    # after each
    local table=$1 name=$2 file=$3 trials=$4 kept=/tmp/table-kept.json stage_out=$out trial
    shift 4
    rm -f "$kept"; [[ -f $table ]] && cp "$table" "$kept"
    for trial in $trials; do
        out=$stage_out/w3-$name-${trial//[=,+]/-}
        mkdir -p "$out"
        "$@" ${trial//+/ } > "$out/$file" || break
        w3_profiled w3 "$out"
        rm -f "$table"; [[ -f $kept ]] && cp "$kept" "$table"
    done
    out=$stage_out
}
pdl_tests() {  # every plugin's PDL tests (bits in CUDA graphs against PDL off; the SASS
    # checks run in CI, on the CPU), the slot MoE's and the GDN decode's parity
    run pdl_tests 300 python3 -m pytest $PYTEST_GPU \
        -k "(pdl or slot or decode_parity) and not interpreted and not sass" tests/test_pdl.py \
        plugins/kernels_linear/tests/test_kernels_linear.py \
        plugins/kernels_gdn/tests/test_kernels_gdn.py \
        plugins/kernels_moe/tests/test_kernels_moe.py \
        plugins/kernels_attention/tests/test_kernels_attention.py \
        plugins/kernels_int8/tests/test_kernels_int8.py
}
for stage in "$@"; do
    case $stage in
        gpu-tests) run gpu_tests 480 python3 -m pytest $PYTEST_GPU --timeout 300 \
                       -k "not compiling_ahead" plugins/qwen3_5/tests/test_gpu_qwen3_5.py \
                       plugins/qwen3/tests/test_gpu_qwen3.py ;;
        prefill-graph-tests) run prefill_graph_tests 300 python3 -m pytest $PYTEST_GPU \
                                 -k "prefill" plugins/qwen3_5/tests/test_gpu_qwen3_5.py \
                                 plugins/qwen3/tests/test_gpu_qwen3.py ;;
        kernel-tests) run kernel_tests 300 python3 -m pytest $PYTEST_GPU \
                          plugins/kernels_moe/tests/test_kernels_moe.py \
                          plugins/kernels_gdn/tests/test_kernels_gdn.py ;;
        moe-tests) run moe_tests 200 python3 -m pytest $PYTEST_GPU -x \
                       plugins/kernels_moe/tests/test_kernels_moe.py ;;
        quick-kernel-tests) run quick_kernel_tests 300 python3 -m pytest $PYTEST_GPU \
                                plugins/kernels_moe/tests/test_kernels_moe.py \
                                plugins/kernels_gdn/tests/test_kernels_gdn.py \
                                plugins/kernels_attention/tests/test_kernels_attention.py -k \
                                "(triton_align or cuda_graph or compiled or test_parity or every_table or forced or conv_ or gdn_prefill_parity or gdn_decode_parity or gated_norm or rms_norm_gated or l2norm_heads or qk_norm_rope) and not interpreted" ;;
        attention-tests) run attention_tests 300 python3 -m pytest $PYTEST_GPU \
                             plugins/kernels_attention/tests/test_kernels_attention.py ;;
        linear-tests) run linear_tests 300 python3 -m pytest $PYTEST_GPU \
                          plugins/kernels_linear/tests/test_kernels_linear.py ;;
        int8-tests) run int8_tests 300 python3 -m pytest $PYTEST_GPU \
                        plugins/kernels_int8/tests/test_kernels_int8.py \
                        plugins/kernels_int8/tests/test_int8_accuracy.py \
                        tests/test_weight_formats.py ;;
        config-tests) run config_tests 200 python3 -m pytest $PYTEST_GPU \
                          -m cuda plugins/qwen3_5/tests/test_qwen3_5_configs.py ;;
        kernels) run bench_attention 100 python3 plugins/kernels_attention/benchmarks/bench_attention.py
                 run bench_moe 100 python3 plugins/kernels_moe/benchmarks/bench_moe.py
                 run bench_gdn 100 python3 plugins/kernels_gdn/benchmarks/bench_gdn.py
                 run bench_linear 100 python3 plugins/kernels_linear/benchmarks/bench_linear.py
                 run bench_norms 100 python3 benchmarks/bench_norms.py ;;
        bandwidth) TAIL=${TAIL:-30} run bench_bandwidth 200 python3 benchmarks/bench_bandwidth.py ;;
        bench-linear) TAIL=${TAIL:-12} run bench_linear_sweep 480 python3 \
                          plugins/kernels_linear/benchmarks/bench_linear.py --sweep ;;
        bench-linear-1) TAIL=${TAIL:-6} run bench_linear_sweep_1 480 python3 \
                            plugins/kernels_linear/benchmarks/bench_linear.py --sweep --rows 1 ;;
        gemv-sweep-w3) TAIL=${TAIL:-6} run gemv_sweep_write 480 python3 \
                           plugins/kernels_linear/benchmarks/bench_linear.py --sweep --rows 1 \
                           --write-table
                       cp plugins/kernels_linear/qllm_kernels_linear/swept_gemv.json "$out"/
                       for swept in 0 1; do  # the rule's configs, then the sweep's
                           QLLM_GEMV_SWEPT=$swept w3_profiled w3_gemv_swept_$swept \
                               "$out/w3-gemv-swept-$swept"
                       done ;;
        bench-linear-200) TAIL=${TAIL:-14} run bench_linear_200 300 python3 \
                              plugins/kernels_linear/benchmarks/bench_linear.py --rows 200 \
                              --inductor ;;
        pdl) TAIL=${TAIL:-10} run bench_pdl 200 python3 \
                 plugins/kernels_linear/benchmarks/bench_pdl.py
             TAIL=${TAIL:-10} run bench_pdl_gemv 200 python3 \
                 plugins/kernels_linear/benchmarks/bench_pdl.py --chain gemv
             pdl_tests ;;
        pdl-tests) pdl_tests ;;
        pdl-launch) TAIL=${TAIL:-8} run bench_pdl_launch 200 python3 \
                        benchmarks/bench_pdl_launch.py --profile ;;
        bench-int8) TAIL=${TAIL:-12} run bench_int8 300 python3 \
                        plugins/kernels_int8/benchmarks/bench_int8.py ;;
        bench-int8-sweep) TAIL=${TAIL:-6} run bench_int8_sweep 480 python3 \
                              plugins/kernels_int8/benchmarks/bench_int8.py --sweep --parts dense ;;
        bench-int8-sweep-rows) TAIL=${TAIL:-9} run bench_int8_sweep_rows 480 python3 \
                                   plugins/kernels_int8/benchmarks/bench_int8.py --sweep \
                                   --parts dense --rows 2 4 ;;
        bench-int8-sweep-moe) TAIL=${TAIL:-6} run bench_int8_sweep_moe 420 python3 \
                                  plugins/kernels_int8/benchmarks/bench_int8.py --sweep \
                                  --parts moe --moe-tokens 1 4 ;;
        bench-int8-sweep-sorted) TAIL=${TAIL:-8} run bench_int8_sweep_sorted 420 python3 \
                                     plugins/kernels_int8/benchmarks/bench_int8.py --sweep \
                                     --parts moe --moe-tokens 200 16384 ;;
        bench-int8-sweep-sorted-full) TAIL=${TAIL:-4} run bench_int8_sweep_sorted_full 420 \
                                          python3 plugins/kernels_int8/benchmarks/bench_int8.py \
                                          --sweep --parts moe --moe-tokens 200 --grid full \
                                          --block-m 16 ;;
        bench-fp8-sweep-sorted) TAIL=${TAIL:-8} run bench_fp8_sweep_sorted 480 python3 \
                                    plugins/kernels_int8/benchmarks/bench_int8.py --sweep \
                                    --parts moe --moe-tokens 200 16384 --format fp8 ;;
        sass-moe) TAIL=${TAIL:-1} run sass_moe 200 python3 \
                      plugins/kernels_int8/benchmarks/sass_moe.py ;;
        bench-int8-gemm) TAIL=${TAIL:-26} run bench_int8_gemm 300 python3 \
                             plugins/kernels_int8/benchmarks/bench_int8.py --rows 16 64 200 512 \
                             --parts dense ;;
        bench-int8-sweep-gemm) TAIL=${TAIL:-3} run bench_int8_sweep_gemm 420 python3 \
                                   plugins/kernels_int8/benchmarks/bench_int8.py --sweep \
                                   --rows 200 --parts dense ;;
        bench-int8-sweep-gemm-more) TAIL=${TAIL:-9} run bench_int8_sweep_gemm_more 480 python3 \
                                        plugins/kernels_int8/benchmarks/bench_int8.py --sweep \
                                        --rows 16 64 512 --parts dense ;;
        w1) run w1 300 python3 benchmarks/throughput.py --workload w1 \
                --profile-decode 256 1100 --profile-out "$out" ;;
        w1-sampling-torch) run w1_sampling_torch 300 python3 benchmarks/throughput.py \
                               --workload w1 --kernel sample_tokens=torch ;;
        sampling-tests) run sampling_tests 200 python3 -m pytest $PYTEST_GPU \
                            plugins/kernels_sampling/tests tests/test_sampler.py ;;
        w1-peer) run w1_peer 200 python3 benchmarks/throughput.py --workload w1 \
                     --engine transformers --peer-prompts 64 --peer-max-tokens 256 ;;
        w2) run w2 360 python3 benchmarks/throughput.py --workload w2 --max-num-seqs 200 \
                --max-model-len 3072 --recurrent-state-dtype bfloat16 \
                --profile-decode 200 2000 --profile-out "$out" ;;
        fla-configs-w2) QLLM_FLA_CONFIGS=0 run fla_configs_w2 300 python3 \
                            benchmarks/throughput.py --workload w2 --max-num-seqs 200 \
                            --max-model-len 3072 --recurrent-state-dtype bfloat16 \
                            --startup-only --dump-fla-configs /tmp/qllm-fla/fla_configs
                        tar czf "$out/fla_configs.tgz" -C /tmp/qllm-fla fla_configs ;;
        startup-w2-cold) for mode in ${STARTUP_MODES:-0 1}; do  # parallel autotune off, on
                QLLM_PARALLEL_AUTOTUNE=$mode QLLM_CACHE_DIR=/tmp/qllm-startup-$mode \
                    TAIL=2 run startup_w2_cold_parallel_$mode 300 python3 \
                    benchmarks/throughput.py --workload w2 --max-num-seqs 200 \
                    --max-model-len 3072 --recurrent-state-dtype bfloat16 --startup-only
            done ;;
        startup-w2-ahead) for mode in ${AHEAD_MODES:-0 1}; do  # capture compiling as it goes, ahead
                QLLM_COMPILE_AHEAD=$mode QLLM_CACHE_DIR=/tmp/qllm-startup-ahead-$mode \
                    TAIL=2 run startup_w2_ahead_$mode 300 python3 \
                    benchmarks/throughput.py --workload w2 --max-num-seqs 200 \
                    --max-model-len 3072 --recurrent-state-dtype bfloat16 --startup-only
            done ;;
        core-gpu-tests) run core_gpu_tests 300 python3 -m pytest $PYTEST_GPU \
                            tests/test_triton_precompile.py tests/test_compile_ahead.py \
                            tests/test_parallel_autotune.py tests/test_autotune_log.py \
                            plugins/kernels_gdn/tests/test_fla_configs.py \
                            plugins/qwen3_5/tests/test_gpu_qwen3_5.py -k \
                            "not test_gpu_qwen3_5 or compiling_ahead" ;;
        fla-configs-ship) shipped=plugins/kernels_gdn/qllm_kernels_gdn/fla_configs
                          mkdir -p "$shipped" && cp -r /tmp/qllm-fla/fla_configs/* "$shipped"/ \
                              && ls "$shipped"/* ;;
        startup-w2-fla-configs) for mode in ${FLA_MODES:-0 1}; do  # fla autotuned, shipped
                QLLM_FLA_CONFIGS=$mode QLLM_CACHE_DIR=/tmp/qllm-startup-fla-$mode \
                    TAIL=2 run startup_w2_fla_configs_$mode 300 python3 \
                    benchmarks/throughput.py --workload w2 --max-num-seqs 200 \
                    --max-model-len 3072 --recurrent-state-dtype bfloat16 --startup-only
            done ;;
        w2-256) run w2_256 300 python3 benchmarks/throughput.py --workload w2 --max-num-seqs 256 \
                    --max-model-len 4096 --recurrent-state-dtype bfloat16 ;;
        w2-int8|w2-int8-experts|w2-fp8|w2-fp8-experts) run "${stage/-/_}" 360 python3 benchmarks/throughput.py --workload w2 \
                            --max-num-seqs 200 --max-model-len 3072 --recurrent-state-dtype \
                            bfloat16 --quantization "${stage#w2-}" ;;
        w3-int8|w3-fp8) w3_profiled "${stage/-/_}" "$out/$stage" \
                            --quantization "${stage#w3-}" ;;
        w2-no-prefix-cache) run w2_no_prefix_cache 300 python3 benchmarks/throughput.py --workload w2 \
                             --max-num-seqs 200 --max-model-len 3072 --recurrent-state-dtype \
                             bfloat16 --prefix-state-cache-slots 0 ;;
        prefix-cache) run prefix_cache 300 python3 benchmarks/prefix_cache.py ;;
        prefix-cache-branch) run prefix_cache_branch 200 python3 benchmarks/prefix_cache.py \
                                 --modes on --passes 1 --system-prompts 2 ;;
        prefix-cache-tests) run prefix_cache_tests 200 python3 -m pytest $PYTEST_GPU \
                                tests/test_hybrid_prefix_cache.py -k cuda ;;
        w2-peer) run w2_peer 200 python3 benchmarks/throughput.py --workload w2 \
                     --engine transformers --peer-prompts 32 --peer-batch 32 \
                     --peer-max-tokens 200 ;;
        w1-sync) run w1_sync 240 python3 benchmarks/throughput.py --workload w1 \
                     --sync-scheduling ;;
        w1-logprobs) run w1_logprobs 300 python3 benchmarks/throughput.py --workload w1 \
                         --logprobs 5 ;;
        bench-logprobs) TAIL=${TAIL:-12} run bench_logprobs 200 python3 -m pytest -q \
                            -p no:cacheprovider benchmarks/test_bench_logprobs.py ;;
        w2-fp32-state) run w2_fp32_state 300 python3 benchmarks/throughput.py --workload w2 \
                           --max-num-seqs 200 --max-model-len 3072 ;;
        profile-w3) run profile_w3 150 python3 benchmarks/profile_step.py --workload w3 \
                        --batch 1 --context 512 --recurrent-state-dtype bfloat16 --out "$out" ;;
        tune-moe) run tune_moe 420 python3 plugins/kernels_moe/benchmarks/bench_moe.py --tune \
                      --grid ${TUNE_GRID:-quick} \
                      --tokens ${TUNE_TOKENS:-1 256} --block-m ${TUNE_BLOCK_M:-1 16 32 64 128}
                  cp plugins/kernels_moe/qllm_kernels_moe/configs/*.json "$out"/moe_configs.json ;;
        w3) w3_profiled w3 "$out" ;;
        w3-slot-tiles) w3_table_trials "$moe_table" slot entry.json \
                           "${SLOT_TILES:-up=2,2048,4,1 up=1,2048,2,1}" \
                           python3 plugins/kernels_moe/benchmarks/bench_moe.py --set-entry 1 ;;
        w3-gemv-tiles) w3_table_trials "$gemv_table" gemv table.json \
                           "${GEMV_TILES:-out_proj=4,2048,4,1 out_proj=4,4096,8,1}" \
                           python3 plugins/kernels_linear/benchmarks/bench_linear.py \
                               --set-config 1 ;;
        w3-cublas) run w3_cublas 200 python3 benchmarks/throughput.py --workload w3 \
                       --max-num-seqs 1 --max-model-len 1024 --recurrent-state-dtype bfloat16 \
                       --kernel linear=torch ;;
        w3-autotune) run w3_autotune 400 python3 benchmarks/throughput.py --workload w3 \
                         --max-num-seqs 1 --max-model-len 1024 --recurrent-state-dtype bfloat16 \
                         --kernel linear=torch --max-autotune-gemm \
                         --profile-decode 1 512 --profile-out "$out" ;;
        w3-peer) run w3_peer 150 python3 benchmarks/throughput.py --workload w3 \
                     --engine transformers --peer-batch 1 --peer-max-tokens 64 ;;
        profile-w3-prefill) run profile_w3_prefill 150 python3 benchmarks/profile_step.py \
                                --workload w3 --batch 1 --context 512 --phase prefill \
                                --recurrent-state-dtype bfloat16 --out "$out"
                            run profile_w3_prefill_eager 150 python3 benchmarks/profile_step.py \
                                --workload w3 --batch 1 --context 512 --phase prefill \
                                --recurrent-state-dtype bfloat16 --no-prefill-graphs \
                                --out "$out/eager" ;;
        profile-w1) run profile_w1 150 python3 benchmarks/profile_step.py --workload w1 \
                        --batch 256 --context 1100 --out "$out" ;;
        profile-w1-small) for batch in 16 64; do  # the tail of W1's run: few sequences
                              run profile_w1_b$batch 150 python3 benchmarks/profile_step.py \
                                  --workload w1 --batch $batch --context 1500 \
                                  --out "$out/w1-b$batch"
                          done ;;
        profile-w1-prefill) run profile_w1_prefill 150 python3 benchmarks/profile_step.py \
                                --workload w1 --batch 128 --context 1024 --phase prefill \
                                --steps 4 --out "$out" ;;
        profile-w2) run profile_w2 200 python3 benchmarks/profile_step.py --workload w2 \
                        --batch 200 --context 2000 --recurrent-state-dtype bfloat16 \
                        --out "$out" ;;
        profile-w2-prefill) run profile_w2_prefill 200 python3 benchmarks/profile_step.py \
                                --workload w2 --batch 200 --context 1000 --phase prefill \
                                --steps 4 --out "$out" ;;
        ncu-gdn) run ncu_gdn 200 ncu --clock-control none -k regex:_gated_delta_rule_kernel \
                     --launch-skip 3 --launch-count 1 --section SpeedOfLight \
                     --section MemoryWorkloadAnalysis --section Occupancy \
                     --section WarpStateStats --section SchedulerStats \
                     python3 plugins/kernels_gdn/benchmarks/bench_gdn.py --sweep-decode \
                     --batches 200 \
                     --ssm-dtype bfloat16 --slots consecutive ;;
        decode-modes-w[123]|decode-modes-w[123]-cold|decode-modes-w[123]-warm)
            workload=${stage:13:2} half=${stage:15} cache=/tmp/qllm-decode-modes-$workload
            case $workload in
                w1) shape="--batch 256 --context 1100" ;;
                w2) shape="--batch 200 --context 2000 --recurrent-state-dtype bfloat16" ;;
                w3) shape="--batch 1 --context 512 --recurrent-state-dtype bfloat16" ;;
            esac
            if [ -z "$half" ]; then cold=330 warm=230; else cold=560 warm=560; fi
            if [ "$half" != "-warm" ]; then
                rm -rf "$cache"
                TAIL=${TAIL:-12} run "decode_modes_${workload}_cold" $cold env \
                    QLLM_CACHE_DIR="$cache" TORCH_LOGS=cudagraphs \
                    python3 benchmarks/decode_modes.py --workload $workload $shape
            fi
            if [ "$half" != "-cold" ]; then
                TAIL=${TAIL:-12} run "decode_modes_${workload}_warm" $warm env \
                    QLLM_CACHE_DIR="$cache" TORCH_LOGS=cudagraphs \
                    python3 benchmarks/decode_modes.py --workload $workload $shape
            fi ;;
        state-dtype) run state_dtype 200 python3 benchmarks/variant_accuracy.py \
                         --device cuda --dtype bfloat16 --real-geometry-layers 4 ;;
        accuracy-int8|accuracy-fp8|accuracy-bf16) run "${stage/-/_}" 300 python3 \
                         benchmarks/variant_accuracy.py --variant "${stage#accuracy-}" \
                         --device cuda --dtype bfloat16 --real-geometry-layers 4 ;;
        base|head|base:*|head:*) switches=$((switches + 1))
                   side=${stage%%:*}
                   out=$root_out/$side-$switches
                   mkdir -p "$out"
                   bash benchmarks/ab_base.sh swap "$side" $([ "$side" = "$stage" ] \
                       || echo "${stage#*:}") || exit 1 ;;
        *) echo "unknown stage $stage" ;;
    esac
done
written=()
for name in $(ls -A "$root_out"); do
    [[ $callers_files == *" $name "* ]] || written+=("$name")
done
archive=gpu_run.tgz runs=1  # a second run into the same $OUT: gpu_run-2.tgz
while [[ -e $root_out/$archive ]]; do runs=$((runs + 1)) archive=gpu_run-$runs.tgz; done
if ((${#written[@]})); then
    tar czf "$root_out/$archive" -C "$root_out" "${written[@]}" \
        && (cd "$root_out" && rm -rf "${written[@]}") \
        && echo "outputs: $root_out/$archive (${written[*]})"
fi
