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
tower's dtype.

float32 towers on CPU (cpu_matmul="onednn", the default): the linear layers run in that same
oneDNN float32 matmul instead of torch's default MKL one, as vLLM's CPU linear layers do. Measured
on 2 AMD EPYC cores (2026-12-03; F.linear against torch.ops.mkldnn._linear_pointwise, ten calls
each, on the 2B-shaped tower's four shapes at 1024 rows): 49/16/66/65 ms against 70/20/95/83 ms
per product (qkv, proj, fc1, fc2), and a whole 448x448 forward pass 9.0-9.8 s against 12.0-12.7 s;
scenario 4 of `make bench` times the tower against vLLM's. The sums run in another order, so values differ from
transformers' tower by float rounding (~1e-5 absolute at std ~0.6); cpu_matmul="exact" keeps
torch's kernels and transformers' bits. CPUs with bfloat16 kernels and GPUs are left as they are.
"""

from __future__ import annotations

import logging
import types
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed, Qwen2VisionTransformerPretrainedModel

logger = logging.getLogger(__name__)
_MARK = "_fast_tower"


CpuMatmul = Literal["onednn", "exact"]


def make_fast(
    tower: Qwen2VisionTransformerPretrainedModel, cpu_matmul: CpuMatmul = "onednn"
) -> Qwen2VisionTransformerPretrainedModel:
    """Patches `tower` in place (idempotent) and returns it; call it once the tower has its dtype.

    Only this instance's submodules get a new `forward`: classes, weights and state-dict names
    stay as they are. Apply it before make_batch_invariant, which wraps the forwards set here.
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
        _linears_in_onednn_float32(tower)
        logger.info("float32 vision tower: linear layers in oneDNN's matmul (ENCODER_CPU_MATMUL=exact for torch's)")
    setattr(tower, _MARK, True)
    return tower


def multiplies_float32_in_onednn(dtype: torch.dtype, device: torch.device) -> bool:
    """True for a float32 tower on a CPU where torch has oneDNN."""
    return dtype == torch.float32 and device.type == "cpu" and torch.backends.mkldnn.is_available()


def _linears_in_onednn_float32(tower: nn.Module) -> None:
    for module in tower.modules():
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(_linear_in_float32, module)  # type: ignore[method-assign]


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
