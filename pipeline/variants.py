"""A config's variants: one compiled cubin per (kernel, arch, token bucket,
logits dtype, finalize)."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.spec import KernelSpec
from pipeline.config import BuildConfig


@dataclass(frozen=True)
class Variant:
    kernel: str
    arch: str
    tokens: int
    logits_dtype: str
    finalize: bool
    sms: int

    @property
    def name(self) -> str:
        """``{kernel}-{arch}-m{tokens}-{logits_dtype}[-final]`` (artifacts/FORMAT.md)."""
        suffix = "-final" if self.finalize else ""
        return f"{self.kernel}-{self.arch}-m{self.tokens}-{self.logits_dtype}{suffix}"

    def spec(self, config: BuildConfig) -> KernelSpec:
        """Every input that decides this variant's generated code."""
        m = config.model
        return KernelSpec(
            kernel=self.kernel,
            arch=self.arch,
            hidden=m.hidden,
            inter=m.inter,
            experts=m.experts,
            top_k=m.top_k,
            scale=m.routed_scale,
            limit=m.swiglu_limit,
            ue8m0=m.ue8m0,
            tokens=self.tokens,
            logits_dtype=self.logits_dtype,
            finalize=self.finalize,
            sms=self.sms,
            shared_experts=m.shared_experts,
            score=m.score,
            bias=m.bias,
            groups=m.groups,
            groups_kept=m.groups_kept,
            renormalize=m.renormalize,
        )


def expand(config: BuildConfig, archs=None, kernels=None) -> list[Variant]:
    """The config's variants in a stable order (kernel, arch, tokens, dtype,
    finalize), optionally restricted to some archs and kernels."""
    out = []
    for kernel, buckets in config.kernels.items():
        if kernels and kernel not in kernels:
            continue
        for target in config.targets:
            if archs and target.arch not in archs:
                continue
            for m in buckets.tokens:
                for dtype in config.logits_dtypes:
                    for fin in buckets.finalize:
                        out.append(Variant(kernel, target.arch, m, dtype, fin, target.sms))
    return out
