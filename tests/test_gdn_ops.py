"""Gated DeltaNet reference ops: chunked == recurrent, varlen packing, carried state, and
agreement with transformers' own torch reference functions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qllm.ops import gdn
from qllm.testing.batch import recurrent_slot_batch

HK, HV, DK, DV = 2, 4, 16, 8
CONV_DIM, KERNEL = 12, 4
SPLITS = [4, 4, 4]  # the conv channels as q, k, v
NUM_SLOTS = 6
ATOL = 1e-5


A_LOG = torch.linspace(-1.0, 0.5, HV)  # per-head decay rates: model-like decays
DT_BIAS = torch.full((HV,), 1.0)


def gdn_inputs(t: int, gen: torch.Generator, dtype=torch.float32):
    """Raw layer-side inputs: q, k [t, HK, DK] (un-normalised), v [t, HV, DV], the gate inputs
    a, b [t, HV]."""
    q = torch.randn(t, HK, DK, generator=gen).to(dtype)
    k = torch.randn(t, HK, DK, generator=gen).to(dtype)
    v = torch.randn(t, HV, DV, generator=gen).to(dtype)
    a = torch.randn(t, HV, generator=gen).to(dtype)
    b = torch.randn(t, HV, generator=gen).to(dtype)
    return q, k, v, a, b


def op_args(inputs: tuple) -> tuple:
    """``gdn_inputs`` as the ops take them: with the layer's ``A_log`` and ``dt_bias``."""
    return (*inputs, A_LOG, DT_BIAS)


def rule_args(inputs: tuple) -> tuple:
    """``gdn_inputs`` as the recurrences take them: ``q, k, v`` and the gates ``g, beta``."""
    q, k, v, a, b = inputs
    return (q, k, v, *gdn.gdn_gates(a, b, A_LOG, DT_BIAS))


def random_ssm_state(gen):
    return torch.randn(NUM_SLOTS + 1, HV, DK, DV, generator=gen)


LENGTHS = [1, 5, 63, 64, 65, 130, 200]


# ----------------------------------------------------------------------------- chunk vs recurrent

@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("length", LENGTHS, ids=[f"len{n}" for n in LENGTHS])
def test_chunked_equals_recurrent(length, with_state):
    gen = torch.Generator().manual_seed(length)
    q, k, v, g, beta = rule_args(gdn_inputs(length, gen))
    q, k = gdn.prepare_qk(q, k, HV)
    state = torch.randn(HV, DK, DV, generator=gen) if with_state else torch.zeros(HV, DK, DV)
    o_rec, s_rec = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    o_chk, s_chk = gdn.chunk_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(o_chk, o_rec, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(s_chk, s_rec, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, 64], ids=["chunk16", "chunk64"])
def test_chunk_size_does_not_change_result(chunk_size):
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = rule_args(gdn_inputs(100, gen))
    q, k = gdn.prepare_qk(q, k, HV)
    state = torch.randn(HV, DK, DV, generator=gen)
    o_rec, s_rec = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    o, s = gdn.chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_rec, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(s, s_rec, atol=ATOL, rtol=1e-5)


# ----------------------------------------------------------------------------- packed varlen ops

@pytest.mark.parametrize("has_state", [(False, False, False), (True, False, True)],
                         ids=["fresh", "mixed_initial_state"])
def test_prefill_varlen_then_decode_equals_per_sequence_recurrence(has_state):
    """gdn_prefill over packed sequences, then gdn_decode steps, against a token-by-token
    recurrence of each sequence alone; the slots hold the final states."""
    gen = torch.Generator().manual_seed(1)
    lens, slots = [70, 3, 129], [4, 0, 2]
    ssm_state = random_ssm_state(gen)
    before = ssm_state.clone()
    batch = recurrent_slot_batch(lens, slots, list(has_state))
    inputs = gdn_inputs(sum(lens), gen)
    q, k, v, g, beta = rule_args(inputs)
    out = gdn.gdn_prefill(*op_args(inputs), ssm_state, batch)
    assert out.shape == (sum(lens), HV, DV)

    steps = [gdn_inputs(len(lens), gen) for _ in range(3)]
    decode_batch = recurrent_slot_batch([1] * len(lens), slots, [True] * len(lens))
    decode_out = [gdn.gdn_decode(*op_args(step), ssm_state, decode_batch) for step in steps]

    start = 0
    for i, (n, slot) in enumerate(zip(lens, slots)):
        rows = slice(start, start + n)
        start += n
        state = before[slot] if has_state[i] else torch.zeros(HV, DK, DV)
        qq, kk = gdn.prepare_qk(q[rows], k[rows], HV)
        ref, state = gdn.recurrent_gated_delta_rule(qq, kk, v[rows], g[rows], beta[rows], state)
        torch.testing.assert_close(out[rows], ref, atol=ATOL, rtol=1e-5)
        for step, o in zip(steps, decode_out):
            sq, sk, sv, sg, sb = (x[i:i + 1] for x in rule_args(step))
            sq, sk = gdn.prepare_qk(sq, sk, HV)
            ref, state = gdn.recurrent_gated_delta_rule(sq, sk, sv, sg, sb, state)
            torch.testing.assert_close(o[i:i + 1], ref, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(ssm_state[slot], state, atol=ATOL, rtol=1e-5)
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in slots]
    torch.testing.assert_close(ssm_state[untouched], before[untouched], atol=0, rtol=0)


def test_split_prefill_equals_one_prefill():
    """A prompt prefilled in two pieces (chunked prefill) equals one prefill of the whole."""
    gen = torch.Generator().manual_seed(2)
    inputs = gdn_inputs(150, gen)
    whole_state, split_state = random_ssm_state(gen), torch.zeros(NUM_SLOTS + 1, HV, DK, DV)
    whole = gdn.gdn_prefill(*op_args(inputs), whole_state,
                            recurrent_slot_batch([150], [3], [False]))
    first = gdn.gdn_prefill(*op_args(tuple(x[:90] for x in inputs)), split_state,
                            recurrent_slot_batch([90], [3], [False]))
    second = gdn.gdn_prefill(*op_args(tuple(x[90:] for x in inputs)), split_state,
                             recurrent_slot_batch([60], [3], [True]))
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(split_state[3], whole_state[3], atol=ATOL, rtol=1e-5)


def test_decode_without_initial_state_ignores_stale_slot():
    gen = torch.Generator().manual_seed(3)
    step = gdn_inputs(2, gen)
    stale, clean = random_ssm_state(gen), torch.zeros(NUM_SLOTS + 1, HV, DK, DV)
    batch = recurrent_slot_batch([1, 1], [1, 5], [False, False])
    torch.testing.assert_close(gdn.gdn_decode(*op_args(step), stale, batch),
                               gdn.gdn_decode(*op_args(step), clean, batch), atol=0, rtol=0)
    torch.testing.assert_close(stale[[1, 5]], clean[[1, 5]], atol=0, rtol=0)


def test_bf16_inputs_keep_fp32_state():
    gen = torch.Generator().manual_seed(4)
    inputs = gdn_inputs(80, gen, dtype=torch.bfloat16)
    q, k, v, g, beta = rule_args(inputs)
    ssm_state = torch.zeros(NUM_SLOTS + 1, HV, DK, DV)
    out = gdn.gdn_prefill(*op_args(inputs), ssm_state, recurrent_slot_batch([80], [0], [False]))
    assert out.dtype == torch.bfloat16 and ssm_state.dtype == torch.float32
    qq, kk = gdn.prepare_qk(q, k, HV)
    ref, state = gdn.recurrent_gated_delta_rule(qq, kk, v.float(), g, beta.float(),
                                                torch.zeros(HV, DK, DV))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ssm_state[0], state, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- vs transformers

@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("length", [65, 130], ids=["len65", "len130"])
def test_prefill_matches_transformers_chunk_rule(length, with_state):
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = torch.Generator().manual_seed(5)
    inputs = gdn_inputs(length, gen)
    q, k, v, g, beta = rule_args(inputs)
    ssm_state = random_ssm_state(gen)
    init = ssm_state[2].clone()
    out = gdn.gdn_prefill(*op_args(inputs), ssm_state,
                          recurrent_slot_batch([length], [2], [with_state]))
    ref, ref_state = qwen.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None],
        initial_state=init[None] if with_state else None, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref[0], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(ssm_state[2], ref_state[0], atol=ATOL, rtol=1e-5)


def test_decode_matches_transformers_recurrent_rule():
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = torch.Generator().manual_seed(6)
    inputs = gdn_inputs(3, gen)  # 3 sequences, one token each
    q, k, v, g, beta = rule_args(inputs)
    ssm_state = random_ssm_state(gen)
    init = ssm_state[[0, 3, 6]].clone()
    out = gdn.gdn_decode(*op_args(inputs), ssm_state,
                         recurrent_slot_batch([1, 1, 1], [0, 3, 6], [True] * 3))
    ref, ref_state = qwen.torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None],
        initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref[:, 0], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(ssm_state[[0, 3, 6]], ref_state, atol=ATOL, rtol=1e-5)


# ----------------------------------------------------------------------------- causal conv1d

def full_conv_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Straightforward causal depthwise conv of one whole sequence ``x [L, C]`` + SiLU."""
    k = weight.shape[1]
    out = F.conv1d(x.t()[None], weight[:, None, :], padding=k - 1, groups=x.shape[1])
    return F.silu(out[0, :, :x.shape[0]]).t()


@pytest.mark.parametrize("lens", [[1], [2, 9], [3, 70, 5]], ids=["one_token", "two_seqs",
                                                                 "three_seqs_short_and_long"])
def test_conv_prefill_then_updates_equal_full_sequence_conv(lens):
    gen = torch.Generator().manual_seed(len(lens))
    weight = torch.randn(CONV_DIM, KERNEL, generator=gen)
    slots = [5, 1, 3][:len(lens)]
    conv_state = torch.randn(NUM_SLOTS + 1, CONV_DIM, KERNEL - 1, generator=gen)  # stale
    num_decode = 4
    seqs = [torch.randn(n + num_decode, CONV_DIM, generator=gen) for n in lens]

    packed = torch.cat([s[:n] for s, n in zip(seqs, lens)])
    prefill_batch = recurrent_slot_batch(lens, slots, [False] * len(lens))
    q, k, v = gdn.causal_conv1d_prefill(packed, weight, conv_state, prefill_batch, SPLITS)
    assert all(part.is_contiguous() for part in (q, k, v))
    out = torch.cat([q, k, v], dim=-1)
    decode_batch = recurrent_slot_batch([1] * len(lens), slots, [True] * len(lens))
    steps = [gdn.causal_conv1d_update(torch.stack([s[n + j] for s, n in zip(seqs, lens)]),
                                      weight, conv_state, decode_batch)
             for j in range(num_decode)]

    start = 0
    for i, (seq, n) in enumerate(zip(seqs, lens)):
        ref = full_conv_silu(seq, weight)
        torch.testing.assert_close(out[start:start + n], ref[:n], atol=ATOL, rtol=1e-5)
        start += n
        for j, step in enumerate(steps):
            torch.testing.assert_close(step[i], ref[n + j], atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(conv_state[slots[i]], seq[-(KERNEL - 1):].t(), atol=0, rtol=0)


def test_conv_split_prefill_carries_state():
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(CONV_DIM, KERNEL, generator=gen)
    x = torch.randn(40, CONV_DIM, generator=gen)
    conv_state = torch.zeros(NUM_SLOTS + 1, CONV_DIM, KERNEL - 1)
    first_batch, second_batch = (recurrent_slot_batch([2], [0], [False]),
                                 recurrent_slot_batch([38], [0], [True]))
    first = torch.cat(gdn.causal_conv1d_prefill(x[:2], weight, conv_state, first_batch,
                                                SPLITS), -1)
    second = torch.cat(gdn.causal_conv1d_prefill(x[2:], weight, conv_state, second_batch,
                                                 SPLITS), -1)
    torch.testing.assert_close(torch.cat([first, second]), full_conv_silu(x, weight),
                               atol=ATOL, rtol=1e-5)


def test_conv_prefill_matches_transformers_conv_fn():
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(CONV_DIM, KERNEL, generator=gen)
    x = torch.randn(33, CONV_DIM, generator=gen)
    conv_state = torch.zeros(NUM_SLOTS + 1, CONV_DIM, KERNEL - 1)
    out = torch.cat(gdn.causal_conv1d_prefill(x, weight, conv_state,
                                              recurrent_slot_batch([33], [0], [False]), SPLITS), -1)
    ref = qwen.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")
    torch.testing.assert_close(out, ref[0].t(), atol=ATOL, rtol=1e-5)


def test_registered_as_builtin_kernels():
    from qllm.plugins.registry import PluginRegistry

    kernels = PluginRegistry(load_entry_points=False).kernels(torch.device("cpu"), torch.float32)
    for op in ("causal_conv1d_prefill", "causal_conv1d_update", "gdn_prefill", "gdn_decode",
               "gdn_decode_gated_norm"):
        assert getattr(kernels, op) is getattr(gdn, op)
