"""The MoE layer's shape: one statement shared by configs, kernels' specs,
the reference and the runtime (no torch, no cutlass). The constants it is
stated in (``TILE``, ``FP8_MAX``, ...) are defined in ``runtime.constants``."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from runtime.constants import TILE


@dataclass(frozen=True)
class MoEShape:
    """One tensor-parallel shard of an MoE layer.

    ``hidden`` (H) and ``inter`` (I) are widths in elements; ``experts`` (E)
    routed experts; ``top_k`` experts per token; ``routed_scale`` multiplies the
    renormalized routing weights; ``swiglu_limit`` clamps gate (above) and up
    (both sides); ``ue8m0`` rounds activation scales up to powers of two;
    ``shared_experts`` is 0 or 1."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    routed_scale: float
    swiglu_limit: float
    ue8m0: bool
    shared_experts: int

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def expert_bytes(self) -> int:
        """FP8 weight bytes of one expert plus its FP32 block scales."""
        weights = 3 * self.hidden * self.inter
        scales = 3 * (self.hidden // TILE) * (self.inter // TILE) * 4
        return weights + scales
