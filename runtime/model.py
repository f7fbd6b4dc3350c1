"""The MoE layer's shape: one statement shared by configs, kernels' specs,
the reference and the runtime (no torch, no cutlass). The constants it is
stated in (``TILE``, ``FP8_MAX``, ...) are defined in ``runtime.constants``."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from runtime.constants import TILE

#: Router score functions, over all routed experts of a token.
SCORES = ("sigmoid", "softmax")


@dataclass(frozen=True)
class MoEShape:
    """One tensor-parallel shard of an MoE layer.

    ``hidden`` (H) and ``inter`` (I) are widths in elements; ``experts`` (E)
    routed experts; ``top_k`` experts per token; ``routed_scale`` multiplies the
    routing weights; ``swiglu_limit`` clamps gate (above) and up (both sides),
    None for an unclamped SwiGLU (``silu(gate) * up``); ``ue8m0`` rounds
    activation scales up to powers of two; ``shared_experts`` is 0 or 1.

    Routing (docs/models.md has each model's values): ``score`` is how logits
    become scores (``SCORES``); ``bias`` whether a per-expert score-correction
    bias is added to the scores for selection only; the experts form
    ``groups`` equal groups of which a token keeps ``groups_kept`` (None: all
    of them; resolved at construction); ``renormalize`` divides the selected
    weights by their sum. The defaults are the routing every kernel serves
    (sigmoid + bias, one group, renormalized), so a shape recorded before
    these fields existed reads back unchanged."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    routed_scale: float
    swiglu_limit: float | None
    ue8m0: bool
    shared_experts: int
    score: str = "sigmoid"
    bias: bool = True
    groups: int = 1
    groups_kept: int | None = None
    renormalize: bool = True

    def __post_init__(self) -> None:
        if self.groups_kept is None:
            object.__setattr__(self, "groups_kept", self.groups)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def expert_bytes(self) -> int:
        """FP8 weight bytes of one expert plus its FP32 block scales."""
        weights = 3 * self.hidden * self.inter
        scales = 3 * (self.hidden // TILE) * (self.inter // TILE) * 4
        return weights + scales
