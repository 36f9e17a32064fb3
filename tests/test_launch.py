"""``qllm.launch.use_pdl``: programmatic dependent launch only with ``QLLM_PDL=1`` (off by
default until measured on the H200), and only on Hopper-class CUDA devices. (Its kernels' PDL
variants compile for sm_90 in each kernel test file's interpreter run: ``triton_launches``.)"""

from __future__ import annotations

import torch

from qllm import launch


def test_no_pdl_off_cuda(monkeypatch):
    monkeypatch.setenv(launch.PDL_ENV, "1")
    assert not launch.use_pdl(torch.device("cpu"))


def test_pdl_follows_the_switch_and_the_device(monkeypatch):
    supported = {0: True, 1: False}
    monkeypatch.setattr(launch, "_supports_pdl", lambda index: supported[index])
    monkeypatch.delenv(launch.PDL_ENV, raising=False)
    assert not launch.use_pdl(torch.device("cuda", 0))  # off by default
    monkeypatch.setenv(launch.PDL_ENV, "1")
    assert launch.use_pdl(torch.device("cuda", 0))
    assert not launch.use_pdl(torch.device("cuda", 1))  # older than compute capability 9.0
    monkeypatch.setenv(launch.PDL_ENV, "0")
    assert not launch.use_pdl(torch.device("cuda", 0))
