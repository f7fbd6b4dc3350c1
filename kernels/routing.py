"""Group-limited expert selection, written once for the device and the host
(pure Python: no cutlass, no torch).

A model with expert groups (DeepSeek-V3's ``noaux_tc``) keeps, per token, the
``groups_kept`` groups of ``E / groups`` consecutive experts with the largest
*group score*, the sum of the two largest selection keys' values (score +
bias) among the group's experts, a repeated value counting twice; ties go to
the lower group. Only the kept groups' experts can then be selected
(``runtime.reference.selection_keys`` states the same rule in torch).

The routing warp holds expert ``32 j + lane`` as candidate ``j`` of lane
``lane`` (``candidates(E)`` per lane; when 32 does not divide E the last row
is partial and its lanes past E hold key 0, "no candidate", which every rule
below ranks under every real key). The functions below run with one ``ops`` namespace per side:

* device (``kernels.moe_common``): values are the DSL's per-lane registers,
  ``ops.select`` is ``cutlass.select_``, ``ops.redux_max``/``redux_min`` are
  ``redux.sync`` over the warp, ``ops.key_value`` inverts
  ``float_order_key``;
* host (the CPU tests): values are vectors of the 32 lanes, the reductions
  broadcast the warp's result to every lane.

Only arithmetic, comparisons and those operations appear; Python branches
only on values fixed at compile time (shapes and candidate indices), so the
CPU tests run the selection the cubins contain.
"""

from __future__ import annotations

#: Lanes of the routing warp: candidate j of lane l is expert 32 j + l.
LANES = 32
#: Most routed experts a routing warp ranks (32 candidates per lane, held in
#: registers through the selection).
MAX_EXPERTS = 1024
#: Most routes a routing warp holds (lane k holds route k).
MAX_TOP_K = LANES
#: Most expert groups a kernel's routing warp ranks (each group costs three
#: warp reductions and the ranking ``groups**2`` comparisons).
MAX_GROUPS = 32
#: The order key of -inf (``ptx.float_order_key``): the key of an expert
#: outside a token's kept groups, below every finite key and above "taken" (0).
MASKED_KEY = 0x007FFFFF


def candidates(experts: int) -> int:
    """Candidates per lane of the routing warp for ``experts`` routed experts
    (rows of 32; the last one partial when 32 does not divide ``experts``)."""
    return -(-experts // LANES)


def experts_problems(experts: int, top_k: int) -> list[str]:
    """Why a routing warp cannot rank ``experts`` and hold ``top_k`` routes
    (empty: it can); every kernel's plan states its shapes with this."""
    reasons = []
    if not 1 <= experts <= MAX_EXPERTS:
        reasons.append(f"experts {experts}: the routing warp ranks 1..{MAX_EXPERTS} "
                       f"({MAX_EXPERTS // LANES} candidates per lane)")  # fmt: skip
    if not 1 <= top_k <= min(MAX_TOP_K, experts):
        reasons.append(f"top_k {top_k}: the routing warp holds one route per lane, "
                       f"1..min({MAX_TOP_K}, experts)")  # fmt: skip
    return reasons


def group_of(j: int, lane, size: int, ops):
    """The group of candidate ``j`` of ``lane`` (expert ``32 j + lane``) for
    groups of ``size`` experts: a Python int when 32 divides ``size`` (every
    lane's candidate j is then in the same group), else a per-lane value."""
    if size % 32 == 0:
        return (j * 32) // size
    return (ops.int32(j * 32) + lane) // size


def group_totals(keys, lane, experts: int, groups: int, ops) -> list:
    """Each group's score (FP32, warp-uniform), from the order keys of every
    lane's candidates (``keys[j]``: candidate j's key, uint32): per group the
    lane's two largest keys, then the warp's largest (``redux_max``), the
    lowest lane holding it (``redux_min``), and the largest of that lane's
    second and every other lane's first. Key 0 (no candidate) is below every
    real key."""
    per = len(keys)
    size = experts // groups
    totals = []
    lane_u = ops.uint32(lane)
    for g in range(groups):
        first = ops.uint32(0)
        second = ops.uint32(0)
        for j in range(per):
            where = group_of(j, lane, size, ops)
            if isinstance(where, int):
                if where != g:
                    continue
                key = keys[j]
            else:
                key = ops.select(where == g, keys[j], ops.uint32(0))
            above = key > first
            second = ops.select(above, first, ops.select(key > second, key, second))
            first = ops.select(above, key, first)
        best = ops.redux_max(first)
        holder = ops.redux_min(ops.select(first == best, lane_u, ops.uint32(32)))
        runner = ops.redux_max(ops.select(lane_u == holder, second, first))
        totals.append(ops.key_value(best) + ops.key_value(runner))
    return totals


def kept_groups(totals: list, kept: int, ops) -> list:
    """Per group, 1 when it is among the ``kept`` best ``totals`` (ties to the
    lower group), else 0 (int32, warp-uniform): a group is kept when fewer
    than ``kept`` groups rank ahead of it."""
    one, zero = ops.int32(1), ops.int32(0)
    keep = []
    for g in range(len(totals)):
        ahead = ops.int32(0)
        for h in range(len(totals)):
            if h < g:
                ahead = ahead + ops.select(totals[h] >= totals[g], one, zero)
            elif h > g:
                ahead = ahead + ops.select(totals[h] > totals[g], one, zero)
        keep.append(ops.select(ahead < kept, one, zero))
    return keep


def mask_dropped(keys, lane, experts: int, groups: int, keep: list, masked: int, ops) -> list:
    """``keys`` with the candidates outside the kept groups set to ``masked``
    (a new list; ``keep`` from ``kept_groups``)."""
    size = experts // groups
    out = []
    for j in range(len(keys)):
        where = group_of(j, lane, size, ops)
        if isinstance(where, int):
            allowed = keep[where]
        else:
            allowed = ops.int32(0)
            for g in range(groups):
                allowed = ops.select(where == g, keep[g], allowed)
        out.append(ops.select(allowed != ops.int32(0), keys[j], ops.uint32(masked)))
    return out


def keep_groups(keys, lane, experts: int, groups: int, kept: int, masked: int, ops) -> list:
    """The selection keys of one token after its group stage: ``keys`` with
    every candidate outside the token's ``kept`` best groups ``masked``."""
    totals = group_totals(keys, lane, experts, groups, ops)
    return mask_dropped(keys, lane, experts, groups, kept_groups(totals, kept, ops), masked, ops)
