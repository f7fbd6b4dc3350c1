"""Expert weight layouts: checkpoint <-> TRTLLM-Gen BlockMajorK (DeepSeek FP8).

Checkpoint layout (what a model file holds), per expert e:
  w13 fp8 [E, 2I, H]: rows [gate; up];  w13_scale fp32 [E, 2I/128, H/128]
  w2  fp8 [E, H, I];                    w2_scale  fp32 [E, H/128, I/128]

Kernel layout (``prepare``):
  1. "w31" swap: rows become [up; gate] (the w13 scale's 128-row blocks too);
  2. rows shuffled within 16-row groups: physical row m holds logical row
     ``p16(m)`` (0, 2, ..., 14, 1, 3, ..., 15 within each group); the
     permutation never crosses a 128-row block, so scales are not shuffled;
  3. block-major K: ``W[e, kb, m, kk] = Wshuffled[e, m, kb*128 + kk]``.
Kernel epilogues map a physical accumulator row back to its logical row with
``logical_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.constants import FP8_MAX, TILE
from runtime.model import MoEShape

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class CheckpointWeights:
    """Experts in checkpoint layout (see module docstring); E may be 1 (the
    shared expert)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor


@dataclass(frozen=True)
class ExpertWeights:
    """Experts in the kernels' BlockMajorK layout: w13 fp8 [E, H/128, 2I, 128]
    (W31 order, 16-row shuffle), w13_scale fp32 [E, 2I/128, H/128] (W31
    order), w2 fp8 [E, I/128, H, 128] (16-row shuffle), w2_scale fp32
    [E, H/128, I/128]. All contiguous."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    @property
    def experts(self) -> int:
        return self.w13.shape[0]

    def to(self, device) -> ExpertWeights:
        return ExpertWeights(*(t.to(device) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w13, self.w13_scale, self.w2, self.w2_scale)


@dataclass(frozen=True)
class MoEWeights:
    """A layer's prepared weights: the routed experts and the shared expert
    (one expert in the same layout, or None without one)."""

    routed: ExpertWeights
    shared: ExpertWeights | None

    def to(self, device) -> MoEWeights:
        shared = None if self.shared is None else self.shared.to(device)
        return MoEWeights(self.routed.to(device), shared)


def p16(m: torch.Tensor) -> torch.Tensor:
    """Logical row held by physical row ``m`` (the 16-row shuffle)."""
    r = m % 16
    return 16 * (m // 16) + torch.where(r < 8, 2 * r, 2 * (r - 8) + 1)


def logical_rows(n: int, device=None) -> torch.Tensor:
    """int32 [n]: the logical row of each physical row (``n`` a multiple of 16)."""
    if n % 16:
        raise ValueError(f"row count {n} is not a multiple of 16")
    return p16(torch.arange(n, device=device)).to(torch.int32)


def physical_rows(n: int, device=None) -> torch.Tensor:
    """int32 [n]: the physical row holding each logical row (inverse of
    ``logical_rows``)."""
    inverse = torch.empty(n, dtype=torch.int64, device=device)
    inverse[logical_rows(n, device).long()] = torch.arange(n, device=device)
    return inverse.to(torch.int32)


def swap_halves(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[a; b] -> [b; a] along ``dim`` (its size must be even). Its own inverse."""
    half = t.shape[dim] // 2
    return torch.cat([t.narrow(dim, half, half), t.narrow(dim, 0, half)], dim=dim)


def _to_block_major(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] logical rows -> [E, K/128, N, 128] with shuffled rows."""
    e, n, k = w.shape
    shuffled = _bytes(w)[:, logical_rows(n, w.device).long()]
    return shuffled.view(e, n, k // TILE, TILE).permute(0, 2, 1, 3).contiguous().view(FP8)


def _from_block_major(w: torch.Tensor) -> torch.Tensor:
    """[E, K/128, N, 128] shuffled -> [E, N, K] logical rows."""
    e, kb, n, _ = w.shape
    flat = _bytes(w).permute(0, 2, 1, 3).reshape(e, n, kb * TILE)
    return flat[:, physical_rows(n, w.device).long()].contiguous().view(FP8)


def _bytes(w: torch.Tensor) -> torch.Tensor:
    # Index and permute FP8 as raw bytes: every op is then a pure byte move.
    return w.view(torch.uint8)


def prepare(ckpt: CheckpointWeights) -> ExpertWeights:
    """Checkpoint layout -> BlockMajorK kernel layout (module docstring)."""
    _check_checkpoint(ckpt)
    w31 = swap_halves(ckpt.w13.view(torch.uint8), dim=1).view(FP8)
    return ExpertWeights(
        w13=_to_block_major(w31),
        w13_scale=swap_halves(ckpt.w13_scale, dim=1).contiguous(),
        w2=_to_block_major(ckpt.w2),
        w2_scale=ckpt.w2_scale.contiguous(),
    )


def unprepare(prepared: ExpertWeights) -> CheckpointWeights:
    """BlockMajorK kernel layout -> checkpoint layout (inverse of ``prepare``)."""
    w31 = _from_block_major(prepared.w13)
    return CheckpointWeights(
        w13=swap_halves(w31.view(torch.uint8), dim=1).view(FP8).contiguous(),
        w13_scale=swap_halves(prepared.w13_scale, dim=1).contiguous(),
        w2=_from_block_major(prepared.w2),
        w2_scale=prepared.w2_scale.contiguous(),
    )


def _check_checkpoint(ckpt: CheckpointWeights) -> None:
    e, n2, h = ckpt.w13.shape
    i = n2 // 2
    expected = {
        "w13": ((e, 2 * i, h), FP8),
        "w13_scale": ((e, 2 * i // TILE, h // TILE), torch.float32),
        "w2": ((e, h, i), FP8),
        "w2_scale": ((e, h // TILE, i // TILE), torch.float32),
    }
    if h % TILE or i % TILE:
        raise ValueError(f"hidden {h} and inter {i} must be multiples of {TILE}")
    for name, (shape, dtype) in expected.items():
        t = getattr(ckpt, name)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"{name}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}"
            )


# Test weights -----------------------------------------------------------------

#: Standard deviation of the random FP8 weight values: wide enough to use
#: e4m3's exponent range, far from its 448 limit.
WEIGHT_STD = 16.0


def random_checkpoint(
    experts: int, hidden: int, inter: int, generator: torch.Generator
) -> CheckpointWeights:
    """Realistic random experts on ``generator``'s device: FP8 weights of std
    ``WEIGHT_STD`` and positive FP32 block scales (0.5x to 1.5x a base) chosen
    so that unit-variance tokens give O(1) gate/up values and O(1) outputs,
    not zeros or saturation. Generated one expert at a time so that a full
    layer (1.7 GB of FP8) never needs its FP32 draft at once."""
    device = generator.device

    def fp8(*shape):
        out = torch.empty(*shape, dtype=FP8, device=device)
        for e in range(shape[0]):
            v = torch.randn(*shape[1:], generator=generator, device=device) * WEIGHT_STD
            out[e] = v.clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return out

    def scales(base, *shape):
        return base * (0.5 + torch.rand(*shape, generator=generator, device=device))

    # GEMM1 sums H products of std WEIGHT_STD x ~1; GEMM2 sums I products of
    # WEIGHT_STD x ~0.5 (SwiGLU of unit-scale gate/up).
    s1 = 1.0 / (WEIGHT_STD * hidden**0.5)
    s2 = 1.0 / (WEIGHT_STD * 0.5 * inter**0.5)
    return CheckpointWeights(
        w13=fp8(experts, 2 * inter, hidden),
        w13_scale=scales(s1, experts, 2 * inter // TILE, hidden // TILE),
        w2=fp8(experts, hidden, inter),
        w2_scale=scales(s2, experts, hidden // TILE, inter // TILE),
    )


def random_moe_weights(
    shape: MoEShape, generator: torch.Generator
) -> tuple[MoEWeights, CheckpointWeights, CheckpointWeights | None]:
    """Random routed (+ shared) experts for ``shape`` on ``generator``'s
    device: the prepared
    ``MoEWeights`` and the checkpoint-layout routed and shared experts they were
    made from (the reference takes either)."""
    routed = random_checkpoint(shape.experts, shape.hidden, shape.inter, generator)
    shared = None
    if shape.shared_experts:
        shared = random_checkpoint(1, shape.hidden, shape.inter, generator)
    prepared = MoEWeights(prepare(routed), None if shared is None else prepare(shared))
    return prepared, routed, shared
