"""Tensor parallelism on ``torch.distributed``: the process-group state that sharded layers
read when the model is built (``parallel_state``), the worker processes driven by the engine
(``worker``) and the executor that starts and watches them (``executor``).

At ``tensor_parallel_size=1`` none of this runs: no process group, no extra process, and the
sharded layers build and run as the plain ones.
"""

from qllm.distributed.parallel_state import TensorParallel, all_reduce, get_tp

__all__ = ["TensorParallel", "all_reduce", "get_tp"]
