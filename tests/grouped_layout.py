"""What a grouped kernel's shared-memory layout must satisfy, stated from the
device code that uses it rather than from the builder (pure Python).

``grouped_common.Tables`` reads each region as a view of a fixed element
count, and indexes the barriers as full[stages], empty[stages],
acc_full[slots], acc_empty[slots], posted[posts]; the weight and token
stages are 128-byte-swizzled TMA / MMA operands (1024-byte atoms). Every
region must hold what its users read, start where they assume, and leave the
next region alone; the whole must fit the target's limit.
"""

from __future__ import annotations

from kernels import grouped_plan as gp
from runtime.constants import TILE

#: Alignment (bytes) each region's users assume; 16 for the rest.
ALIGN = {"w": 1024, "b": 1024, "bar": 8}
#: The dynamic shared-memory base is 1024-aligned; the size launched is the total.
BASE_ALIGN = 1024


def needed_bytes(layout: gp.SmemLayout, plan: gp.GroupedPlan) -> dict[str, int]:
    """Region -> the bytes its users touch."""
    w, f32 = plan.group, 4
    return {
        # A stage: depth 128 x 128 FP8 weight boxes, and depth token tiles of
        # group rows x 128 K bytes.
        "w": layout.stages * layout.a_bytes,
        "b": layout.stages * layout.b_bytes,
        "ring": layout.ring * plan.depth * w * f32,  # column scales of a stage
        "hs": layout.gatherers * w * plan.nk2 * f32,  # each gatherer's [group, nk2]
        "amax": 4 * w * f32,  # four warps' per-token amax
        "picks": plan.routes * 4,
        "mask": plan.experts * -(-plan.tokens // 32) * 4,  # one bit per token and expert
        "eoff": plan.experts * 4,
        "uexp": plan.max_units * 4,
        "uoff": (plan.max_units + 1) * 4,
        "ucnt": plan.max_units * 4,
        "flat": (plan.routes + plan.tokens) * 4,
        "scal": gp.SCALARS * 4,
        "desc": layout.posts * 4,  # one stage word per post
        "bar": (2 * layout.stages + 2 * layout.slots + layout.posts) * 8,
        "tmem": 4,  # the TMEM address tcgen05.alloc writes
    }


def layout_problems(layout: gp.SmemLayout, plan: gp.GroupedPlan, limit: int) -> list[str]:
    """Every way ``layout`` breaks the contract above (empty: none)."""
    problems = []
    need = needed_bytes(layout, plan)
    regions = layout.regions()
    names = [name for name, _, _ in regions]
    if sorted(names) != sorted(need):
        problems.append(f"regions {names}, expected {sorted(need)}")
    if layout.group != plan.group:
        problems.append(f"B tiles of {layout.group} tokens, the plan's units hold {plan.group}")
    if layout.depth != plan.depth:
        problems.append(f"stages of {layout.depth} K blocks, the plan's are {plan.depth}")
    if layout.a_bytes < plan.depth * TILE * TILE or layout.a_bytes % BASE_ALIGN:
        problems.append(f"a weight stage of {layout.a_bytes} B (depth boxes, 1024-aligned)")
    if layout.b_bytes < plan.depth * plan.group * TILE or layout.b_bytes % BASE_ALIGN:
        problems.append(f"a token stage of {layout.b_bytes} B (depth tiles, 1024-aligned)")
    if layout.bars * 8 != need["bar"]:
        problems.append(f"{layout.bars} barriers, the device indexes {need['bar'] // 8}")
    # The scale ring and stage words are read up to stages + slots stages
    # after they are written.
    for name, count in (("ring", layout.ring), ("posts", layout.posts)):
        if count <= layout.stages + layout.slots:
            problems.append(f"{name} {count} <= stages {layout.stages} + slots {layout.slots}")
    end = 0
    for name, start, _ in sorted(regions, key=lambda r: r[1]):
        align = ALIGN.get(name, 16)
        if start % align:
            problems.append(f"{name} at {start}, not {align}-aligned")
        if start < end:
            problems.append(f"{name} at {start} overlaps the region before (ends at {end})")
        end = start + need.get(name, 0)
    if end > layout.total:
        problems.append(f"the last region ends at {end}, past the total {layout.total}")
    if layout.total % BASE_ALIGN:
        problems.append(f"total {layout.total} is not a multiple of {BASE_ALIGN}")
    if layout.total > limit:
        problems.append(f"total {layout.total} B exceeds the limit {limit} B")
    return problems


def check_kernel_layout(kernel, arch: str) -> None:
    """A grouped kernel object's own layout fits ``arch``'s limit at the
    deepest stage count that does (``grouped_plan.stage_bounds`` of the
    plan's depth), every region as large and aligned as the device code
    needs."""
    from runtime.constants import SMEM_LIMIT

    lay, p = kernel.layout, kernel.plan
    limit = SMEM_LIMIT[arch]
    assert not layout_problems(lay, p, limit), layout_problems(lay, p, limit)
    most, fewest = gp.stage_bounds(p.depth)
    assert fewest <= lay.stages <= most
    if lay.stages < most:
        assert gp.smem_layout(p, lay.stages + 1, lay.gatherers, lay.slots).total > limit


def check_notes(kernel, arch: str, threads: int) -> dict:
    """A grouped kernel's compile notes follow the mega kernels' schema
    (``mega_common.notes``): ``smem_layout`` {name: [offset, bytes]} from the
    layout builder, ``stages`` x ``stage_bytes`` the ring (weight and token
    stages), the FC2 claim size as ``fc2_jobs_per_claim``, one CTA per SM,
    the arch's limit; returns the notes."""
    from runtime.constants import SMEM_LIMIT

    notes, lay = kernel.notes(), kernel.layout
    for key in ("stages", "stage_bytes", "ctas_per_sm", "threads", "smem_layout", "smem_limit",
                "fc2_jobs_per_claim", "accumulator_slots"):  # fmt: skip
        assert key in notes, key
    table = notes["smem_layout"]
    assert table == lay.table() and [n for n, _, _ in lay.regions()] == list(table)
    assert all(table[n][0] == o and table[n][1] <= size for n, o, size in lay.regions())
    assert notes["stages"] * notes["stage_bytes"] == table["w"][1] + table["b"][1]
    assert (notes["threads"], notes["ctas_per_sm"]) == (threads, 1)
    assert notes["smem_limit"] == SMEM_LIMIT[arch]
    assert notes["fc2_jobs_per_claim"] == kernel.plan.chunk
    return notes
