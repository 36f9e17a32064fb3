"""Tensor parallelism on CPU (gloo): greedy tokens at TP=2 and TP=4 equal TP=1 for Qwen3,
Qwen3.5 dense, Qwen3.5-MoE and Qwen3-Next tiny fp32 models, with and without preemption and
slot reuse; sizes that do not divide a head count are refused; a rank that dies is a clear
error, not a hang. On CUDA, the NCCL path at world size 1 (more when the machine has the GPUs).

Each TP size runs in one world of processes (launcher-style: rank 0 builds every engine, the
other ranks serve them), so the processes start once per size, not once per engine.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.testing import torch_threads

pytest.importorskip("qllm_qwen3", reason="the qllm-qwen3 plugin is not installed")
qwen3_5_testing = pytest.importorskip("qllm_qwen3_5.testing",
                                      reason="the qllm-qwen3-5 plugin is not installed")

FAMILIES = ("qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next")
# GDN heads that 4 ranks can split (the plugin's tiny default has 2 key heads)
GDN_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# plain: a shared prefix served twice (prefix cache; for the hybrids, state checkpoints)
PLAIN = dict(device="cpu", block_size=16, num_kv_blocks=48, max_num_seqs=4,
             max_model_len=128, prefix_state_cache_slots=8)
# preempted: 3 KV blocks of 16 tokens for 2 running sequences of up to 30 tokens each,
# 5 requests through 2 recurrent slots
PREEMPTED = dict(device="cpu", block_size=16, num_kv_blocks=3, max_num_seqs=2,
                 max_model_len=48, enable_prefix_caching=False)
WORLD_TIMEOUT_SECONDS = 240


def _prompts(kind: str) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    draw = lambda n: torch.randint(2, 512, (n,), generator=g).tolist()  # noqa: E731
    if kind == "plain":
        prefix = draw(33)
        return [prefix + draw(n) for n in (3, 7, 1)] + [draw(5)]
    return [draw(n) for n in (20, 14, 25, 9, 11)]


def _run_cases(paths: dict[str, str], size: int) -> dict:
    """Each family's greedy tokens (and preemption count) in both settings at ``size``."""
    out = {}
    for family, path in paths.items():
        for name, options in (("plain", PLAIN), ("preempted", PREEMPTED)):
            llm = LLM(path, tensor_parallel_size=size, **options)
            try:
                prompts = _prompts(name)
                rounds = 2 if name == "plain" else 1
                tokens = [[o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
                          for _ in range(rounds)]
                out[family, name] = (tokens, llm.engine.scheduler.num_preemptions)
            finally:
                if llm.engine.executor is not None:
                    llm.engine.executor.close()
    return out


def _rank_main(rank: int, size: int, store: str, paths: dict, results) -> None:
    """One rank of a launcher-style world (as under torchrun): rank 0 runs the engines."""
    import sys

    import torch.distributed as dist

    sys.modules.setdefault("fla", None)  # transformers' configs import it; CPU only here
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=size)
    try:
        if rank == 0:
            try:
                results.put(("ok", _run_cases(paths, size)))
            except BaseException as exc:  # noqa: BLE001
                import traceback

                results.put(("error", "".join(traceback.format_exception(exc))))
            finally:
                from qllm.engine.tensor_parallel.executor import release_workers

                release_workers()
        else:
            from qllm.engine.tensor_parallel.worker import serve

            serve(rank)
    finally:
        dist.destroy_process_group()


def _run_world(paths: dict, size: int, tmp_path) -> dict:
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    store = str(tmp_path / f"store-{size}")
    processes = [context.Process(target=_rank_main, args=(rank, size, store, paths, results),
                                 daemon=True) for rank in range(size)]
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the ranks share this host's cores (set at spawn)
    try:
        for process in processes:
            process.start()
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    try:
        status, value = results.get(timeout=WORLD_TIMEOUT_SECONDS)
        for process in processes:
            process.join(30)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    assert status == "ok", value
    return value


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from qllm.testing import save_tiny_qwen3

    paths = {}
    for family in FAMILIES:
        path = str(tmp_path_factory.mktemp(f"tp-{family}"))
        if family == "qwen3":
            save_tiny_qwen3(path)
        else:
            qwen3_5_testing.save_checkpoint(family, path, **GDN_HEADS)
        paths[family] = path
    return paths


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict:
    with torch_threads(2):
        return _run_cases(checkpoints, 1)


def test_reference_preempts_and_reuses_slots(reference):
    """The preempted setting does preempt (else the parity below would not cover it)."""
    for family in FAMILIES:
        assert reference[family, "preempted"][1] > 0, family


@pytest.mark.parametrize("size", [2, 4], ids=lambda n: f"tp{n}")
def test_greedy_tokens_equal_tp1(checkpoints, reference, size, tmp_path):
    got = _run_world(checkpoints, size, tmp_path)
    for key, (tokens, preemptions) in reference.items():
        assert got[key][0] == tokens, f"{key} at TP={size}"
        assert got[key][1] == preemptions, f"{key} at TP={size}: preemptions differ"


def test_spawned_workers_then_a_killed_rank_is_a_clear_error(checkpoints, reference):
    """``LLM(..., tensor_parallel_size=2)`` spawns its worker; killing it makes the next
    call raise naming the rank, within seconds."""
    llm = LLM(checkpoints["qwen3_next"], tensor_parallel_size=2, **PREEMPTED)
    try:
        prompts = _prompts("preempted")
        tokens = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert tokens == reference["qwen3_next", "preempted"][0][0]
        worker = llm.engine.executor.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        outcome = []

        def generate():
            try:
                llm.generate(prompts, GREEDY, use_tqdm=False)
                outcome.append(None)
            except Exception as exc:  # noqa: BLE001
                outcome.append(exc)

        start = time.monotonic()
        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        thread.join(30)
        assert outcome, "a dead rank left the engine hanging"
        assert isinstance(outcome[0], RuntimeError), outcome[0]
        assert "tensor-parallel rank 1 exited" in str(outcome[0])
        assert time.monotonic() - start < 15
    finally:
        llm.engine.executor.close()


class _PendingSend:
    """A gloo send whose wait runs out each slice (``pending`` times, then finishes)."""

    def __init__(self, pending: int | None):
        self.pending = pending
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        if self.pending is None or self.waits <= self.pending:
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return False


class _Worker:
    """A spawned worker's process, as the executor sees it."""

    def __init__(self, exitcode: int | None):
        self.exitcode = exitcode

    def join(self, timeout=None):
        pass

    kill = join


@pytest.mark.parametrize("exitcode", [None, -9])
def test_a_send_left_pending_by_a_dead_worker_raises_naming_it(exitcode):
    """gloo can leave a send to a peer that died pending until the group's timeout: rank 0
    waits in slices, and between them looks at its workers (an alive one: it waits on)."""
    from qllm.engine.tensor_parallel.executor import TensorParallelExecutor

    executor = TensorParallelExecutor(2, None, [_Worker(exitcode)])
    try:
        if exitcode is None:
            send = _PendingSend(pending=3)
            executor._wait(send)
            assert send.waits == 4
        else:
            send = _PendingSend(pending=None)
            with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited: exit code -9"):
                executor._wait(send)
            assert send.waits == 1
    finally:
        executor.failure = executor.failure or "test over"  # nothing to tell fake workers
        executor.close()


@pytest.mark.parametrize("family,size,name", [
    ("qwen3", 3, "num_attention_heads"),
    ("qwen3_5_gdn2", 4, "linear_num_key_heads"),
])
def test_sizes_that_do_not_divide_are_refused(checkpoints, tmp_path, family, size, name):
    path = checkpoints.get(family)
    if path is None:  # the plugin's default tiny geometry: 2 GDN key heads
        path = str(tmp_path / "gdn2")
        qwen3_5_testing.save_checkpoint("qwen3_5", path)
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size} does not divide "
                                         f"the model's {name}"):
        LLM(path, tensor_parallel_size=size, device="cpu")


def test_tensor_parallel_size_must_be_positive(checkpoints):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(checkpoints["qwen3"], tensor_parallel_size=0, device="cpu")


@pytest.mark.cuda
def test_nccl_path_at_world_size_1(checkpoints, tmp_path):
    """The NCCL group, the functional all-reduce eager, compiled and in a CUDA graph, and a
    launcher-style engine (rank 0 of a world of one) on the GPU; with two GPUs, TP=2 equals
    TP=1 there too."""
    import torch.distributed as dist

    from qllm.distributed.parallel_state import all_reduce
    from qllm.engine.tensor_parallel.executor import world_groups

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        tp = world_groups().state(torch.device("cuda", 0))
        tp = type(tp)(tp.rank, 2, tp.group, tp.group_name)  # size 2: the collective runs
        x = torch.randn(8, 16, device="cuda")
        torch.testing.assert_close(all_reduce(x, tp), x)
        compiled = torch.compile(lambda t: all_reduce(t * 2, tp), fullgraph=True)
        torch.testing.assert_close(compiled(x), 2 * x)
        graph = torch.cuda.CUDAGraph()
        static = x.clone()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = all_reduce(static * 3, tp)
        static.copy_(x + 1)
        graph.replay()
        torch.testing.assert_close(captured, 3 * (x + 1))
    finally:
        dist.destroy_process_group()
        from qllm.engine.tensor_parallel import executor

        executor._GROUPS = None


@pytest.mark.cuda
def test_nccl_tp2_equals_tp1_on_two_gpus(checkpoints, reference):
    """With two GPUs: NCCL, compiled decode and CUDA graphs per rank, fp32."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    for family in FAMILIES:
        options = dict(PREEMPTED, device="cuda", dtype="float32")
        one = LLM(checkpoints[family], **options)
        expected = [o["token_ids"] for o in one.generate(_prompts("preempted"), GREEDY,
                                                          use_tqdm=False)]
        del one
        llm = LLM(checkpoints[family], tensor_parallel_size=2, **options)
        try:
            got = [o["token_ids"] for o in llm.generate(_prompts("preempted"), GREEDY,
                                                         use_tqdm=False)]
        finally:
            llm.engine.executor.close()
        assert got == expected, family
