"""Group-limited expert selection and the warp's top-k merge, written once
for the device and the host (pure Python: no cutlass, no torch).

A model with expert groups (DeepSeek-V3's ``noaux_tc``) keeps, per token, the
``groups_kept`` groups of ``E / groups`` consecutive experts with the largest
*group score*, the sum of the two largest selection keys' values (score +
bias) among the group's experts, a repeated value counting twice; ties go to
the lower group. Only the kept groups' experts can then be selected
(``runtime.reference.selection_keys`` states the same rule in torch).

The routing warp holds expert ``32 j + lane`` as candidate ``j`` of lane
``lane``. The functions below run with one ``ops`` namespace per side:

* device (``kernels.moe_common``): values are the DSL's per-lane registers,
  ``ops.select`` is ``cutlass.select_``, ``ops.redux_max``/``redux_min`` are
  ``redux.sync`` over the warp, ``ops.key_value`` inverts
  ``float_order_key``, ``ops.shuffle_xor`` is ``shfl.sync.bfly``;
* host (the CPU tests): values are vectors of the 32 lanes, the reductions
  broadcast the warp's result to every lane, the shuffle permutes lanes.

Only arithmetic, comparisons and those operations appear; Python branches
only on values fixed at compile time (shapes and candidate indices), so the
CPU tests run the selection the cubins contain.
"""

from __future__ import annotations

#: Most expert groups a kernel's routing warp ranks (each group costs three
#: warp reductions and the ranking ``groups**2`` comparisons).
MAX_GROUPS = 32
#: The order key of -inf (``ptx.float_order_key``): the key of an expert
#: outside a token's kept groups, below every finite key and above "taken" (0).
MASKED_KEY = 0x007FFFFF


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


#: The expert of a padding entry in ``warp_best``'s lists (with key 0): it
#: ranks below every real candidate, a key-0 one too.
NO_EXPERT = 0xFFFFFFFF


def _ahead(ka, ea, kb, eb):
    """Whether candidate (key ``ka``, expert ``ea``) ranks before (``kb``,
    ``eb``): the larger key, ties to the lower expert (a strict total order
    on distinct experts)."""
    return (ka > kb) | ((ka == kb) & (ea < eb))


def _exchange(ks: list, es: list, i: int, j: int, ops) -> None:
    """Compare-exchange of entries ``i`` < ``j``: the one ranking first at ``i``."""
    swap = _ahead(ks[j], es[j], ks[i], es[i])
    ks[i], ks[j] = ops.select(swap, ks[j], ks[i]), ops.select(swap, ks[i], ks[j])
    es[i], es[j] = ops.select(swap, es[j], es[i]), ops.select(swap, es[i], es[j])


def warp_best(ks: list, es: list, width: int, ops) -> tuple[list, list]:
    """The warp's ``width`` best candidates, best first, the same lists in
    every lane: ``(keys, experts)``.

    ``ks``, ``es``: the lane's candidates' order keys and experts, sorted
    best first (``_ahead``'s order); ``width`` a power of two. Each lane
    keeps its ``width`` best (padded with key 0, ``NO_EXPERT``), then five
    butterfly rounds (``ops.shuffle_xor`` at offsets 1, 2, 4, 8, 16) merge
    it with the partner lane's list: the better of entry i and the
    partner's entry ``width - 1 - i`` gives the pair's ``width`` best as a
    bitonic sequence, which ``log2(width)`` rounds of compare-exchanges
    (Batcher's bitonic merge) sort. Both partners compute the same list, so
    after the fifth round every lane holds the warp's. No data-dependent
    branch; ``width * (2 * 5)`` shuffles, ``5 * width * (1 + log2(width) / 2)``
    comparisons (a selection round per route instead waits on two warp
    reductions in turn)."""
    if width & (width - 1):
        raise ValueError(f"width {width}: must be a power of two")
    keys = [ks[j] for j in range(min(width, len(ks)))]
    experts = [es[j] for j in range(min(width, len(es)))]
    keys += [ops.uint32(0)] * (width - len(keys))
    experts += [ops.uint32(NO_EXPERT)] * (width - len(experts))
    for offset in (1, 2, 4, 8, 16):
        other_k = [ops.shuffle_xor(k, offset) for k in keys]
        other_e = [ops.shuffle_xor(e, offset) for e in experts]
        for i in range(width):
            j = width - 1 - i
            take = _ahead(other_k[j], other_e[j], keys[i], experts[i])
            keys[i] = ops.select(take, other_k[j], keys[i])
            experts[i] = ops.select(take, other_e[j], experts[i])
        stride = width // 2
        while stride:
            for i in range(width):
                if not i & stride:
                    _exchange(keys, experts, i, i + stride, ops)
            stride //= 2
    return keys, experts
