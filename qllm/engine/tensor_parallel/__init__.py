"""A tensor-parallel engine's ranks: the executor that starts and watches them
(``executor``), the worker processes it drives (``worker``) and the runners of both sides
(``runner``). The process-group state the sharded layers read is ``qllm.distributed``."""
