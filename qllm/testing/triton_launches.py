"""Compile every Triton kernel launch of the interpreter tests for the GPU (sm_90), on a CPU.

The interpreter runs a kernel as Python over NumPy, and accepts code that Triton's compiler
rejects (a plain global read inside a kernel, for one): a kernel can pass every interpreted
test and still fail to compile on the GPU. ``record_launches``, switched on in the interpreter
run by ``LOG_ENV``, writes each launch of a qllm kernel as a JSON line: the kernel, its
argument types, its constexpr values and the launch options. ``compile_launches`` then compiles
each distinct launch through Triton's ahead-of-time path for an sm_90 target (the triton wheel
ships ptxas), without a GPU. Run as a script on a log:
``python -m qllm.testing.triton_launches LOG``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

LOG_ENV = "QLLM_TRITON_LAUNCH_LOG"
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
RECORDED_MODULES = "qllm"  # the project's kernels: qllm and its plugins (qllm_kernels_*)


def record_launches(log_path: str) -> None:
    """From now on, append each interpreted launch of a qllm kernel to ``log_path``."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith(RECORDED_MODULES):
            with open(log_path, "a") as log:
                log.write(json.dumps(describe_launch(self.fn, args, kwargs), sort_keys=True)
                          + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def describe_launch(fn, args: tuple, kwargs: dict) -> dict:
    """The kernel ``fn``'s launch with ``args`` and ``kwargs`` as JSON: module and name, the
    type of each runtime argument (Triton's names: ``*bf16``, ``i32``...), the constexpr
    values (``None`` arguments are constexprs too) and the launch options."""
    from triton.runtime.jit import mangle_type

    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in LAUNCH_OPTIONS if name in kwargs}
    parameters = inspect.signature(fn).parameters
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for name, value in bound.arguments.items():
        if "constexpr" in str(parameters[name].annotation) or value is None:
            if not isinstance(value, (bool, int, float, str, type(None))):
                raise TypeError(f"{fn.__name__}: constexpr {name}={value!r} is not a plain "
                                f"value the launch log can hold")
            constexprs[name] = value
        else:
            signature[name] = mangle_type(value)
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": signature,
            "constexprs": constexprs, "options": options}


def compile_launches(log_path: str) -> tuple[int, list[str]]:
    """Compile each distinct launch in ``log_path`` for sm_90, on every CPU core: the number
    of launches and one message per launch that failed to compile."""
    launches = set(Path(log_path).read_text().splitlines())
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        failures = [failure for failure in pool.map(_compile, sorted(launches)) if failure]
    return len(launches), failures


def _compile(line: str) -> str | None:
    """Compile the launch of one log line for sm_90: ``None``, or why it failed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    launch = json.loads(line)
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    while not isinstance(kernel, JITFunction):  # under triton.autotune / heuristics
        kernel = kernel.fn
    names = kernel.arg_names
    signature = {name: launch["signature"].get(name, "constexpr") for name in names}
    constexprs = {(names.index(name),): value for name, value in launch["constexprs"].items()}
    try:
        triton.compile(ASTSource(kernel, signature, constexprs),
                       target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as error:  # every failure is reported, with its launch
        return (f"{launch['module']}.{launch['kernel']} constexprs {launch['constexprs']} "
                f"options {launch['options']}: {type(error).__name__}: {error}")
    return None


def main() -> int:
    count, failures = compile_launches(sys.argv[1])
    print(f"{count} distinct kernel launches compiled for sm_90, {len(failures)} failed")
    for failure in failures:
        print(failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
