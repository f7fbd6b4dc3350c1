"""The torch baseline: the MoE layer as a user without this project would write
it in plain torch, for the benchmark to compare against.

Weights are dequantized to BF16 once (block scales folded in); each call
routes with torch as the model does (score function, bias, groups, top-k:
``runtime.reference.route_for``), quantizes the tokens to FP8 per 128 and
back (the same numerics as the kernels' activation quantization), then runs
two BF16 matmuls per distinct expert on that expert's tokens, the SwiGLU
(clamped where the model clamps it), the FP8 hidden quantization round
trip, and a weighted scatter-add; the shared expert, where the model has
one, runs on every token. It syncs with the host once per call
(to learn which experts were picked), as such code does, so it cannot be
captured in a CUDA graph: ``benchmarks.bench`` times it eagerly.
"""

from __future__ import annotations

import torch

from runtime.layout import ExpertWeights, MoEWeights, unprepare
from runtime.model import TILE, MoEShape
from runtime.reference import quantize_activations, quantize_hidden, route_for, swiglu


def _dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Checkpoint-layout FP8 [E, N, K] with block scales [E, N/128, K/128] ->
    BF16 [E, N, K]."""
    full = scale.repeat_interleave(TILE, dim=1).repeat_interleave(TILE, dim=2)
    return (w.float() * full).to(torch.bfloat16)


class TorchMoE:
    """Plain-torch MoE over prepared weights (see module docstring); no
    shared expert where ``weights.shared`` is None."""

    def __init__(self, weights: MoEWeights, shape: MoEShape):
        self.shape = shape
        self.w13, self.w2 = self._load(weights.routed)
        self.s13, self.s2 = (None, None) if weights.shared is None else self._load(weights.shared)

    def _load(self, ex: ExpertWeights):
        # Back to the checkpoint layout (logical rows, w13 = [gate; up]), as a
        # user's weights would be.
        ckpt = unprepare(ex)
        return _dequantize(ckpt.w13, ckpt.w13_scale), _dequantize(ckpt.w2, ckpt.w2_scale)

    def _expert(self, xd: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        inter = self.shape.inter
        h = xd @ w13.t()  # [T, 2I]: gate, then up
        a = swiglu(
            gate=h[:, :inter].float(), up=h[:, inter:].float(), limit=self.shape.swiglu_limit
        )
        aq, sh = quantize_hidden(a)
        ad = (aq.float().view(a.shape[0], -1, TILE) * sh[..., None]).view_as(a)
        return ad.to(torch.bfloat16) @ w2.t()

    def __call__(
        self, x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """BF16 [M, H] MoE output; ``bias`` FP32 [E], None for a model without one."""
        s = self.shape
        ids, weights = route_for(logits, bias, s)
        xq, sx = quantize_activations(x, s.ue8m0)
        m = x.shape[0]
        xd = (xq.float().view(m, -1, TILE) * sx[..., None]).view(m, -1).to(torch.bfloat16)
        total = torch.zeros(m, s.hidden, dtype=torch.float32, device=x.device)
        flat = ids.view(-1).long()
        for e in torch.unique(flat).tolist():
            rows = (flat == e).nonzero().view(-1)
            tokens = rows // s.top_k
            y = self._expert(xd[tokens], self.w13[e], self.w2[e])
            total.index_add_(0, tokens, y.float() * weights.view(-1)[rows, None])
        if self.s13 is not None:
            total += self._expert(xd, self.s13[0], self.s2[0]).float()
        return total.to(torch.bfloat16)
