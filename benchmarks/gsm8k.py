"""GSM8K accuracy, scored as lm-evaluation-harness's ``gsm8k`` task (version 3) scores it.

    python benchmarks/gsm8k.py --data test.jsonl --fewshot-data train.jsonl --model DIR
    python benchmarks/gsm8k.py --data test.jsonl --fewshot-data train.jsonl \
        --base-url http://127.0.0.1:8000 --served-model NAME          # a running `qllm serve`

The data are local JSONL files of ``{"question": ..., "answer": "... #### 42"}`` lines (the
format of the GSM8K release); nothing is downloaded. The conventions, as in lm-eval:

- the prompt is ``num_fewshot`` (5) solved examples, the first of ``--fewshot-data`` (lm-eval's
  ``first_n`` sampler), each ``"Question: {q}\\nAnswer: {a}"``, joined by blank lines, then
  ``"Question: {q}\\nAnswer:"``;
- greedy decoding, stopped at ``"Question:"``, ``"</s>"`` or ``"<|im_end|>"``;
- ``strict-match`` takes the first ``#### N`` of the completion; ``flexible-extract`` the last
  number in it; either is an exact match with the reference's ``#### N`` after removing
  commas, ``$``, everything up to ``#### `` and a final period, ignoring case.

Prints one JSON line: the accuracy of both filters, the number of questions, the seconds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

STOP = ["Question:", "</s>", "<|im_end|>"]
INVALID = "[invalid]"
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORED = [re.compile(pattern) for pattern in (",", r"\$", r"(?s).*#### ", r"\.$")]

Generate = Callable[[list[str]], list[str]]  # prompts -> completions, in order


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the worked solution, ending in "#### N"


def load_problems(path: str) -> list[Problem]:
    """The problems of a GSM8K-format JSONL file; a clear error for a malformed line."""
    problems = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                problems.append(Problem(record["question"], record["answer"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: expected a JSON object with 'question' "
                                 f"and 'answer' ({exc})") from None
    return problems


def build_prompt(shots: Sequence[Problem], question: str) -> str:
    """lm-eval's few-shot prompt: solved ``shots``, then ``question`` to answer."""
    solved = [f"Question: {shot.question}\nAnswer: {shot.answer}" for shot in shots]
    return "\n\n".join([*solved, f"Question: {question}\nAnswer:"])


def extract(completion: str, pattern: re.Pattern, last: bool) -> str:
    """The first (or ``last``) match of ``pattern`` in ``completion``, else ``[invalid]``."""
    matches = pattern.findall(completion)
    if not matches:
        return INVALID
    match = matches[-1 if last else 0]
    if isinstance(match, tuple):  # alternatives: the group that matched
        match = next(group for group in match if group)
    return match.strip()


def normalize(text: str) -> str:
    for pattern in IGNORED:
        text = pattern.sub("", text)
    return text.strip().lower()


def score(completion: str, reference: str) -> dict[str, bool]:
    """Exact match of each filter's answer with the reference solution's ``#### N``."""
    target = normalize(reference)
    return {"strict-match": normalize(extract(completion, STRICT, last=False)) == target,
            "flexible-extract": normalize(extract(completion, FLEXIBLE, last=True)) == target}


def evaluate(problems: Sequence[Problem], shots: Sequence[Problem], generate: Generate,
             batch_size: int = 64, use_tqdm: bool = True) -> dict:
    """Accuracy over ``problems``; ``records`` holds each completion and its scores."""
    records = []
    with tqdm(total=len(problems), desc="GSM8K", unit="q", disable=not use_tqdm) as bar:
        for start in range(0, len(problems), batch_size):
            batch = problems[start:start + batch_size]
            completions = generate([build_prompt(shots, p.question) for p in batch])
            for problem, completion in zip(batch, completions):
                records.append({"question": problem.question, "completion": completion,
                                **score(completion, problem.answer)})
            correct = sum(r["strict-match"] for r in records)
            bar.set_postfix_str(f"strict {correct / len(records):.3f}")
            bar.update(len(batch))
    count = max(len(records), 1)
    return {"num_questions": len(records),
            "strict-match": sum(r["strict-match"] for r in records) / count,
            "flexible-extract": sum(r["flexible-extract"] for r in records) / count,
            "records": records}


def offline_generator(llm, max_tokens: int) -> Generate:
    """Greedy completions through ``LLM.generate``."""
    from qllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=STOP)

    def generate(prompts: list[str]) -> list[str]:
        return [out["text"] for out in llm.generate(prompts, params, use_tqdm=False)]

    return generate


def server_generator(base_url: str, model: str, max_tokens: int, concurrency: int,
                     timeout: float = 600.0) -> Generate:
    """Greedy completions from a running OpenAI-compatible server (``/v1/completions``),
    ``concurrency`` requests at a time."""
    url = base_url.rstrip("/") + "/v1/completions"

    def complete(prompt: str) -> str:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "stop": STOP}).encode()
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)["choices"][0]["text"]

    def generate(prompts: list[str]) -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(complete, prompts))

    return generate


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", required=True, help="JSONL of the questions to score")
    parser.add_argument("--fewshot-data", help="JSONL the few-shot examples come from (its "
                        "first --num-fewshot); without it they are the first of --data, "
                        "which are then not scored")
    parser.add_argument("--num-fewshot", type=int, default=5)
    parser.add_argument("--limit", type=int, help="score only the first N questions")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--model", help="checkpoint directory to load with qllm.LLM")
    parser.add_argument("--dtype", default=None, help="with --model")
    parser.add_argument("--max-model-len", type=int, default=None, help="with --model")
    parser.add_argument("--base-url", help="a running server instead of --model")
    parser.add_argument("--served-model", help="the model name the server serves")
    parser.add_argument("--concurrency", type=int, default=64, help="with --base-url")
    parser.add_argument("--output", help="write each question's completion and scores here "
                        "(JSONL)")
    args = parser.parse_args(argv)
    if (args.model is None) == (args.base_url is None):
        parser.error("give exactly one of --model and --base-url")
    if args.base_url and not args.served_model:
        parser.error("--base-url needs --served-model")
    if args.num_fewshot < 0:
        parser.error("--num-fewshot must be >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    problems = load_problems(args.data)
    if args.fewshot_data:
        shots = load_problems(args.fewshot_data)[:args.num_fewshot]
    else:
        shots, problems = problems[:args.num_fewshot], problems[args.num_fewshot:]
    if len(shots) < args.num_fewshot:
        sys.exit(f"gsm8k: error: only {len(shots)} few-shot examples for "
                 f"--num-fewshot {args.num_fewshot}")
    problems = problems[:args.limit]
    if args.model:
        from qllm import LLM

        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
        generate = offline_generator(llm, args.max_tokens)
    else:
        generate = server_generator(args.base_url, args.served_model, args.max_tokens,
                                    args.concurrency)
    start = time.perf_counter()
    result = evaluate(problems, shots, generate)
    records = result.pop("records")
    result["seconds"] = round(time.perf_counter() - start, 2)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            file.writelines(json.dumps(record) + "\n" for record in records)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
