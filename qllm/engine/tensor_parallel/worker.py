"""A worker rank: builds its shard of each engine rank 0 starts, and runs rank 0's steps.

The loop reads ``(kind, payload)`` messages that rank 0 broadcasts over the control group:
``("engine", (config, device))`` builds a model shard, its caches and its runner (the same
steps, in the same order, as rank 0's engine, so that their collectives pair up);
``("step", StepMessage)`` runs one step; ``("close", None)`` frees the engine and waits for
the next; ``("exit", None)`` returns.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import traceback

import torch
import torch.distributed as dist

from qllm.engine.tensor_parallel import executor as tp_executor
from qllm.distributed.parallel_state import building

logger = logging.getLogger(__name__)


def serve(rank: int) -> None:
    """Run rank ``rank``'s worker loop until rank 0 sends ``exit`` (the default process
    group must be initialised, its rank 0 running the engine)."""
    groups = tp_executor.world_groups()
    engine = None
    while True:
        kind, payload = tp_executor.receive(groups.control)
        if kind == "step":
            engine.run(payload)
        elif kind == "engine":
            engine = _build(rank, *payload, groups)
        elif kind == "close":
            engine = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        elif kind == "exit":
            return
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")


def _build(rank: int, config, device_type: str, base: int, groups):
    from qllm.cache.registry import CacheRegistry
    from qllm.engine.tensor_parallel.runner import WorkerRunner
    from qllm.model.builder import build_model, load_hf_config
    from qllm.plugins.registry import default_registry

    device = tp_executor.local_device(device_type, base, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        tp_executor.share_cpu_threads(groups.size)
    plugins = default_registry()
    hf_config = load_hf_config(config.model, plugins)
    kernels = plugins.kernels(device, config.dtype, config.kernels)
    tp = groups.state(device)
    with building(tp):
        model = build_model(config, hf_config, plugins, kernels, device)
    cache = CacheRegistry(model, plugins.layer_kinds, plugins.cache_kinds, config, device,
                          agree=groups.agree_units)
    return WorkerRunner(model, config, cache, device, hf_config.get_text_config().vocab_size,
                        device_group=tp.group)


def spawned_main(rank: int, world_size: int, init_method: str, backend: str,
                 errors, parent_pid: int) -> None:
    """Entry of a worker process started by the engine (``torch.multiprocessing``, spawn):
    join the group, serve, and on any error report it to rank 0 before exiting."""
    logging.basicConfig(level=os.environ.get("QLLM_WORKER_LOG_LEVEL", "WARNING"))
    _exit_with_parent(parent_pid)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=tp_executor.DEVICE_TIMEOUT)
        serve(rank)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to rank 0
        errors.put((rank, "".join(traceback.format_exception(exc))))
        time.sleep(0.1)  # let the queue's feeder thread send it
        os._exit(1)
    dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """A worker whose engine process died (even killed) exits rather than wait forever."""
    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)
    threading.Thread(target=watch, daemon=True, name="qllm-tp-parent-watch").start()
