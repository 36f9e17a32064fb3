"""``AsyncEngine``: the synchronous ``LLMEngine`` driven by one background thread, serving
asyncio code.

The engine is not thread-safe, so one thread owns it: it runs the functions queued for it
(adds, aborts) between steps and steps while anything is unfinished, so requests join and
leave the running batch continuously. Each step's outputs go back to the event loop in one
``call_soon_threadsafe`` call, into the ``RequestGroup`` of each HTTP request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from qllm.batch import Sequence
from qllm.config import SamplingParams
from qllm.engine.llm_engine import LLMEngine
from qllm.model.multimodal import MultimodalInputs
from qllm.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine is shutting down, or failed on its device, and takes no new requests."""


class GenerationError(RuntimeError):
    """The engine thread failed while requests ran (in a step, or handing out its outputs):
    each of them gets one of these (the failure as its cause) and is aborted; the engine goes
    on taking requests."""


@dataclass(frozen=True)
class RequestOutput:
    """What one step added to choice ``index`` of a request."""

    index: int
    text: str  # new text since this choice's previous output
    num_output_tokens: int  # generated so far
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    token_ids: list[int] = field(default_factory=list)  # new tokens since the previous output
    # their {token_id: Logprob} when the request asked for log-probs, else None
    logprobs: list[dict] | None = None
    # the prompt's log-probs (first None), in the choice's first output, when asked for
    prompt_logprobs: list[dict | None] | None = None


class RequestGroup:
    """The engine requests (choices) of one API call, and their outputs as they come.

    Iterate it to get ``RequestOutput``s until every choice has finished. ``abort`` stops
    the unfinished choices and frees their cache; it is safe to call at any time, twice,
    or after everything finished.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, num_choices: int):
        self.request_id = request_id
        self.arrival_time = time.perf_counter()
        self._engine = engine
        self._outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(range(num_choices))

    def engine_request_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self._unfinished:
            output = await self._outputs.get()
            if isinstance(output, BaseException):
                raise output
            if output.finish_reason is not None:
                self._unfinished.discard(output.index)
            yield output

    def abort(self) -> None:
        if self._unfinished:
            self._engine.abort([self.engine_request_id(i) for i in self._unfinished])
            self._unfinished.clear()

    def put(self, output: RequestOutput | BaseException) -> None:
        """Called on the event loop thread with the engine thread's outputs."""
        self._outputs.put_nowait(output)


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one running choice."""

    group: RequestGroup
    index: int
    holdback: int  # characters held back while a stop string could still match
    sent: int = 0  # characters of output text already delivered
    tokens_sent: int = 0  # generated tokens already delivered
    last_token_time: float | None = None


class AsyncEngine:
    """Run an ``LLMEngine`` in a dedicated thread; ``start`` it on the serving event loop."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._device_failure: str | None = None  # why the engine stopped stepping, if it did

    # ------------------------------------------------------------ event loop side
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="qllm-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """The engine thread runs and takes requests: not stopped, not failed on its
        device (``GET /health`` answers 503 otherwise)."""
        return (self._thread is not None and self._thread.is_alive() and not self._stopped
                and self._device_failure is None)

    async def add(self, prompts: list[list[int]], params: list[SamplingParams],
                  request_id: str, multimodal: list[MultimodalInputs | None] | None = None
                  ) -> RequestGroup:
        """Queue one engine request per (prompt, params) pair, all or none. ``multimodal``:
        per prompt, what ``LLMEngine.process_prompt`` made of its media (then ``prompts``
        hold the expanded token ids), or None.

        Raises ``ValueError`` (from the engine's validation) if any cannot be served, and
        ``EngineStoppedError`` after ``stop`` or a device error.
        """
        if not self.is_running:
            raise EngineStoppedError(self._device_failure or "the server is shutting down")
        group = RequestGroup(self, request_id, len(prompts))
        added: concurrent.futures.Future[None] = concurrent.futures.Future()
        multimodal = multimodal or [None] * len(prompts)
        self._calls.put(lambda: self._add(group, prompts, params, multimodal, added))
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            group.abort()  # the engine may have added it after all
            raise
        return group

    def abort(self, request_ids: list[str]) -> None:
        """Abort engine requests; their cache is freed before the next step."""
        self._calls.put(lambda: self._abort(request_ids))

    def abort_all(self) -> None:
        """Abort every request in flight; each ends with finish reason "abort"."""
        self._calls.put(lambda: self._abort(list(self._tracked)))

    async def stop(self) -> None:
        """Abort what is in flight, then stop the engine thread and wait for it."""
        if self._thread is None or self._stopped:
            return
        self._stopped = True
        self.abort_all()
        self._calls.put(None)
        await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------ engine thread side
    def _run(self) -> None:
        """The engine thread: queued calls, then a step while anything is unfinished, until
        the stop sentinel. A failure fails the requests tracked then, and the loop goes on (a
        thread that died would leave them waiting forever); after a device error, which CUDA
        keeps returning to every later call, it only refuses requests."""
        engine = self.engine
        while True:
            try:
                if self._run_calls(block=self._device_failure is not None
                                   or not engine.has_unfinished()):
                    return
                if self._device_failure is None and engine.has_unfinished():
                    self._publish(engine.step())
                self.metrics.set_engine_state(len(engine.scheduler.running),
                                              len(engine.scheduler.waiting),
                                              engine.cache.usage())
                self.metrics.set_prefix_cache_stats(engine.cache.prefix_cache_stats())
            except Exception as exc:  # noqa: BLE001 (each request gets it; logged here)
                logger.exception("the engine failed; aborting %d requests", len(self._tracked))
                self._fail_all(exc)
                if isinstance(exc, torch.AcceleratorError):
                    self._device_failure = (f"the engine failed on its device ({exc}); "
                                            f"restart the server")
                    logger.error("%s; refusing requests from now on", self._device_failure)

    def _run_calls(self, block: bool) -> bool:
        """Run the queued calls (waiting for one if ``block``); True at the stop sentinel."""
        while True:
            try:
                call = self._calls.get(block=block)
            except queue.Empty:
                return False
            if call is None:
                return True
            call()
            block = False

    def _add(self, group: RequestGroup, prompts: list[list[int]],
             params: list[SamplingParams], multimodal: list[MultimodalInputs | None],
             added: concurrent.futures.Future) -> None:
        if not added.set_running_or_notify_cancel():
            return
        if self._device_failure is not None:  # queued before the failure
            added.set_exception(EngineStoppedError(self._device_failure))
            return
        ids = []
        try:
            for index, (prompt, sampling, mm) in enumerate(zip(prompts, params, multimodal)):
                request_id = group.engine_request_id(index)
                seq = self.engine.add_request(prompt, sampling, request_id, stream_text=True,
                                              multimodal=mm)
                ids.append(request_id)
                holdback = max(map(len, sampling.stop), default=1) - 1
                self._tracked[request_id] = _Tracked(group, index, holdback)
                self.metrics.request_added(seq.num_prompt_tokens)
        except Exception as exc:  # noqa: BLE001 (the caller gets it: ValueError is a bad request)
            for request_id in ids:
                self.engine.abort(request_id)
                self._tracked.pop(request_id, None)
            added.set_exception(exc)
            return
        added.set_result(None)

    def _abort(self, request_ids: list[str]) -> None:
        outputs = []
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id, None)
            if tracked is None:
                continue  # finished already
            seq = self.engine.sequences.get(request_id)
            self.engine.abort(request_id)
            self.metrics.request_finished("abort")
            num_tokens = seq.num_output_tokens if seq is not None else 0
            outputs.append((tracked.group, RequestOutput(tracked.index, "", num_tokens, "abort")))
        self._deliver(outputs)

    def _fail_all(self, exc: Exception) -> None:
        groups = {id(t.group): t.group for t in self._tracked.values()}
        for request_id in list(self._tracked):
            self.engine.abort(request_id)
            self.metrics.request_finished("abort")
        self._tracked.clear()
        self._deliver([(group, _generation_error(exc)) for group in groups.values()])

    def _publish(self, advanced: list[Sequence]) -> None:
        now = time.perf_counter()
        outputs, first_latencies, later_latencies = [], [], []
        for seq in advanced:
            tracked = self._tracked.get(seq.request_id)
            if tracked is None:
                continue
            if tracked.last_token_time is None:
                first_latencies.append(now - tracked.group.arrival_time)
            else:
                later_latencies.append(now - tracked.last_token_time)
            tracked.last_token_time = now
            text = seq.output_text
            # A stop string may still complete: hold back the characters it could start in,
            # so that the deltas always concatenate to the final (cut) text.
            end = len(text) if seq.is_finished else max(tracked.sent,
                                                        len(text) - tracked.holdback)
            delta = text[tracked.sent:end]
            tracked.sent = end
            first = seq.num_prompt_tokens + tracked.tokens_sent
            new_tokens = seq.token_ids[first:]
            logprobs = None if seq.logprobs is None else seq.logprobs[tracked.tokens_sent:]
            prompt_logprobs = list(seq.prompt_logprobs) \
                if seq.prompt_logprobs is not None and tracked.tokens_sent == 0 else None
            tracked.tokens_sent += len(new_tokens)
            outputs.append((tracked.group, RequestOutput(tracked.index, delta,
                                                         seq.num_output_tokens,
                                                         seq.finish_reason, new_tokens,
                                                         logprobs, prompt_logprobs)))
            if seq.is_finished:
                del self._tracked[seq.request_id]
                self.metrics.request_finished(seq.finish_reason)
        self.metrics.tokens_generated(first_latencies, later_latencies)
        self._deliver(outputs)

    def _deliver(self, outputs: list[tuple[RequestGroup, RequestOutput | BaseException]]):
        if outputs:
            self._loop.call_soon_threadsafe(_put_all, outputs)


def _generation_error(exc: Exception) -> GenerationError:
    """What a request running when the engine failed gets (one instance per request: each
    is raised in its own task)."""
    error = GenerationError(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _put_all(outputs: list[tuple[RequestGroup, RequestOutput | BaseException]]) -> None:
    for group, output in outputs:
        group.put(output)
