"""Random Gated DeltaNet inputs for the parity tests and the benchmark, laid out as the model
layer hands them to the ops (``qllm_qwen3_5.deltanet``): the conv input is a column slice of the
fused input projection, ``q, k, v`` are views into the conv output, the gate inputs ``a, b`` are
column slices of the projection's last columns."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from qllm.batch import ForwardBatch
from qllm.testing.batch import recurrent_slot_batch


@dataclass
class GDNGeometry:
    """Head counts and sizes of one GDN layer, and its conv kernel width."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


QWEN3_5_35B_A3B = GDNGeometry(16, 32, 128, 128)


def random_batch(query_lens: list[int], num_slots: int, has_state: bool | list[bool],
                 num_padding: int = 0, device: str | torch.device = "cpu",
                 seed: int = 0) -> ForwardBatch:
    """Sequences in slots drawn out of order from ``range(num_slots)``, then ``num_padding``
    one-token rows in the padding slot ``num_slots`` without state (a CUDA-graph bucket's
    inert rows). ``has_state``: one flag for all sequences, or one each."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:len(query_lens)].tolist()
    flags = has_state if isinstance(has_state, list) else [has_state] * len(query_lens)
    return recurrent_slot_batch(list(query_lens) + [1] * num_padding,
                                slots + [num_slots] * num_padding,
                                list(flags) + [False] * num_padding, device)


@dataclass
class ConvInputs:
    """``x [T, C]`` (a column slice of a wider projection), ``weight [C, K]`` (a view of the
    layer's ``[C, 1, K]`` conv weight), stale-filled ``conv_state [S + 1, C, K - 1]``
    (channel stride 1, as the models store it, unless asked for contiguous)."""

    x: torch.Tensor
    weight: torch.Tensor
    conv_state: torch.Tensor
    batch: ForwardBatch


@dataclass
class GDNInputs:
    """``q, k [T, Hk, dk]`` and ``v [T, Hv, dv]`` raw views into one ``[T, C]`` tensor, gate
    inputs ``a, b [T, Hv]`` (column slices) with the per-head ``A_log, dt_bias [Hv]`` (fp32,
    model-like decays), stale-filled ``ssm_state [S + 1, Hv, dk, dv]`` (key stride 1, as the
    models store it, unless asked for contiguous)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    ssm_state: torch.Tensor
    batch: ForwardBatch

    def args(self) -> tuple:
        """Positional arguments of ``gdn_prefill`` / ``gdn_decode``."""
        return (self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias,
                self.ssm_state, self.batch)


def conv_inputs(batch: ForwardBatch, geometry: GDNGeometry, num_slots: int,
                dtype: torch.dtype, state_dtype: torch.dtype, seed: int = 0,
                contiguous_state: bool = False) -> ConvInputs:
    """Conv inputs for ``batch``'s tokens, on its device. The state is a taps-outer tensor
    seen as ``[S + 1, C, K - 1]``, or with ``contiguous_state`` a contiguous one."""
    device = batch.query_start_loc.device
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens, channels = sum(batch.query_lens_host), geometry.conv_dim

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    projection = randn(tokens, channels + 2 * geometry.num_v_heads)  # [T, C + b/a columns]
    return ConvInputs(
        x=projection[:, :channels],
        weight=randn(channels, 1, geometry.conv_kernel)[:, 0, :],
        conv_state=(randn(num_slots + 1, channels, geometry.conv_kernel - 1, dtype=state_dtype)
                    if contiguous_state else
                    randn(num_slots + 1, geometry.conv_kernel - 1, channels,
                          dtype=state_dtype).transpose(1, 2)),
        batch=batch)


def gdn_inputs(batch: ForwardBatch, geometry: GDNGeometry, num_slots: int,
               dtype: torch.dtype, state_dtype: torch.dtype, seed: int = 0,
               contiguous_state: bool = False) -> GDNInputs:
    """Gated delta rule inputs for ``batch``'s tokens, on its device. The state is a
    value-major ``[S + 1, Hv, dv, dk]`` tensor seen as ``[S + 1, Hv, dk, dv]``, or with
    ``contiguous_state`` a contiguous one."""
    device = batch.query_start_loc.device
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = sum(batch.query_lens_host)
    hk, hv, dk, dv = (geometry.num_k_heads, geometry.num_v_heads, geometry.head_k_dim,
                      geometry.head_v_dim)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    conv_out = randn(tokens, geometry.conv_dim).to(dtype)  # [T, C] = [q | k | v]
    q, k, v = conv_out.split([hk * dk, hk * dk, hv * dv], dim=-1)
    gates = randn(tokens, 2 * hv).to(dtype)  # [T, 2 Hv] = [b | a], as the projection's tail
    # g = -exp(A_log) * softplus(a + dt_bias), a ~ N(0, 1), dt_bias = -1: typical per-token
    # decays exp(g) from ~0.99 (first head) to ~0.3 (last head)
    return GDNInputs(
        q=q.unflatten(-1, (hk, dk)), k=k.unflatten(-1, (hk, dk)), v=v.unflatten(-1, (hv, dv)),
        a=gates[:, hv:], b=gates[:, :hv], A_log=torch.linspace(-4.0, 1.0, hv, device=device),
        dt_bias=torch.full((hv,), -1.0, device=device),
        ssm_state=((0.5 * randn(num_slots + 1, hv, dk, dv)).to(state_dtype)
                   if contiguous_state else
                   (0.5 * randn(num_slots + 1, hv, dv, dk)).to(state_dtype).transpose(-1, -2)),
        batch=batch)


def norm_inputs(tokens: int, heads: int, dim: int, dtype: torch.dtype, device: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, H, D]`` (as the recurrence returns it), ``gate [T, H, D]`` (a column slice of a
    wider projection output, as the layer's ``z``) and a perturbed ``weight [D]``."""
    generator = torch.Generator().manual_seed(tokens * heads + dim)
    x = torch.randn(tokens, heads, dim, generator=generator).to(device, dtype)
    projection = torch.randn(tokens, 3 * heads * dim + 5, generator=generator)
    gate = projection.to(device, dtype)[:, heads * dim:2 * heads * dim].unflatten(-1, (heads, dim))
    weight = (1 + 0.1 * torch.randn(dim, generator=generator)).to(device, dtype)
    return x, gate, weight


# ----------------------------------------------------------------------------- checks

# Largest error allowed, relative to the reference's largest magnitude, by the coarser of the
# activation and state dtypes (the Triton kernels compute in fp32 throughout).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
STATE_DTYPES = {"state_fp32": torch.float32, "state_bf16": torch.bfloat16}
GPU_GEOMETRIES = {
    "qwen3.5-35b": QWEN3_5_35B_A3B,           # 16 key / 32 value heads x 128, conv 4
    "mha-d64": GDNGeometry(4, 4, 64, 64),
    "gqa4-dv96-k3": GDNGeometry(2, 8, 128, 96, conv_kernel=3),  # dv not a power of two
}


def has_state_flags(count: int, has_state: str) -> list[bool]:
    """``random_batch``'s flags: ``fresh``, no sequence has state yet; ``mixed``, two in three
    have."""
    return [has_state == "mixed" and i % 3 != 1 for i in range(count)]


def conv_state_tolerance(state_dtype: torch.dtype) -> float:
    """Conv states are copied inputs: exact, except that the Triton interpreter rounds fp32 ->
    bf16 toward zero where GPUs (and torch) round to nearest even, one bf16 ulp apart."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return 2 ** -7 if interpreting and state_dtype == torch.bfloat16 else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Same dtype and shape, and within ``tol`` relative to ``expected``'s largest magnitude
    (at least 1)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    atol = tol * max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=tol)


def assert_states(actual: torch.Tensor, expected: torch.Tensor, before: torch.Tensor,
                  batch: ForwardBatch, tol: float) -> None:
    """Batch slots close to the reference's, other slots untouched; padding slot skipped."""
    padding = actual.shape[0] - 1
    used = sorted(set(batch.caches["recurrent_slot"].slots.tolist()) - {padding})
    unused = sorted(set(range(padding)) - set(used))
    assert_close(actual[used], expected[used], tol)
    assert torch.equal(actual[unused], before[unused])
