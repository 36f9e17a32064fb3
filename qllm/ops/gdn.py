"""Plain-torch reference kernels for Gated DeltaNet (CPU-correct; the GPU kernels' oracle).

Five ops, registered in ``qllm.plugins.builtins`` under these names:

- ``causal_conv1d_prefill`` / ``causal_conv1d_update``: the depthwise causal conv over the
  ``[q | k | v]`` channels, **with the SiLU applied inside** (as ``causal_conv1d_fn(...,
  activation="silu")`` does), carrying each sequence's last ``K - 1`` inputs between steps.
  Prefill returns q, k and v as separate contiguous tensors (chunked kernels read them so);
  decode returns ``[B, C]``, whose column views the recurrent kernel reads in place.
- ``gdn_prefill`` (chunked form, chunk 64) / ``gdn_decode`` (recurrent single step): the gated
  delta rule; ``gdn_decode_gated_norm``: ``gdn_decode`` and the layer's gated RMSNorm after it.

Split of work between the model layer and these ops (matching transformers'
``Qwen3_5GatedDeltaNet`` with ``use_qk_l2norm_in_kernel=True``, and fla's kernel API):

- the **layer** projects, runs the conv op, and splits ``q, k [T, Hk, dk]`` and
  ``v [T, Hv, dv]`` (raw, *not* normalised, *not* expanded) and the gate columns ``a, b
  [T, Hv]`` of its input projection;
- the **gdn ops** take those with the layer's per-head ``A_log, dt_bias [Hv]`` and compute the
  gates in fp32 (``gdn_gates``: ``g = -exp(A_log) * softplus(a + dt_bias)``, the log decay, and
  ``beta = sigmoid(b)``), so a kernel can fuse them; they L2-normalise q and k in fp32
  (``x * rsqrt(sum(x^2) + 1e-6)``), expand the ``Hk`` key heads to ``Hv`` with
  ``repeat_interleave`` (consecutive value heads share a key head), scale q by ``dk ** -0.5``,
  and run the recurrence in fp32.

State layout, per linear-attention layer: ``conv_state [S + 1, C, K - 1]`` (``C`` = conv_dim;
any strides: the models store it taps-outer, channel stride 1) and ``ssm_state
[S + 1, Hv, dk, dv]`` (any strides: the models store it value-major, key stride 1; slot ``S``
is the padding slot). The slots come with the batch's ``recurrent_slot`` fields,
``batch.caches["recurrent_slot"]`` (``qllm.cache.recurrent_slots.RecurrentSlotBatch``):
sequence ``i`` owns slot ``slots[i]``; where ``has_initial_state[i]`` is False its state is read
as zeros (a reused slot never leaks its previous owner's state). Every op writes the state
after its last token back into the slot.

Recurrence per value head with state ``S [dk, dv]``::

    S = S * exp(g_t);  delta = beta_t * (v_t - k_t^T S);  S = S + k_t (x) delta;  o_t = q_t^T S
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qllm.batch import ForwardBatch
from qllm.ops.norm import rms_norm_gated

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------- causal conv1d

def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                          batch: ForwardBatch, split_sizes: list[int]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over packed new tokens ``x [T, C]`` with ``weight [C, K]``.

    Each sequence's tokens are prefixed by its carried inputs ``conv_state[slot] [C, K-1]``
    (zeros where ``has_initial_state`` is False); its last ``K - 1`` inputs are written back.
    Computed in fp32, returned in ``x.dtype`` as the three channel groups ``split_sizes``
    (summing to ``C``: the layer's q, k, v), each a contiguous ``[T, size]`` tensor, the layout
    chunked GDN kernels read. Uses host values (eager).
    """
    out = torch.empty_like(x)
    width = weight.shape[1] - 1
    cache = batch.caches["recurrent_slot"]
    starts = batch.query_start_loc.tolist()
    slots = cache.slots.tolist()
    has_state = cache.has_initial_state.tolist()
    w = weight.float()[:, None, :]  # [C, 1, K]
    for i, slot in enumerate(slots):
        start, end = starts[i], starts[i + 1]
        if has_state[i]:
            prefix = conv_state[slot].float()  # [C, K-1]
        else:
            prefix = x.new_zeros(x.shape[1], width, dtype=torch.float32)
        window = torch.cat([prefix, x[start:end].float().t()], dim=1)  # [C, K-1+L]
        if end > start:  # a sequence of no new tokens (a graph's inert row) keeps its prefix
            conv = F.conv1d(window[None], w, groups=x.shape[1])[0]  # [C, L]
            out[start:end] = F.silu(conv).t().to(x.dtype)
        conv_state[slot] = window[:, window.shape[1] - width:].to(conv_state.dtype)
    q, k, v = (part.contiguous() for part in out.split(split_sizes, dim=-1))
    return q, k, v


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         batch: ForwardBatch) -> torch.Tensor:
    """One new token per sequence, ``x [B, C]``: conv + SiLU against the carried state, which
    is shifted in place. Tensor-only (no host sync), CUDA-graph capturable. Returns ``[B, C]``."""
    cache = batch.caches["recurrent_slot"]
    slots = cache.slots  # [B]
    state = conv_state[slots].float()  # [B, C, K-1]
    state = torch.where(cache.has_initial_state[:, None, None], state, 0.0)
    window = torch.cat([state, x.float()[:, :, None]], dim=2)  # [B, C, K]
    out = F.silu((window * weight.float()).sum(-1))  # [B, C]
    conv_state.index_copy_(0, slots, window[:, :, 1:].to(conv_state.dtype))
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- gated delta rule

def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (fla's / transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``a, b [T, Hv]`` and per-head ``A_log, dt_bias [Hv]`` -> ``(g, beta)``, both ``[T, Hv]``
    fp32: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 l2norm of ``q, k [..., Hk, dk]``, expansion to ``Hv`` heads (consecutive value
    heads share a key head), and ``q *= dk ** -0.5``. Returns two ``[..., Hv, dk]`` fp32."""
    q, k = l2norm(q.float()), l2norm(k.float())
    ratio = num_v_heads // k.shape[-2]
    if ratio != 1:
        q = q.repeat_interleave(ratio, dim=-2)
        k = k.repeat_interleave(ratio, dim=-2)
    return q * q.shape[-1] ** -0.5, k


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule over one sequence (or a batch of single steps).

    ``q, k [L, H, dk]`` already normalised/expanded/scaled, ``v [L, H, dv]``, ``g, beta [L, H]``,
    ``state [H, dk, dv]`` (all fp32). Returns ``(o [L, H, dv], final state [H, dk, dv])``.
    """
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", state, k[t])  # [H, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]  # [H, dv]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outs), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, chunk_size: int = CHUNK_SIZE
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over one sequence; same contract as
    ``recurrent_gated_delta_rule`` (fla's naive chunk reference / transformers'
    ``torch_chunk_gated_delta_rule``).

    Within a chunk the delta-rule updates are folded into a unit-lower-triangular solve (the
    UT transform); across chunks the state is carried sequentially.
    """
    length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -length % chunk_size
    # heads first, padded to whole chunks: padding has k = v = beta = g = 0, a no-op on the state
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, Lp, d]
    g, beta = (F.pad(x.t(), (0, pad)) for x in (g, beta))  # [H, Lp]
    n = (length + pad) // chunk_size
    q, k, v = (x.reshape(heads, n, chunk_size, x.shape[-1]) for x in (q, k, v))  # [H, N, C, d]
    g, beta = g.reshape(heads, n, chunk_size), beta.reshape(heads, n, chunk_size)  # [H, N, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    cum_g = g.cumsum(-1)  # [H, N, C], log decay from chunk start to each position
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_g_i - cum_g_j) for j <= i, else 0
    decay = (cum_g[..., :, None] - cum_g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # UT transform: (I + strictly_lower(diag(beta) K K^T * decay)) [u | w] = [V_beta | K_beta e^g]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [H, N, C, C]
    system = system.tril(-1) + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum_g.exp()[..., None], upper=False,
                                      unitriangular=True)  # [H, N, C, dk]
    attn = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C], intra-chunk q.k with decay
    q_decayed = q * cum_g.exp()[..., None]  # reads the state at chunk start
    k_to_end = k * (cum_g[..., -1:] - cum_g).exp()[..., None]  # decay from position to chunk end
    chunk_decay = cum_g[..., -1].exp()  # [H, N]

    out = torch.empty(heads, n, chunk_size, dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state  # [H, C, dv], the part the old state does not predict
        out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ v_new
        state = state * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, dv)[:, :length].transpose(0, 1), state


def _initial_states(ssm_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """fp32 ``[B, Hv, dk, dv]`` states of the batch's slots, zeros where there is none yet."""
    cache = batch.caches["recurrent_slot"]
    state = ssm_state[cache.slots].float()
    return torch.where(cache.has_initial_state[:, None, None, None], state, 0.0)


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                ssm_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Chunked gated delta rule over packed variable-length sequences.

    ``q, k [T, Hk, dk]`` raw (normalised, expanded and scaled here), ``v [T, Hv, dv]``, gate
    inputs ``a, b [T, Hv]`` with ``A_log, dt_bias [Hv]`` (see ``gdn_gates``). Starts each
    sequence from its slot of ``ssm_state [S+1, Hv, dk, dv]`` and writes the final state back.
    Returns ``o [T, Hv, dv]`` in ``v.dtype``. Eager only.
    """
    out_dtype = v.dtype
    q, k = prepare_qk(q, k, v.shape[1])  # [T, Hv, dk] fp32
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # [T, Hv] each
    v = v.float()
    states = _initial_states(ssm_state, batch)  # [B, Hv, dk, dv]
    out = torch.empty_like(v)  # [T, Hv, dv]
    starts = batch.query_start_loc.tolist()
    for i in range(len(starts) - 1):
        rows = slice(starts[i], starts[i + 1])
        out[rows], states[i] = chunk_gated_delta_rule(q[rows], k[rows], v[rows], g[rows],
                                                      beta[rows], states[i])
    ssm_state.index_copy_(0, batch.caches["recurrent_slot"].slots, states.to(ssm_state.dtype))
    return out.to(out_dtype)


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               ssm_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """One recurrent step per sequence: ``q, k [B, Hk, dk]`` raw, ``v [B, Hv, dv]``, gate
    inputs ``a, b [B, Hv]`` with ``A_log, dt_bias [Hv]``; updates
    ``ssm_state[slots]`` in place. Tensor-only (no host sync), CUDA-graph
    capturable. Returns ``o [B, Hv, dv]``."""
    out_dtype = v.dtype
    q, k = prepare_qk(q, k, v.shape[1])  # [B, Hv, dk] fp32
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # [B, Hv] each
    v = v.float()
    state = _initial_states(ssm_state, batch) * g.exp()[:, :, None, None]  # [B, Hv, dk, dv]
    kv_mem = torch.einsum("bhkv,bhk->bhv", state, k)  # [B, Hv, dv]
    delta = (v - kv_mem) * beta[:, :, None]
    state = state + k[:, :, :, None] * delta[:, :, None, :]
    out = torch.einsum("bhkv,bhk->bhv", state, q)  # [B, Hv, dv]
    ssm_state.index_copy_(0, batch.caches["recurrent_slot"].slots, state.to(ssm_state.dtype))
    return out.to(out_dtype)


def gdn_decode_gated_norm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                          b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                          ssm_state: torch.Tensor, batch: ForwardBatch, gate: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``gdn_decode``, its output ``o [B, Hv, dv]`` then through the layer's gated RMSNorm
    (``rms_norm_gated(o, gate, norm_weight, eps)``, ``gate [B, Hv, dv]``, ``norm_weight [dv]``):
    a decode step of a Gated DeltaNet layer up to its output projection. Returns ``[B, Hv, dv]``
    in ``v.dtype``."""
    out = gdn_decode(q, k, v, a, b, A_log, dt_bias, ssm_state, batch)
    return rms_norm_gated(out, gate, norm_weight, eps)
