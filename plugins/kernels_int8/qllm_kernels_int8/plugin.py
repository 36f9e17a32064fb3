"""qllm plugin entry point: the ``int8``, ``int8-experts``, ``fp8`` and ``fp8-experts`` weight
formats (``qllm_weight_formats``) and the ops their modules call (``qllm_kernels``).

Each op has its plain-torch reference (``torch``, priority 0, every device: dequantize, then
the full-precision op) and a Triton implementation (``triton``, priority 10) on CUDA in
fp16 / bf16 when Triton is importable.
"""

from __future__ import annotations

from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import KernelSpec, WeightFormatSpec, triton_on_cuda

from qllm_kernels_int8 import ops, quant
from qllm_kernels_int8.formats import (Fp8ExpertsFormat, Fp8Format, Int8ExpertsFormat,
                                       Int8Format)

PLUGIN = "qllm-kernels-int8"
INT8_OPS = ("linear_w8a16", "fused_moe_w8a16")
FP8_OPS = ("linear_fp8_block", "fused_moe_fp8_block")


@hookimpl
def qllm_weight_formats():
    return [
        WeightFormatSpec(name="int8", create=lambda quant_config, config: Int8Format(None),
                         plugin=PLUGIN, ops=INT8_OPS,
                         description="INT8 weight-only (W8A16), a scale per output channel, "
                                     "quantized at load"),
        WeightFormatSpec(name="int8-experts",
                         create=lambda quant_config, config: Int8ExpertsFormat(None),
                         plugin=PLUGIN, ops=INT8_OPS,
                         description="INT8 weight-only on the MoE experts alone, other "
                                     "projections full precision (for many rows per step)"),
        WeightFormatSpec(name="fp8", create=lambda quant_config, config: Fp8Format(
                             quant_config), plugin=PLUGIN, checkpoint_methods=("fp8",),
                         ops=FP8_OPS,
                         description="FP8 e4m3 W8A8 with 128x128 block scales (Qwen's FP8 "
                                     "checkpoints, or quantized at load)"),
        WeightFormatSpec(name="fp8-experts",
                         create=lambda quant_config, config: Fp8ExpertsFormat(None),
                         plugin=PLUGIN, ops=FP8_OPS,
                         description="FP8 e4m3 W8A8 on the MoE experts alone, quantized at "
                                     "load, other projections full precision"),
    ]


@hookimpl
def qllm_kernels():
    specs = []
    for op in INT8_OPS + FP8_OPS:
        specs.append(KernelSpec(op=op, name="torch", fn=getattr(quant, op)))
        specs.append(KernelSpec(op=op, name="triton", fn=getattr(ops, op), priority=10,
                                is_available=triton_on_cuda()))
    return specs
