"""fla_configs: the configs fla's autotuned kernels picked, written in fla's format, are read
back by fla's own autotuner (no benchmark for a key found there, the usual autotuning for any
other), and fla is pointed at the configs shipped for a GPU only where that is safe. No GPU: the
kernel's launches are recorded instead of run, its timings come from a stub."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from qllm_kernels_gdn import fla_configs  # noqa: E402

KERNEL_NAME = "fla_configs_test_kernel"


def _import_fla_cache():
    """fla's config cache module, imported although the suite hides fla on a CPU (conftest.py:
    transformers' reference would take fla's GPU kernels), and hidden again afterwards."""
    hidden = "fla" in sys.modules and sys.modules["fla"] is None
    if hidden:
        del sys.modules["fla"]
    try:
        return pytest.importorskip(fla_configs.FLA_CACHE_MODULE)
    finally:
        if hidden:
            sys.modules["fla"] = None


fla_cache = _import_fla_cache()


def _fla_autotuned(events: list, fastest_block: int):
    """An fla-autotuned kernel of two configs (``BLOCK`` 16 and 32) keyed by ``n``, whose
    launches append ``BLOCK`` to ``events`` and whose stub benchmark finds ``fastest_block``
    fastest."""
    import triton.language as tl

    def kernel(x_ptr, n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), 0.0)

    kernel.__name__ = kernel.__qualname__ = KERNEL_NAME
    jitted = triton.jit(kernel)
    launched = []

    def run(*args, grid, warmup, **kwargs):
        launched.append(kwargs["BLOCK"])
        events.append(kwargs["BLOCK"])

    def bench(call, quantiles):
        call()
        return [1.0 if launched[-1] == fastest_block else 2.0] * 3

    jitted.run = run
    configs = [triton.Config({"BLOCK": 16}, num_warps=2), triton.Config({"BLOCK": 32})]
    tuner = fla_cache.fla_cache_autotune(configs, key=["n"], do_bench=bench)(jitted)
    tuner.cache_results = False  # no Triton disk cache (it needs a GPU target)
    return tuner


def test_written_configs_are_read_back_by_flas_autotuner(tmp_path, monkeypatch):
    tuned = _fla_autotuned([], fastest_block=32)
    tuned[(1,)](None, 64)
    tuned[(1,)](None, 128)
    [path] = fla_configs.write_configs(tmp_path / "GPU", [tuned])
    assert path == tmp_path / "GPU" / f"{KERNEL_NAME}.json"
    written = json.loads(path.read_text())
    assert written["kernel_name"] == KERNEL_NAME and written["triton_version"] == triton.__version__
    assert sorted(entry["autotune_key"][0] for entry in written["autotune_entries"].values()) \
        == [64, 128]
    assert all(entry["config"]["kwargs"] == {"BLOCK": 32} and entry["config"]["num_warps"] == 4
               for entry in written["autotune_entries"].values())

    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.STRICT)
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path / "GPU"))
    events = []
    fresh = _fla_autotuned(events, fastest_block=16)  # a new process's view: nothing tuned
    fresh[(1,)](None, 64)
    assert events == [32]  # the written config, launched once: no benchmark
    fresh[(1,)](None, 256)  # a key not written: benchmarked, the stub's fastest taken
    assert events[1:] == [16, 32, 16]


def test_configs_are_shipped_as_package_data():
    from pathlib import Path

    pyproject = Path(fla_configs.__file__).parents[1] / "pyproject.toml"
    assert '"fla_configs/*/*.json"' in pyproject.read_text()
    for folder in fla_configs.CONFIG_ROOT.glob("*"):  # each shipped file in fla's format
        for path in folder.glob("*.json"):
            data = json.loads(path.read_text())
            assert data["kernel_name"] == path.stem and data["autotune_entries"]


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A shipped folder for a GPU named "Test GPU 1", fla's variables unset and fla not
    imported (as before the first prefill); the environment is restored afterwards."""
    (tmp_path / "Test_GPU_1").mkdir()
    monkeypatch.setattr(fla_configs, "CONFIG_ROOT", tmp_path)
    for name in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR", "QLLM_FLA_CONFIGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, fla_configs.FLA_CACHE_MODULE)
    return tmp_path / "Test_GPU_1"


def test_fla_is_pointed_at_the_folder_shipped_for_the_gpu(shipped):
    assert fla_configs.gpu_folder_name("Test GPU 1") == "Test_GPU_1"
    assert fla_configs.use_shipped_configs("NVIDIA H100 80GB HBM3") is None  # none shipped
    assert "FLA_CACHE_MODE" not in os.environ
    assert fla_configs.use_shipped_configs("Test GPU 1") == shipped
    assert os.environ["FLA_CACHE_MODE"] == "strict"
    assert os.environ["FLA_CONFIG_DIR"] == str(shipped)


@pytest.mark.parametrize("setting", [{"QLLM_FLA_CONFIGS": "0"}, {"FLA_CACHE_MODE": "fuzzy"},
                                     {"FLA_CONFIG_DIR": "/elsewhere"}])
def test_the_switch_and_the_users_own_fla_settings_stand(shipped, monkeypatch, setting):
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    assert fla_configs.use_shipped_configs("Test GPU 1") is None
    assert {name: os.environ.get(name) for name in fla_configs.FLA_ENV} \
        == {name: setting.get(name) for name in fla_configs.FLA_ENV}


def test_fla_imported_first_is_left_alone_with_a_warning(shipped, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, fla_configs.FLA_CACHE_MODULE, fla_cache)
    assert fla_configs.use_shipped_configs("Test GPU 1") is None
    assert "FLA_CACHE_MODE" not in os.environ
    assert "imported before" in caplog.text


def test_fla_imported_afterwards_reads_the_shipped_folder(tmp_path):
    """The contract with fla itself, in a fresh interpreter: the variables set before its
    import put it in strict mode on the shipped folder."""
    (tmp_path / "Test_GPU_1").mkdir()
    script = (
        "import pathlib\n"
        "from qllm_kernels_gdn import fla_configs\n"
        f"fla_configs.CONFIG_ROOT = pathlib.Path({str(tmp_path)!r})\n"
        "assert fla_configs.use_shipped_configs('Test GPU 1') is not None\n"
        "from fla.ops.utils import cache\n"
        "print(cache.FLA_CACHE_MODE.value, cache.get_fla_config_dir())\n")
    env = {name: value for name, value in os.environ.items()
           if name not in fla_configs.FLA_ENV + (fla_configs.SWITCH_ENV,)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["strict", str(tmp_path / "Test_GPU_1")]
