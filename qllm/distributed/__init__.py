"""Tensor parallelism on ``torch.distributed``: the process-group state that sharded layers
read when the model is built (``parallel_state``) and how a checkpoint tensor is split between
ranks (``shards``). The ranks themselves are run by ``qllm.engine.tensor_parallel``.

At ``tensor_parallel_size=1`` none of this runs: no process group, no extra process, and the
sharded layers build and run as the plain ones.
"""

from qllm.distributed.parallel_state import TensorParallel, all_reduce, get_tp

__all__ = ["TensorParallel", "all_reduce", "get_tp"]
