"""Which model shapes each kernel can serve, without importing cutlass.

``config.validate`` calls ``unsupported`` for every (kernel, arch) a config
asks for, so a config the kernels cannot build is refused before any compile.
Each rule returns a sentence naming the quantity and the rule; an empty list
means the kernel can serve the shape.
"""

from __future__ import annotations

from kernels import grouped_plan, mega_plan
from runtime.constants import MAX_TOKENS


def unsupported(kernel: str, arch: str, hidden: int, inter: int, experts: int,
                top_k: int, tokens: int) -> list[str]:  # fmt: skip
    """Reasons (possibly none) why ``kernel`` for ``arch`` cannot serve this
    shape at ``tokens`` tokens."""
    reasons = []
    if tokens < 1 or tokens > MAX_TOKENS:
        reasons.append(f"tokens {tokens} outside 1..{MAX_TOKENS}")
    if kernel == "mega":
        reasons += mega_plan.problems(arch, hidden, inter, experts, top_k, tokens)
    elif kernel == "grouped":
        reasons += _grouped(arch, hidden, inter, experts, top_k, min(max(tokens, 1), MAX_TOKENS))
    else:
        reasons.append(f"unknown kernel {kernel!r}")
    return reasons


def _grouped(arch: str, hidden: int, inter: int, experts: int, top_k: int,
             tokens: int) -> list[str]:  # fmt: skip
    # The plan's routing warp, stage words and tiling, and the arch kernel's
    # shared memory at this bucket (the unit tables grow with it).
    reasons = grouped_plan.plan_problems(hidden, inter, experts, top_k, tokens)
    if arch in grouped_plan.GATHERERS and not reasons:
        plan = grouped_plan.GroupedPlan(hidden, inter, experts, top_k, tokens, 1, arch=arch)
        try:
            grouped_plan.arch_layout(plan, arch)
        except ValueError as e:
            reasons.append(f"grouped {arch} shared memory: {e}")
    return reasons
