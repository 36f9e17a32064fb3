"""Test utilities of the core, for its own tests and the plugins' (as ``torch.testing``).

- ``qllm.testing.models``: tiny random Qwen3 checkpoints, random prompts, transformers' greedy
  reference.
- ``qllm.testing.engine``: checks on a running engine (cache leaks, prefill logits, token
  comparisons) and the CUDA-graph decode and prefill paths on the CPU.
- ``qllm.testing.batch``: ``forward_batch``, a ``ForwardBatch`` from sequence lengths.
- ``qllm.testing.kernels``: the GPU kernels' test scaffolding (skip markers, the Triton
  interpreter run, traced-graph inspection); ``qllm.testing.triton_launches`` compiles the
  interpreted launches for sm_90.
- ``qllm.testing.benchmarking``: the kernel micro-benchmarks' timing and report.
- ``qllm.testing.sm90``: kernels compiled for sm_90 without a GPU and their SASS;
  ``qllm.testing.pdl``: the programmatic-dependent-launch checks built on it.

The first three are re-exported here.
"""

from qllm.testing.batch import forward_batch
from qllm.testing.engine import (InjectedFailure, RerunGraph, assert_cache_free,
                                 assert_greedy_equal_up_to_ties, assert_same_tokens,
                                 fail_on_call, last_token_logits, prefill_logits,
                                 record_launches, record_replays, rerun_capture,
                                 with_decode_graphs, with_prefill_graphs)
from qllm.testing.models import (hf_greedy, perturb_, random_prompts, require_qwen3_plugin,
                                 save_tiny_qwen3, tiny_qwen3_config, torch_threads)

__all__ = ["InjectedFailure", "RerunGraph", "assert_cache_free",
           "assert_greedy_equal_up_to_ties", "assert_same_tokens", "fail_on_call",
           "forward_batch", "hf_greedy", "last_token_logits", "perturb_",
           "prefill_logits", "random_prompts", "record_launches", "record_replays",
           "require_qwen3_plugin", "rerun_capture", "save_tiny_qwen3", "tiny_qwen3_config",
           "torch_threads", "with_decode_graphs", "with_prefill_graphs"]
