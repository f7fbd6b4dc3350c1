"""Which model shapes each kernel can serve, without importing cutlass.

``config.validate`` calls ``unsupported`` for every (kernel, arch) a config
asks for, so a config the kernels cannot build is refused before any compile.
Each rule returns a sentence naming the quantity and the rule; an empty list
means the kernel can serve the shape.
"""

from __future__ import annotations

TILE = 128  # K blocks, scale blocks and row tiles
MAX_TOKENS = 64  # largest M any kernel serves (grouped plan, workspace sizes)


def unsupported(kernel: str, arch: str, hidden: int, inter: int, experts: int,
                top_k: int, tokens: int) -> list[str]:  # fmt: skip
    """Reasons (possibly none) why ``kernel`` for ``arch`` cannot serve this
    shape at ``tokens`` tokens."""
    reasons = []
    if tokens < 1 or tokens > MAX_TOKENS:
        reasons.append(f"tokens {tokens} outside 1..{MAX_TOKENS}")
    if kernel == "mega":
        reasons += _mega(arch, hidden, inter, experts, top_k)
    elif kernel == "grouped":
        reasons += _grouped(arch, hidden, inter, experts, top_k)
    else:
        reasons.append(f"unknown kernel {kernel!r}")
    return reasons


def _mega(arch: str, hidden: int, inter: int, experts: int, top_k: int) -> list[str]:
    if arch == "sm_90a":
        return _mega_sm90(hidden, inter, experts, top_k)
    reasons = []
    # The seed's 16-CTA cluster: CTA r owns GEMM1 row tile r // 2 and K half
    # r % 2, so 2I/128 row tiles x 2 halves must be 16 and each half 16 K blocks.
    if 2 * inter // TILE * 2 != 16:
        reasons.append(f"inter {inter}: the mega kernel needs 2*inter/128*2 == 16 (inter 512)")
    if hidden // TILE // 2 != 16:
        reasons.append(f"hidden {hidden}: the mega kernel needs hidden/128/2 == 16 (hidden 4096)")
    if experts > 1024:
        reasons.append(f"experts {experts}: the mega kernel routes at most 1024 experts per warp")
    return reasons


def _mega_sm90(hidden: int, inter: int, experts: int, top_k: int) -> list[str]:
    reasons = []
    # kernels/mega_moe_sm90.py: one CTA per GEMM1 row tile (cluster 2I/128,
    # at most 16), each over all H/128 K blocks as 8-column accumulator sets
    # (at most 8 sets; quantized 16 K blocks per pass); GEMM2 rows H/cluster
    # in 128-row tiles; lane k of the routing warp holds route k.
    cluster = 2 * inter // TILE
    if inter % TILE or cluster not in (2, 4, 8, 16):
        reasons.append(f"inter {inter}: the sm_90a mega kernel needs 2*inter/128 in 2, 4, 8, 16")
    elif hidden % (cluster * TILE):
        reasons.append(f"hidden {hidden}: the sm_90a mega kernel needs hidden % (2*inter) == 0")
    blocks = hidden // TILE
    if hidden % TILE or blocks % 16 or not 16 <= blocks <= 64:
        reasons.append(f"hidden {hidden}: the sm_90a mega kernel needs hidden/128 in 16..64, "
                       "a multiple of 16")  # fmt: skip
    if experts % 32 or experts > 1024:
        reasons.append(f"experts {experts}: the mega kernel routes a multiple of 32, at most 1024")
    if top_k > 32:
        reasons.append(f"top_k {top_k}: the mega kernel holds one route per lane (<= 32)")
    return reasons


def _grouped(arch: str, hidden: int, inter: int, experts: int, top_k: int) -> list[str]:
    reasons = []
    if experts > 1024:
        reasons.append(
            f"experts {experts}: the grouped kernel routes at most 1024 experts per warp"
        )
    if top_k > 32:
        reasons.append(f"top_k {top_k}: the grouped kernel writes one route per lane (<= 32)")
    # The plan's stage words and tiling (both archs), and sm_90a's shared
    # memory at the largest bucket (grouped_plan imports this module: late import).
    from kernels import grouped_plan

    reasons += grouped_plan.plan_problems(hidden, inter, experts, top_k, MAX_TOKENS)
    if arch == "sm_90a" and not reasons:
        plan = grouped_plan.GroupedPlan(hidden, inter, experts, top_k, MAX_TOKENS, 1)
        try:
            grouped_plan.fit_layout(plan, arch, gatherers=3)
        except ValueError as e:
            reasons.append(f"grouped sm_90a shared memory: {e}")
    return reasons
