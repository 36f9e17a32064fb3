"""``qllm serve`` as its own process: SIGINT / SIGTERM end in-flight streams cleanly (finished,
or aborted after the grace period, either way closed with ``[DONE]``) and the process exits."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from server_fixtures import MAX_MODEL_LEN, MODEL_NAME, tiny_model_dir  # noqa: F401


def start_server(model_dir: str) -> tuple[subprocess.Popen, str]:
    """Start ``python -m qllm.cli.serve`` on a free port; return it and its base URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "qllm.cli.serve", "--model", model_dir, "--port", "0",
         "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
         "--shutdown-timeout", "0.5"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr],
                     daemon=True).start()  # keeps draining the pipe until the process ends
    log, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            log.append(lines.get(timeout=1))
        except queue.Empty:
            assert process.poll() is None, "the server died while starting:\n" + "".join(log)
            continue
        match = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log[-1])
        if match:
            return process, match.group(1)
    process.kill()
    raise AssertionError("the server did not start:\n" + "".join(log))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_ends_streams_cleanly_and_exits(tiny_model_dir, sig):  # noqa: F811
    process, base_url = start_server(tiny_model_dir)
    try:
        body = {"model": MODEL_NAME, "prompt": "Count slowly", "max_tokens": 90, "n": 4,
                "ignore_eos": True, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body,
                          timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 2:  # generation is under way
                    process.send_signal(sig)
        assert events[-1] == "[DONE]"
        reasons = [choice["finish_reason"] for event in events[:-1]
                   for choice in json.loads(event)["choices"] if choice["finish_reason"]]
        assert reasons == ["length"] * 4  # finished or aborted: cut short either way
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
