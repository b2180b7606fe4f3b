"""bfloat16 matrix products of the Qwen2-VL vision tower, fast on CPUs that lack bfloat16 kernels.

Where a bfloat16 tower's time went (torch.profiler; the 2B-shaped benchmark tower, one 448x448
image, 2 AMD EPYC Zen 2 cores with AVX2 and no AVX-512; 2026-12-01): 96% in `addmm`, 128 s per
image. torch multiplies bfloat16 matrices with oneDNN only where the CPU has AVX-512 or AMX
(`torch.ops.mkldnn._is_mkldnn_bf16_supported()`); elsewhere a generic loop runs them, ~6x
slower than a float32 product of the same shape (1.29 s against 0.2 s for 1024x1280 @ 1280x5120).
vLLM's CPU linear layers cannot build their oneDNN bfloat16 matmul on such a CPU either and fall
back to that same torch call. The rotary embedding and the other element-wise ops took ~5% of
the time; rotating q and k together with half-width products gave the same bits and was not
faster there, so the attention stays transformers' own.

So, on such a CPU, a bfloat16 tower's linear layers and patch embedding widen their input and
weights to float32 (exactly), multiply and accumulate in float32 as torch's bfloat16 kernel also
accumulates, and round the output to bfloat16 once: the result differs from that kernel only in
the order the products are summed. The products run in oneDNN's float32 matmul, which was 25-35%
faster than torch's default (MKL) one on those cores. The measured bfloat16 forward: ~15-18 s per
image instead of 128 s (a float32 tower took ~18 s). Weights stay bfloat16 in memory; each call
widens the ones it needs, ~3% of the product's time.

Every other op (layer norms, rotary, attention, activations) runs as transformers runs it, in the
tower's dtype; on float32 towers, the quick_gelu activation is the exception (below).

float32 towers on CPU (cpu_matmul="onednn", the default): the linear layers run in that same
oneDNN float32 matmul instead of torch's default MKL one, as vLLM's CPU linear layers do. Measured
on 2 AMD EPYC cores (2026-12-03; F.linear against torch.ops.mkldnn._linear_pointwise, ten calls
each, on the 2B-shaped tower's four shapes at 1024 rows): 49/16/66/65 ms against 70/20/95/83 ms
per product (qkv, proj, fc1, fc2), and a whole 448x448 forward pass 9.0-9.8 s against 12.0-12.7 s;
scenario 4 of `make bench` times the tower against vLLM's. The MLPs' quick_gelu then runs inside
fc1's matmul (_mlp_with_quick_gelu_in_fc1): torch.profiler put the stock activation's multiply
and sigmoid at 10% of a whole forward pass, and a 448x448 pass went from 4.84-5.03 s to 4.08-4.40 s
(2 AMD EPYC cores, 2026-12-04, three passes each way, alternating). The sums run in another order,
so values differ from transformers' tower by float rounding (~1e-5 absolute at std ~0.6);
cpu_matmul="exact" keeps torch's kernels, transformers' activation and its bits. CPUs with
bfloat16 kernels and GPUs are left as they are.
"""

from __future__ import annotations

import logging
import types
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import QuickGELUActivation
from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed, Qwen2VisionTransformerPretrainedModel, VisionMlp

logger = logging.getLogger(__name__)
_MARK = "_fast_tower"


CpuMatmul = Literal["onednn", "exact"]
# transformers' QuickGELUActivation: quick_gelu(z) = z * sigmoid(QUICK_GELU_SCALE * z).
QUICK_GELU_SCALE = 1.702
# The row count oneDNN lays packed weights out for: one 448x448 image's patches. Only speed depends
# on it, and little (measured from 2 to 4096 rows).
PACKED_FOR_ROWS = 1024


def make_fast(
    tower: Qwen2VisionTransformerPretrainedModel, cpu_matmul: CpuMatmul = "onednn"
) -> Qwen2VisionTransformerPretrainedModel:
    """Patches `tower` in place (idempotent) and returns it; call it once the tower has its dtype.

    Only this instance's submodules get a new `forward`: classes and weight values stay as they
    are. A float32 tower's linear weights are replaced by oneDNN's packed copies (_pack_weight), so
    the patched tower serves forward passes only: it cannot be moved, trained or saved. Apply it
    before make_batch_invariant, which wraps the forwards set here.
    """
    if getattr(tower, _MARK, False):
        return tower
    dtype, device = tower.get_dtype(), tower.get_device()
    if widens_bfloat16_products(dtype, device):
        _linears_in_onednn_float32(tower)
        patch_embed = tower.patch_embed
        patch_embed.forward = types.MethodType(_patch_embed_in_float32, patch_embed)  # type: ignore[method-assign]
        logger.info("no bfloat16 matmul kernel on this CPU: the vision tower multiplies in float32")
    elif cpu_matmul == "onednn" and multiplies_float32_in_onednn(dtype, device):
        _linears_in_onednn_float32(tower, packed=True)
        _quick_gelus_in_fc1(tower)
        logger.info("float32 vision tower: linear layers in oneDNN's matmul (ENCODER_CPU_MATMUL=exact for torch's)")
    setattr(tower, _MARK, True)
    return tower


def multiplies_float32_in_onednn(dtype: torch.dtype, device: torch.device) -> bool:
    """True for a float32 tower on a CPU where torch has oneDNN."""
    return dtype == torch.float32 and device.type == "cpu" and torch.backends.mkldnn.is_available()


def _linears_in_onednn_float32(tower: nn.Module, packed: bool = False) -> None:
    for module in tower.modules():
        if isinstance(module, nn.Linear):
            if packed:
                _pack_weight(module)
            module.forward = types.MethodType(_linear_in_float32, module)  # type: ignore[method-assign]


def _pack_weight(linear: nn.Linear) -> None:
    """Replaces a float32 linear layer's weight by oneDNN's packed (blocked) copy of it, as vLLM's
    CPU linear layers hold theirs: given a plain weight, oneDNN reorders it on every call. Same
    products bit for bit at every row count from 2 to 4096 on the AMD EPYC measured (at 1 row,
    within rounding; tests allow rounding for other CPUs' kernels); measured on 2 AMD EPYC cores
    (2026-12-04), 4% off a 448x448 forward pass (3.85-3.92 s against 4.01-4.07 s, alternating).
    The plain weight is freed, so memory stays as it was."""
    packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKED_FOR_ROWS)
    del linear.weight
    # A buffer, not a parameter (a packed tensor is no trainable weight); not in the state dict.
    linear.register_buffer("weight", packed, persistent=False)


def _quick_gelus_in_fc1(tower: Qwen2VisionTransformerPretrainedModel) -> None:
    for block in tower.blocks:
        mlp = block.mlp
        if isinstance(mlp, VisionMlp) and isinstance(mlp.act, QuickGELUActivation):
            mlp.forward = types.MethodType(_mlp_with_quick_gelu_in_fc1, mlp)  # type: ignore[method-assign]


def _mlp_with_quick_gelu_in_fc1(self: VisionMlp, x: torch.Tensor) -> torch.Tensor:
    """VisionMlp.forward for float32 x [rows, dim], its activation computed inside fc1's matmul.

    oneDNN applies swish(y) = y * sigmoid(y) to each output block while it is in cache; torch's
    quick_gelu is three more passes over fc1's 4x-wide output (multiply, sigmoid, multiply): 14 ms
    on top of fc1's own 29 ms at the 2B-shaped tower's 1024 rows. swish(s*z) = s * quick_gelu(z)
    with s the quick_gelu scale, and s*z = fc1(x) with x and the bias scaled by s, so: scale the
    (narrow) input, fuse swish, and divide by s in fc2's (narrow) output. Within float rounding of
    the stock MLP.
    """
    fc1, fc2, scale = self.fc1, self.fc2, QUICK_GELU_SCALE
    bias1 = None if fc1.bias is None else fc1.bias * scale
    hidden = torch.ops.mkldnn._linear_pointwise(x * scale, fc1.weight, bias1, "swish", [], "")  # s * quick_gelu(z)
    out = cast(torch.Tensor, torch.ops.mkldnn._linear_pointwise(hidden, fc2.weight, None, "none", [], ""))
    if fc2.bias is None:
        return out * (1 / scale)
    return torch.add(fc2.bias, out, alpha=1 / scale)


def widens_bfloat16_products(dtype: torch.dtype, device: torch.device) -> bool:
    """True for a bfloat16 tower on a CPU where torch's oneDNN has no bfloat16 matmul (no AVX-512 or AMX)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _linear_in_float32(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward for x [rows, in]: oneDNN's float32 matmul, output rounded to the weight's dtype
    (for float32 weights every conversion here is a no-op)."""
    bias = None if self.bias is None else self.bias.float()
    out = torch.ops.mkldnn._linear_pointwise(x.float(), self.weight.float(), bias, "none", [], "")
    return cast(torch.Tensor, out).to(self.weight.dtype)


def _patch_embed_in_float32(self: PatchEmbed, hidden_states: torch.Tensor) -> torch.Tensor:
    """PatchEmbed.forward: pixels [patches, C*T*P*P] -> [patches, embed_dim] in the weight's dtype."""
    weight = self.proj.weight
    # Rounded to the tower's dtype first, as transformers' PatchEmbed does, then widened exactly.
    # The kernel [embed_dim, C, T, P, P] tiles each patch exactly (stride == kernel).
    patches = hidden_states.to(weight.dtype).float().view(-1, *weight.shape[1:])
    stride = cast(tuple[int, int, int], self.proj.stride)
    return F.conv3d(patches, weight.float(), stride=stride).to(weight.dtype).view(-1, weight.shape[0])
