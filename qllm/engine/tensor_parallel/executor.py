"""Starting, driving and watching the ranks of a tensor-parallel engine.

``start_engine_shards`` is what ``LLMEngine`` calls at ``tensor_parallel_size > 1``:

- on one host, without a launcher, it spawns ``size - 1`` worker processes
  (``torch.multiprocessing``, spawn; rendezvous through a file, no port) and runs rank 0 in
  the engine's process;
- under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set, ``env://`` rendezvous; one host or
  several) or in a process whose default group is already initialised, it joins that world
  (its size must be ``tensor_parallel_size``): rank 0 runs the engine, every other rank serves
  as a worker inside its ``LLM(...)`` call and exits when rank 0 is done.

Every rank builds its shard of the model, its caches (block and slot counts agreed on, the
fewest any rank fits) and its runner in the same order, so their collectives pair up.
Collectives run on the default group (NCCL on CUDA, gloo on CPU); the per-step messages go
over a gloo control group. A worker that dies or raises is reported as
``RuntimeError("tensor-parallel rank R exited: ...")``: its process is watched (spawned
workers), and a collective that fails or a step whose tokens cannot be trusted raises it.
Rank 0 checks its spawned workers before each message and waits for its sends in slices,
looking at them between: gloo can leave a send to a peer that died pending until the
group's timeout rather than fail it.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from qllm.distributed.parallel_state import TensorParallel, building

logger = logging.getLogger(__name__)

# collectives of the model and its step (the peers run the same step: only a hung rank
# makes one wait this long), and rank 0's messages; the workers wait for rank 0's next
# message without limit
DEVICE_TIMEOUT = timedelta(minutes=10)
CONTROL_TIMEOUT = timedelta(days=3650)
# how often rank 0, waiting for a send to finish, looks at its spawned workers
SEND_WAIT_SLICE = timedelta(seconds=0.5)
# how long a failed collective waits for the watchdog to see which rank exited
FAILURE_GRACE_SECONDS = 5.0
JOIN_SECONDS = 10.0

# config attributes that tensor parallelism splits: each must be a multiple of the size
DIVIDED = ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads",
           "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def check_tensor_parallel(text_config, size: int) -> None:
    """``ValueError`` naming the first head count or intermediate size of the model that
    ``size`` ranks cannot split (KV heads may instead be replicated: ``size`` a multiple of
    them)."""
    for name in DIVIDED:
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                             f"{name} ({value})")
    kv_heads = getattr(text_config, "num_key_value_heads", None)
    if isinstance(kv_heads, int) and kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size={size} is neither a divisor nor a multiple of "
                         f"the model's num_key_value_heads ({kv_heads})")


@dataclasses.dataclass
class WorldGroups:
    """The groups of this process's world: the gloo ``control`` group (step messages, cache
    agreement) and, per backend, the device group of the collectives."""

    rank: int
    size: int
    control: object
    device_groups: dict = dataclasses.field(default_factory=dict)

    def state(self, device: torch.device) -> TensorParallel:
        """This rank's ``TensorParallel`` for a model on ``device`` (every rank calls it at
        the same point of an engine's start: creating a group is collective)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend not in self.device_groups:
            if dist.get_backend() == backend:
                group = dist.group.WORLD
            else:
                group = dist.new_group(backend=backend, timeout=DEVICE_TIMEOUT)
            self.device_groups[backend] = group
        group = self.device_groups[backend]
        return TensorParallel(self.rank, self.size, group, group.group_name)

    def agree_units(self, units: dict[str, int]) -> dict[str, int]:
        """Each cache kind's unit count: the fewest any rank has room for."""
        names = sorted(units)
        counts = torch.tensor([units[n] for n in names], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=self.control)
        return dict(zip(names, counts.tolist()))


_GROUPS: WorldGroups | None = None


def world_groups() -> WorldGroups:
    """This process's ``WorldGroups`` (made on first use: every rank calls this first)."""
    global _GROUPS
    if _GROUPS is None:  # the timeout is each rank's own: rank 0 only sends and agrees
        timeout = DEVICE_TIMEOUT if dist.get_rank() == 0 else CONTROL_TIMEOUT
        control = dist.new_group(backend="gloo", timeout=timeout)
        _GROUPS = WorldGroups(dist.get_rank(), dist.get_world_size(), control)
    return _GROUPS


def release_workers() -> None:
    """On rank 0 of a launcher's world: end the workers' loops (under torchrun their
    processes then exit). Runs at exit; call it earlier to keep the process group."""
    global _GROUPS
    if _GROUPS is None or _GROUPS.rank != 0 or not dist.is_initialized():
        return
    groups, _GROUPS = _GROUPS, None
    try:
        send_message(groups.control, ("exit", None))
    except Exception:  # noqa: BLE001 - a dead world: nothing to tell
        logger.debug("could not release the workers", exc_info=True)


def send_message(control, message: tuple[str, object], wait=lambda work: work.wait()) -> None:
    """Rank 0: broadcast ``message`` (pickled: its size, then its bytes) over the control
    group; ``wait(work)`` waits for each of the two sends."""
    data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)  # [bytes]
    size = torch.tensor([data.numel()], dtype=torch.int64)  # [1]
    for tensor in (size, data):
        wait(dist.broadcast(tensor, src=0, group=control, async_op=True))


def receive(control) -> tuple[str, object]:
    """A worker's next message from rank 0 (``send_message``'s)."""
    size = torch.empty(1, dtype=torch.int64)  # [1]
    dist.broadcast(size, src=0, group=control)
    data = torch.empty(int(size), dtype=torch.uint8)  # [bytes]
    dist.broadcast(data, src=0, group=control)
    return pickle.loads(data.numpy().tobytes())


def share_cpu_threads(size: int) -> None:
    """CPU ranks of one host share its cores: each takes ``cores / size`` intra-op threads
    (oversubscribed, OpenMP's spinning threads made a 4-rank gloo run 3x slower)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def local_device(device_type: str, base: int, rank: int) -> torch.device:
    """Rank ``rank``'s device: on CUDA, GPU ``base + LOCAL_RANK`` (torchrun's; the rank itself
    for spawned workers)."""
    if device_type != "cuda":
        return torch.device(device_type)
    return torch.device("cuda", base + int(os.environ.get("LOCAL_RANK", rank)))


class TensorParallelExecutor:
    """Rank 0's side: sends each step to the workers, broadcasts its sampled tokens, watches
    the worker processes it spawned, and stops them at ``close`` (also at exit, and when the
    engine is collected)."""

    def __init__(self, size: int, groups: WorldGroups, processes=(), errors=None,
                 owns_world: bool = False, rendezvous_dir: str | None = None):
        self.size = size
        self.groups = groups
        self.tp: TensorParallel | None = None
        self.processes = list(processes)  # spawned workers: rank i + 1 is processes[i]
        self.errors = errors
        self.owns_world = owns_world
        self.rendezvous_dir = rendezvous_dir
        self.failure: str | None = None
        self.closed = False
        self._reports: dict[int, str] = {}
        self._failure_lock = threading.Lock()  # the watchdog and the engine's thread record it
        if self.processes:
            threading.Thread(target=self._watch, daemon=True, name="qllm-tp-watchdog").start()
        atexit.register(self.close)

    # ----------------------------------------------------------------- health
    def _collect_reports(self) -> None:
        while self.errors is not None:
            try:
                rank, report = self.errors.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return
            self._reports[rank] = report

    def _dead_worker(self) -> str | None:
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                self._collect_reports()
                report = self._reports.get(rank)
                last = report.strip().splitlines()[-1] if report else \
                    f"exit code {process.exitcode}"
                return f"tensor-parallel rank {rank} exited: {last}"
        return None

    def _look_at_workers(self) -> None:
        """Record a spawned worker that has exited as the failure, once; while the engine is
        open, log it with the workers' reports and abort the device group."""
        message = self._dead_worker()
        with self._failure_lock:
            if message is None or self.failure is not None:
                return
            self.failure = message
        if self.closed:
            return
        logger.error("%s", message)
        for rank, report in self._reports.items():
            logger.error("rank %d:\n%s", rank, report)
        self._abort()

    def _watch(self) -> None:
        while not self.closed and self.failure is None:
            self._look_at_workers()
            time.sleep(0.2)

    def _abort(self) -> None:
        """Unblock rank 0's collectives that wait for a dead rank (NCCL would wait until its
        timeout; gloo fails at once on the closed connection)."""
        if self.tp is not None and self.tp.group is not None \
                and dist.get_backend(self.tp.group) == "nccl":
            try:
                dist.distributed_c10d._abort_process_group(self.tp.group)
            except Exception:  # noqa: BLE001 - best effort; the error is already set
                logger.exception("aborting the NCCL group failed")

    def check(self) -> None:
        """Raise the failure of a rank, if one failed (a spawned worker that exited is seen
        here at once, not only at the watchdog's next look)."""
        if self.processes:
            self._look_at_workers()
        if self.failure is not None:
            raise RuntimeError(self.failure)
        if self.closed:
            raise RuntimeError("the tensor-parallel engine is closed")

    def fail(self, exc: BaseException):
        """Raise ``RuntimeError`` for a collective that failed with ``exc``: which rank
        exited, once the watchdog has seen it."""
        deadline = time.monotonic() + (FAILURE_GRACE_SECONDS if self.processes else 0)
        while self.failure is None and time.monotonic() < deadline:
            self._look_at_workers()
            time.sleep(0.05)
        if self.failure is None:
            self.failure = f"a tensor-parallel step failed: {exc!r}"
        raise RuntimeError(self.failure) from exc

    # ----------------------------------------------------------------- driving
    def send(self, message: tuple[str, object]) -> None:
        """Broadcast one message to the workers (one step: once)."""
        self.check()
        try:
            send_message(self.groups.control, message, self._wait)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)

    def _wait(self, work) -> None:
        """Wait for one of rank 0's sends, raising if a spawned worker exits meanwhile."""
        while True:
            try:
                work.wait(SEND_WAIT_SLICE)
                return
            except RuntimeError as exc:
                if work.is_completed():  # finished (or failed) as the slice ran out
                    work.wait()
                    return
                failure = self._dead_worker()
                if failure is not None:
                    raise RuntimeError(failure) from exc

    def broadcast_tokens(self, tokens: torch.Tensor) -> None:
        """The step's sampled tokens to the workers (over gloo: waited for as a message is;
        NCCL's broadcast is queued on the stream)."""
        if tokens.device.type == "cuda":
            dist.broadcast(tokens, src=0, group=self.tp.group)
        else:
            self._wait(dist.broadcast(tokens, src=0, group=self.tp.group, async_op=True))

    def agree_units(self, units: dict[str, int]) -> dict[str, int]:
        try:
            return self.groups.agree_units(units)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)

    def close(self) -> None:
        """Stop the workers (spawned ones exit; a launcher's wait for the next engine) and,
        for a world this executor made, destroy it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self.failure is None:
            try:
                send_message(self.groups.control, ("exit" if self.owns_world else "close", None),
                             self._wait)
            except Exception:  # noqa: BLE001 - a dead world: nothing to tell
                logger.debug("could not tell the workers to stop", exc_info=True)
        for process in self.processes:
            process.join(JOIN_SECONDS if self.failure is None else 0.5)
            if process.exitcode is None:
                process.kill()
                process.join(JOIN_SECONDS)
        if self.owns_world:
            global _GROUPS
            _GROUPS = None
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                logger.debug("destroy_process_group failed", exc_info=True)
        if self.rendezvous_dir:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)


# ----------------------------------------------------------------- start-up
def _spawn_world(size: int, backend: str) -> TensorParallelExecutor:
    """Spawn ranks 1..size-1 on this host and join them as rank 0."""
    context = torch.multiprocessing.get_context("spawn")
    rendezvous = tempfile.mkdtemp(prefix="qllm-tp-")
    init_method = f"file://{os.path.join(rendezvous, 'store')}"
    errors = context.Queue()
    from qllm.engine.tensor_parallel.worker import spawned_main

    processes = [context.Process(target=spawned_main, name=f"qllm-tp-rank-{rank}",
                                 args=(rank, size, init_method, backend, errors, os.getpid()),
                                 daemon=True)
                 for rank in range(1, size)]
    for process in processes:
        process.start()
    executor = TensorParallelExecutor(size, None, processes, errors, owns_world=True,
                                      rendezvous_dir=rendezvous)
    joined: list[BaseException | None] = []

    def join():
        try:
            dist.init_process_group(backend, init_method=init_method, rank=0, world_size=size,
                                    timeout=DEVICE_TIMEOUT)
            joined.append(None)
        except BaseException as exc:  # noqa: BLE001
            joined.append(exc)

    thread = threading.Thread(target=join, daemon=True, name="qllm-tp-rendezvous")
    thread.start()
    while thread.is_alive():  # a worker that fails at start-up ends the wait
        thread.join(0.2)
        if executor.failure is not None:
            executor.close()
            raise RuntimeError(executor.failure)
    if joined[0] is not None:
        executor.close()
        raise RuntimeError(f"tensor-parallel rendezvous failed: {joined[0]}") from joined[0]
    executor.groups = world_groups()
    return executor


def _attach_world(size: int, backend: str) -> TensorParallelExecutor:
    """Join the world of a launcher (torchrun: ``env://``) or one already initialised. On a
    rank other than 0, serve as a worker and exit when rank 0 is done."""
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend, init_method="env://", timeout=DEVICE_TIMEOUT)
    if dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size={size} must equal the world size of the "
                         f"launcher ({dist.get_world_size()}); data parallelism across "
                         f"tensor-parallel groups is not supported")
    rank = dist.get_rank()
    if rank != 0:
        from qllm.engine.tensor_parallel.worker import serve

        groups = world_groups()
        serve(rank)
        del groups
        dist.destroy_process_group()
        raise SystemExit(0)
    if _GROUPS is None:
        atexit.register(release_workers)
    return TensorParallelExecutor(size, world_groups(), owns_world=owns)


def start_engine_shards(engine, config, hf_config, plugins, kernels, device: torch.device):
    """Start the ranks of a tensor-parallel engine and build rank 0's shard: returns
    ``(executor, model, cache, runner)`` for ``LLMEngine``."""
    from qllm.cache.registry import CacheRegistry
    from qllm.engine.tensor_parallel.runner import DriverRunner
    from qllm.model.builder import build_model

    size = config.tensor_parallel_size
    check_tensor_parallel(hf_config.get_text_config(), size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    base = (device.index or 0) if device.type == "cuda" else 0
    launched = dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    if device.type == "cuda" and not launched and torch.cuda.device_count() < base + size:
        raise ValueError(f"tensor_parallel_size={size} needs GPUs {base}..{base + size - 1}; "
                         f"this machine has {torch.cuda.device_count()}")
    executor = _attach_world(size, backend) if launched else _spawn_world(size, backend)
    try:
        device = local_device(device.type, base, 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            share_cpu_threads(size)
        executor.send(("engine", (config, device.type, base)))
        executor.tp = executor.groups.state(device)
        with building(executor.tp):
            model = build_model(config, hf_config, plugins, kernels, device)
        cache = CacheRegistry(model, plugins.layer_kinds, plugins.cache_kinds, config, device,
                              agree=executor.agree_units)
        runner = DriverRunner(model, config, cache, device, hf_config.get_text_config()
                              .vocab_size, executor=executor,
                              sample_tokens=kernels.sample_tokens)
    except BaseException:
        executor.close()
        raise
    weakref.finalize(engine, executor.close)
    logger.info("tensor parallel: %d ranks (%s)", size, backend)
    return executor, model, cache, runner
