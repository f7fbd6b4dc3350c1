"""Tensor-parallel shards of an MoE layer: split the experts' intermediate
width ``I`` into ``n`` equal slices, one per GPU.

Shard s holds, for every expert, gate and up rows ``s*I/n .. (s+1)*I/n`` of
w13 and the same columns of w2 (with their block scales). Because SwiGLU is
elementwise and the hidden FP8 quantization works on 128-column blocks that
never straddle a shard (``I/n`` is a multiple of 128), each shard's output is
exactly its slice of GEMM2's K sum: the layer's output is the sum over shards.
Routing depends only on the logits, so every shard routes identically.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from runtime.constants import TILE
from runtime.layout import CheckpointWeights
from runtime.model import MoEShape


def shard_shape(shape: MoEShape, shards: int) -> MoEShape:
    """The shape of one of ``shards`` equal slices of ``shape``'s inter."""
    if shards < 1 or shape.inter % (shards * TILE):
        raise ValueError(
            f"inter {shape.inter} does not split into {shards} shards of whole 128-column blocks"
        )
    return replace(shape, inter=shape.inter // shards)


def split_checkpoint(ckpt: CheckpointWeights, shards: int) -> list[CheckpointWeights]:
    """Checkpoint-layout experts (w13 rows [gate; up]) -> ``shards`` slices of
    the intermediate width, in shard order."""
    inter = ckpt.w13.shape[1] // 2
    if shards < 1 or inter % (shards * TILE):
        raise ValueError(f"inter {inter} does not split into {shards} shards of 128-blocks")
    width, blocks = inter // shards, inter // shards // TILE
    gate, up = ckpt.w13[:, :inter], ckpt.w13[:, inter:]
    gate_s, up_s = ckpt.w13_scale[:, : inter // TILE], ckpt.w13_scale[:, inter // TILE :]
    out = []
    for s in range(shards):
        rows = slice(s * width, (s + 1) * width)
        bl = slice(s * blocks, (s + 1) * blocks)
        out.append(
            CheckpointWeights(
                w13=_cat_fp8(gate[:, rows], up[:, rows]),
                w13_scale=torch.cat([gate_s[:, bl], up_s[:, bl]], dim=1).contiguous(),
                w2=ckpt.w2[:, :, rows].contiguous(),
                w2_scale=ckpt.w2_scale[:, :, bl].contiguous(),
            )
        )
    return out


def _cat_fp8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # torch.cat has no FP8 kernel on every backend: join the raw bytes.
    joined = torch.cat([a.view(torch.uint8), b.view(torch.uint8)], dim=1)
    return joined.contiguous().view(a.dtype)
