"""The Gated DeltaNet layer (``linear_attn.*``): linear attention with a carried recurrent state.

Per step: one fused input projection -> causal depthwise conv1d + SiLU over ``[q | k | v]``
(op ``causal_conv1d_prefill`` / ``causal_conv1d_update``) -> gated delta rule (op
``gdn_prefill`` chunked; the ops compute the ``g``/``beta`` gates from ``a``/``b``,
L2-normalise q/k, expand key heads and scale q, see ``qllm.ops.gdn``) -> gated RMSNorm with
``z`` (``rms_norm_gated``) -> ``out_proj``. In decode the recurrent step and the norm are one
op, ``gdn_decode_gated_norm`` (one kernel in small steps). The conv and SSM states live in
this layer's ``recurrent_slot`` cache.
"""

from __future__ import annotations

import torch
from torch import nn

from qllm.batch import ForwardBatch
from qllm.cache.base import CacheRequirement
from qllm.distributed.parallel_state import TensorParallel, get_tp
from qllm.distributed.shards import materialize, narrow_part, narrow_sections
from qllm.layers.gated_norm import RMSNormGated
from qllm.layers.linear import Linear, RowParallelLinear, default_weight_loader
from qllm.plugins.registry import Kernels


class GDNInputProjection(Linear):
    """All GDN input projections as one matmul; output rows ``[q | k | v | z | b | a]``
    (``q``, ``k``: ``Hk * dk``; ``v``, ``z``: ``Hv * dv``; ``b``, ``a``: ``Hv``).

    Loads either Qwen3.5's separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
    ``in_proj_a`` or Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``, whose rows are grouped per
    key head (``[q dk | k dk | v r*dv | z r*dv]`` and ``[b r | a r]``, ``r = Hv / Hk``).
    The shard names are the checkpoint's projection names.

    Tensor parallel (``tp``): every part is split by heads, each rank holding ``Hk / size``
    key heads and their ``Hv / size`` value heads, in the same row order; a rank reads its
    heads' rows of each checkpoint projection (Qwen3-Next's are contiguous key-head groups).
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, fused_checkpoint: bool, kernels: Kernels,
                 tp: TensorParallel | None = None):
        self.tp = tp = tp or get_tp()
        full = [num_k_heads * head_k_dim] * 2 + [num_v_heads * head_v_dim] * 2 + [num_v_heads] * 2
        self.full_sizes = full  # the parts' rows in the checkpoint
        num_k_heads = tp.shard(num_k_heads, "linear_num_key_heads")
        num_v_heads = tp.shard(num_v_heads, "linear_num_value_heads")
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.sizes = [key_dim, key_dim, value_dim, value_dim, num_v_heads, num_v_heads]
        super().__init__(hidden_size, sum(self.sizes), kernels)
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        if fused_checkpoint:
            self.shard_offsets = {"in_proj_qkvz": None, "in_proj_ba": None}
        else:
            conv_dim = 2 * key_dim + value_dim
            self.shard_offsets = {"in_proj_qkv": (0, conv_dim),
                                  "in_proj_z": (starts[3], value_dim),
                                  "in_proj_b": (starts[4], num_v_heads),
                                  "in_proj_a": (starts[5], num_v_heads)}
        self.row_starts = starts

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: str | None = None) -> None:
        if shard == "in_proj_qkvz":
            self._load_grouped(param, loaded, [self.dk, self.dk, self.hv // self.hk * self.dv,
                                               self.hv // self.hk * self.dv], first_part=0)
        elif shard == "in_proj_ba":
            self._load_grouped(param, loaded, [self.hv // self.hk] * 2, first_part=4)
        else:  # whole (already fused in our row order) or one of Qwen3.5's projections
            parts = {None: range(6), "in_proj_qkv": range(3), "in_proj_z": [3],
                     "in_proj_b": [4], "in_proj_a": [5]}[shard]
            pieces = narrow_sections(loaded, 0, [self.full_sizes[i] for i in parts],
                                     self.tp.size, self.tp.rank)
            for i, piece in zip(parts, pieces):
                default_weight_loader(param.data.narrow(0, self.row_starts[i], self.sizes[i]),
                                      piece)

    def _load_grouped(self, param: nn.Parameter, loaded: torch.Tensor, per_head: list[int],
                      first_part: int) -> None:
        """Un-group rows stored per key head ``[Hk, sum(per_head), H]`` into the parts'
        contiguous row ranges."""
        expected = (self.hk * self.tp.size * sum(per_head), self.in_features)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected "
                             f"{expected} (rows grouped per key head)")
        # this rank's key heads: a contiguous run of the groups
        loaded = materialize(narrow_part(loaded, 0, self.tp.size, self.tp.rank))
        parts = loaded.view(self.hk, sum(per_head), self.in_features).split(per_head, dim=1)
        for i, part in enumerate(parts):  # part: [Hk, rows per key head, H]
            start, size = self.row_starts[first_part + i], self.sizes[first_part + i]
            param.data.narrow(0, start, size).copy_(part.reshape(size, self.in_features))

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """``[T, out_features]`` -> ``[qkv [T, conv_dim], z [T, Hv*dv], b [T, Hv], a [T, Hv]]``."""
        conv_dim = sum(self.sizes[:3])
        return list(out.split([conv_dim, self.sizes[3], self.hv, self.hv], dim=-1))


class DepthwiseConv1d(nn.Conv1d):
    """The GDN's depthwise conv weight ``[C, 1, K]`` over the ``[q | k | v]`` channels,
    ``sections`` of them in the checkpoint; a tensor-parallel rank holds its heads' channels
    of each section (exact: the conv is depthwise)."""

    def __init__(self, sections: list[int], kernel_size: int, tp: TensorParallel):
        channels = sum(tp.shard(size, "the GDN conv channels") for size in sections)
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)
        self.sections, self.tp = sections, tp

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        start = 0
        for piece in narrow_sections(loaded, 0, self.sections, self.tp.size, self.tp.rank):
            default_weight_loader(param.data.narrow(0, start, piece.shape[0]), piece)
            start += piece.shape[0]


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer; HF parameter names except the fused ``in_proj``.

    Tensor parallel: split by heads (``GDNInputProjection``), the conv channels, ``A_log``
    and ``dt_bias`` with them, the gated norm per head (local), ``out_proj`` row-parallel
    with one all-reduce; each rank's recurrent state holds its heads only."""

    layer_kind = "linear_attention"

    def __init__(self, config, kernels: Kernels, conv_dtype: torch.dtype,
                 ssm_dtype: torch.dtype, fused_checkpoint: bool):
        super().__init__()
        self.tp = tp = get_tp()
        # this rank's heads (all of them without tensor parallelism)
        self.num_k_heads = tp.shard(config.linear_num_key_heads, "linear_num_key_heads")
        self.num_v_heads = tp.shard(config.linear_num_value_heads, "linear_num_value_heads")
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.qkv_sizes = [self.key_dim, self.key_dim, self.value_dim]  # the conv channels
        self.conv_dim = sum(self.qkv_sizes)
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv_dtype, self.ssm_dtype = conv_dtype, ssm_dtype

        self.in_proj = GDNInputProjection(config.hidden_size, config.linear_num_key_heads,
                                          config.linear_num_value_heads, self.head_k_dim,
                                          self.head_v_dim, fused_checkpoint, kernels, tp)
        # Holds the depthwise weight [conv_dim, 1, K] under its HF name; the ops apply it.
        self.conv1d = DepthwiseConv1d([self.key_dim * tp.size] * 2 + [self.value_dim * tp.size],
                                      self.conv_kernel_size, tp)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v_dim, kernels, eps=config.rms_norm_eps)
        self.out_proj = RowParallelLinear(self.value_dim * tp.size, config.hidden_size,
                                          kernels, tp=tp)

        self._conv_prefill = kernels.causal_conv1d_prefill
        self._conv_update = kernels.causal_conv1d_update
        self._gdn_prefill = kernels.gdn_prefill
        self._gdn_decode_gated_norm = kernels.gdn_decode_gated_norm

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """``A_log`` / ``dt_bias`` ``[Hv]``: this rank's value heads."""
        default_weight_loader(param, narrow_part(loaded, 0, self.tp.size, self.tp.rank))

    def cache_requirement(self) -> CacheRequirement:
        return CacheRequirement(
            self.layer_kind,
            {"conv": (self.conv_kernel_size - 1, self.conv_dim),  # taps outer: see attach_cache
             "ssm": (self.num_v_heads, self.head_v_dim, self.head_k_dim)},  # value-major
            {"conv": self.conv_dtype, "ssm": self.ssm_dtype})

    def attach_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        # Plain attributes, not buffers, as qllm.layers.attention's cache: their slot count
        # (max_num_seqs, prefix-state checkpoints) stays symbolic in the compiled layers.
        # The ops take conv_state as [S+1, C, K-1]; stored taps-outer, each tap's channels are
        # contiguous, so a kernel walking channels reads and writes each tap coalesced.
        conv_state = tensors["conv"].transpose(1, 2)  # [S+1, C, K-1], channel stride 1
        self.conv_state = conv_state
        # The ops take ssm_state as [S+1, Hv, dk, dv]; stored value-major, the [dk, BV] tile a
        # decode program updates is one contiguous block of BV rows of dk.
        ssm_state = tensors["ssm"].transpose(-1, -2)  # [S+1, Hv, dk, dv], key stride 1
        self.ssm_state = ssm_state

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``hidden [T, H]`` -> ``[T, H]``."""
        qkv, z, b, a = self.in_proj.split(self.in_proj(hidden))
        z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))  # [T, Hv, dv]
        if not batch.is_prefill:  # the recurrence and the norm in one op
            return self.out_proj(self._decode(qkv, a, b, z, batch).flatten(-2))
        rounds = batch.caches["recurrent_slot"].rounds
        if rounds is None:
            out = self._prefill(qkv, a, b, batch)  # [T, Hv, dv]
        else:  # the step saves state checkpoints inside its chunks (qllm.cache.checkpoint_rounds)
            out = rounds.run(self._prefill, (qkv, a, b), batch, (self.conv_state, self.ssm_state))
        return self.out_proj(self.norm(out, z).flatten(-2))

    def _split_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's q, k, v ``[T, width]`` -> ``q, k [T, Hk, dk]``, ``v [T, Hv, dv]``."""
        return (q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                v.unflatten(-1, (self.num_v_heads, self.head_v_dim)))

    def _prefill(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 batch: ForwardBatch) -> torch.Tensor:
        """The conv and the gated delta rule of ``batch``'s new tokens, from and into the
        states of its slots: ``qkv [T, conv_dim]``, ``a, b [T, Hv]`` -> ``[T, Hv, dv]``."""
        # each of q, k, v contiguous, as chunked kernels read them
        q, k, v = self._split_heads(*self._conv_prefill(
            qkv, self.conv1d.weight[:, 0, :], self.conv_state, batch, self.qkv_sizes))
        return self._gdn_prefill(q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_state,
                                 batch)

    def _decode(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """One token per sequence: the conv, the gated delta rule and the gated norm with
        ``z [B, Hv, dv]``, from and into the slots' states -> ``[B, Hv, dv]``."""
        q, k, v = self._split_heads(*self._conv_update(
            qkv, self.conv1d.weight[:, 0, :], self.conv_state, batch).split(
                self.qkv_sizes, dim=-1))  # views of [B, C]
        return self._gdn_decode_gated_norm(q, k, v, a, b, self.A_log, self.dt_bias,
                                           self.ssm_state, batch, z, self.norm.weight,
                                           self.norm.eps)
