"""Concurrency sweep against a running ``qllm serve`` (or any OpenAI-compatible server).

For each concurrency level (1, 2, 4 ... 256 by default) it keeps that many streaming
``/v1/completions`` requests in flight until ``--requests-per-level`` (default: 4 x level, at
least 8) have finished, and reports output throughput plus time-to-first-token (TTFT),
inter-token latency (ITL) and end-to-end latency percentiles: one JSON line per level on
stdout (or ``--jsonl``), and a table on stderr.

    qllm serve --model DIR &
    python benchmarks/http_concurrency.py --base-url http://127.0.0.1:8000 --max-tokens 128

Prompts are random token ids (``--prompt-tokens`` long, distinct per request so the prefix
cache does not help), and ``ignore_eos`` makes every request generate ``--max-tokens`` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import sys
import time

import httpx

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean and nearest-rank percentiles, in milliseconds (None without values)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ordered = sorted(values)
    ranked = {f"p{p}": ordered[min(len(ordered) - 1, max(0, -(-p * len(ordered) // 100) - 1))]
              for p in PERCENTILES}
    return {key: round(value * 1000, 3) for key, value in
            {"mean": sum(ordered) / len(ordered), **ranked}.items()}


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    """Stream one completion; its TTFT, ITLs, latency and token count (or its error)."""
    start = time.perf_counter()
    arrivals, tokens = [], 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {await response.aread()!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk.get("choices", [])):
                    arrivals.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not arrivals:
        return {"error": "no tokens"}
    return {"ttft": arrivals[0] - start, "latency": time.perf_counter() - start,
            "itl": [b - a for a, b in itertools.pairwise(arrivals)], "tokens": tokens}


async def run_level(base_url: str, model: str, concurrency: int, num_requests: int,
                    prompt_tokens: int, max_tokens: int, seed: int = 0) -> dict:
    """Run ``num_requests`` streams, ``concurrency`` at a time; the level's statistics."""
    rng = random.Random(seed + concurrency)
    bodies = [{"model": model, "prompt": [rng.randrange(1000, 30000)
                                          for _ in range(prompt_tokens)],
               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}} for _ in range(num_requests)]
    gate = asyncio.Semaphore(concurrency)

    async def gated(client: httpx.AsyncClient, body: dict) -> dict:
        async with gate:
            return await one_request(client, body)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(gated(client, body) for body in bodies))
        duration = time.perf_counter() - start
    done = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    output_tokens = sum(r["tokens"] for r in done)
    return {"concurrency": concurrency, "requests": num_requests, "errors": len(errors),
            "first_error": errors[0] if errors else None, "duration_s": round(duration, 3),
            "output_tokens": output_tokens,
            "output_tokens_per_s": round(output_tokens / duration, 2),
            "requests_per_s": round(len(done) / duration, 3),
            "ttft_ms": percentiles([r["ttft"] for r in done]),
            "itl_ms": percentiles([gap for r in done for gap in r["itl"]]),
            "latency_ms": percentiles([r["latency"] for r in done])}


def table(rows: list[dict]) -> str:
    """A fixed-width summary of the levels."""
    def ms(row: dict, metric: str, key: str) -> str:
        value = row[metric][key]
        return "-" if value is None else f"{value:.1f}"

    header = (f"{'conc':>5} {'reqs':>5} {'err':>4} {'tok/s':>9} {'req/s':>7} "
              f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} (ms)")
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(f"{row['concurrency']:>5} {row['requests']:>5} {row['errors']:>4} "
                     f"{row['output_tokens_per_s']:>9.1f} {row['requests_per_s']:>7.2f} "
                     f"{ms(row, 'ttft_ms', 'p50'):>9} {ms(row, 'ttft_ms', 'p99'):>9} "
                     f"{ms(row, 'itl_ms', 'p50'):>8} {ms(row, 'itl_ms', 'p99'):>8}")
    return "\n".join(lines)


def served_model(base_url: str) -> str:
    response = httpx.get(f"{base_url}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name (default: the server's first model)")
    parser.add_argument("--levels", default=",".join(map(str, DEFAULT_LEVELS)),
                        help="comma-separated concurrency levels")
    parser.add_argument("--requests-per-level", type=int,
                        help="requests per level (default: max(8, 4 x level))")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", help="write the JSON lines here instead of stdout")
    args = parser.parse_args(argv)

    model = args.model or served_model(args.base_url)
    levels = [int(level) for level in args.levels.split(",")]
    rows = []
    with open(args.jsonl, "w") if args.jsonl else contextlib.nullcontext(sys.stdout) as out:
        for level in levels:
            num_requests = args.requests_per_level or max(8, 4 * level)
            row = asyncio.run(run_level(args.base_url, model, level, num_requests,
                                        args.prompt_tokens, args.max_tokens, args.seed))
            rows.append(row)
            print(json.dumps(row), file=out, flush=True)
    print(table(rows), file=sys.stderr)
    return 1 if any(row["errors"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
