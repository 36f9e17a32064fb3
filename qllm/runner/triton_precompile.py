"""Compile the Triton kernels that some steps will launch all at once, in threads, by running
the steps first with every Triton launch turned into a compile.

On a cold start each specialization of the kernel plugins' kernels (their constants and tile
configs, PDL on or off, integer arguments equal to 1 or divisible by 16) compiles at its first
launch, one after another in the launching thread. Capturing W2's decode graphs (28 batch
sizes) meets 48 of them, 10.4 s of compiling for sm_90 on a 2-core CPU, W3's 13
(``benchmarks/graph_specializations.py``, 2026-12-05), before the prefill buckets'. Within
``compile_launches``, ``JITFunction.run`` takes its compile-only form (``warmup=True``) under
Triton's ``AsyncCompileMode``: the first launch of a kernel variant submits its compile to a
thread pool and returns at once, and no kernel runs. An autotuned kernel compiles all its
configs and tunes none (its benchmark would time launches that do not happen; it tunes at its
first real run), or, for a key already tuned or pinned (fla's shipped configs), that key's
config alone. When the block ends every submitted compile has finished; one that failed is
left for the real launch to report. (``qllm.testing.benchmarking.compile_ahead`` compiles a
sweep's candidates the same way.)

The block's Triton kernels compute nothing, so their outputs hold whatever their memory held.
Only steps whose results are thrown away may run in it, and only where the other ops take any
values from those outputs: the decode and prefill steps, whose Triton kernels' integer outputs
(the MoE router's expert ids, the align's slot lists) are read by Triton kernels alone, so a
torch op never indexes with them, and whose sampled tokens, argmaxes of unwritten logits, are
valid ids whatever the logits hold, as long as every op runs a plugin's kernel
(``compile_ahead_enabled``). A single-process engine on CUDA runs two such passes unless
``QLLM_COMPILE_AHEAD=0``: every graph bucket's step before the capture
(``ModelRunner.compile_graph_kernels``), and its whole warm-up (dummy prompts served, eager
prefill steps of every size) before the warm-up itself. W2's cold start-up on the H200 took
67.2 s with them against 85.2 s without (2026-12-05, ``gpu_run.sh startup-w2-ahead``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from qllm.runner.parallel_autotune import tuning_key, untuned
from qllm.switches import env_switch

SWITCH_ENV = "QLLM_COMPILE_AHEAD"  # "0": capture and warm-up compile as they go, one by one
# Ops whose plain-torch reference reads no device value on the host, so they may run in the
# block: the token draws read only the logits (a token drawn from unwritten ones is still an id)
HOST_FREE_REFERENCES = frozenset({"sample_tokens"})

logger = logging.getLogger(__name__)


def compile_ahead_enabled(kernel_names: dict[str, str]) -> bool:
    """Whether the engine compiles its Triton kernels ahead (unless ``QLLM_COMPILE_AHEAD=0``),
    given which kernel serves each op (``kernel_names``):
    never while an op runs its plain-torch reference, which may read, as indices on the host,
    the unwritten output of a Triton kernel the pass did not run (the ``fused_moe`` reference
    counts each expert's slots from the router's ids), but for ``HOST_FREE_REFERENCES``."""
    if not env_switch(SWITCH_ENV):
        return False
    references = sorted(op for op, name in kernel_names.items()
                        if name == "torch" and op not in HOST_FREE_REFERENCES)
    if references:
        logger.info("not compiling ahead: ops on their plain-torch references: %s",
                    ", ".join(references))
    return not references


@contextlib.contextmanager
def compile_launches(workers: int | None = None):
    """Within the block, each Triton launch compiles its kernel variant (if new) in one of
    ``workers`` threads (default: the CPU count) instead of running it, and an autotuned
    kernel compiles all its configs (a known key's alone), tuning none; the block ends when
    every compile has.
    Where Triton lacks ``AsyncCompileMode`` (before 3.4) the block runs its launches as
    usual."""
    try:
        from triton.runtime import _async_compile
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    original_run, original_tune = JITFunction.run, Autotuner.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return original_run(self, *args, grid=grid, warmup=True, **kwargs)

    def compile_configs(self, *args, **kwargs):
        kwargs.pop("warmup", None)
        if untuned(self, args, kwargs):
            return self.warmup(*args, **kwargs)
        # a key tuned, or pinned (fla's shipped configs load into the cache first): its config
        config = self.cache[tuning_key(self, args, kwargs)] if len(self.configs) > 1 \
            else self.configs[0]
        return self.fn.warmup(*args, **kwargs, **config.all_kwargs())

    pool = ThreadPoolExecutor(workers or os.cpu_count() or 1, thread_name_prefix="qllm-compile")
    JITFunction.run, Autotuner.run = compile_only, compile_configs
    try:
        with _async_compile.AsyncCompileMode(pool, ignore_errors=True):
            yield
    finally:
        JITFunction.run, Autotuner.run = original_run, original_tune
        pool.shutdown(wait=True)
