"""The shared expert in torch, for layer calls served by mega variants built
without it.

Current mega variants compute the shared expert themselves (a ``shared_out``
parameter); older ones computed routed experts only, and no kernel of ours
runs the shared expert alone, so for those the layer computes it here with
the same math as the kernels (runtime.reference's FP8 quantizers and clamped
SwiGLU, per-K-block FP32 partials scaled by weight and activation block
scales).

Known cost: the weights are held de-interleaved in FP32 (12 x H x I bytes:
24 MiB per layer for H = 4096, I = 512, next to the 6 MiB FP8 original), and
one call reads them all, about 4x the FP8 bytes, plus a few small kernels.
Capture-safe: device ops only, no host syncs.
"""

from __future__ import annotations

import torch

from runtime.layout import ExpertWeights, logical_rows
from runtime.model import TILE, MoEShape
from runtime.reference import quantize_activations, quantize_hidden, swiglu


class SharedExpert:
    """``shared(x)`` -> BF16 [M, H] shared expert output for BF16 [M, H] tokens."""

    def __init__(self, weights: ExpertWeights, shape: MoEShape):
        self.shape = shape
        self.w13 = _logical_blocks(weights.w13[0])  # [2I, H/128, 128], W31 rows
        self.w2 = _logical_blocks(weights.w2[0])  # [H, I/128, 128]
        # Scales per (row, K block): the row shuffle never crosses a 128-row
        # block, so the physical layout's scales are the logical ones.
        self.s13 = weights.w13_scale[0].float().repeat_interleave(TILE, dim=0)
        self.s2 = weights.w2_scale[0].float().repeat_interleave(TILE, dim=0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        inter = self.shape.inter
        xq, sx = quantize_activations(x, self.shape.ue8m0)
        h1 = _block_gemm(xq, sx, self.w13, self.s13)  # [M, 2I]: up, then gate
        a = swiglu(gate=h1[:, inter:], up=h1[:, :inter], limit=self.shape.swiglu_limit)
        aq, sh = quantize_hidden(a)
        return _block_gemm(aq, sh, self.w2, self.s2).to(torch.bfloat16)


def _logical_blocks(w: torch.Tensor) -> torch.Tensor:
    """BlockMajorK [K/128, N, 128] with shuffled rows -> FP32 [N, K/128, 128]
    in logical row order."""
    blocks, n, _ = w.shape
    physical = w.view(torch.uint8).permute(1, 0, 2)
    out = torch.empty_like(physical)
    out[logical_rows(n, w.device).long()] = physical
    return out.contiguous().view(torch.float8_e4m3fn).float()


def _block_gemm(q, sq, w, w_scale) -> torch.Tensor:
    """FP32 [T, N]: sum over K blocks of w_scale[n, kb] * sq[t, kb] * (w[n, kb] . q[t, kb])."""
    t = q.shape[0]
    n, blocks, _ = w.shape
    partial = torch.einsum("nbk,tbk->tnb", w, q.float().view(t, blocks, TILE))
    return (partial * (w_scale[None] * sq.float()[:, None, :])).sum(dim=-1)
