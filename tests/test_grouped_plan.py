"""The grouped kernel's formulas against brute-force enumeration. The
device code calls these same functions (``grouped_plan``: written once for
Python and DSL integers), so what is checked here is what the cubins run."""

from __future__ import annotations

import itertools
import random

import pytest
from grouped_layout import layout_problems

from kernels import grouped_plan as gp
from kernels import routing
from runtime.constants import MAX_TOKENS, SMEM_LIMIT, TILE

GLM5 = dict(hidden=4096, inter=512, experts=288, top_k=8)


def plan(tokens=64, grid=132, **kw):
    return gp.GroupedPlan(**{**GLM5, **kw}, tokens=tokens, grid=grid)


# unit_capacity ---------------------------------------------------------------------


def degree_sequences(experts, tokens, routes):
    """Every feasible per-expert route count: 0..tokens each, summing to routes."""
    for counts in itertools.product(range(tokens + 1), repeat=experts - 1):
        last = routes - sum(counts)
        if 0 <= last <= tokens:
            yield (*counts, last)


def routing_of(counts, tokens, top_k):
    """A routing (each token top_k distinct experts) with these route counts:
    fill token slots column by column (a count <= tokens never lands twice
    on one token)."""
    slots = [[] for _ in range(tokens)]
    i = 0
    for e, n in enumerate(counts):
        for _ in range(n):
            slots[i % tokens].append(e)
            i += 1
    assert all(len(s) == top_k and len(set(s)) == top_k for s in slots)
    return slots


@pytest.mark.parametrize("group", [1, 2, 3, 4, 16])
@pytest.mark.parametrize(
    "experts,top_k,tokens", [(4, 1, 5), (4, 2, 6), (5, 3, 7), (3, 3, 4), (4, 4, 3), (6, 2, 9)]
)
def test_unit_capacity_is_the_max_over_routings(group, experts, top_k, tokens):
    best = max(
        sum(gp.ceil_div(n, group) for n in counts)
        for counts in degree_sequences(experts, tokens, tokens * top_k)
    )
    assert gp.unit_capacity(experts, top_k, tokens, group) == gp.ceil_div(tokens, group) + best


ARCHS = sorted(gp.UNIT_TOKENS)


def test_unit_widths():
    """Units of 16 tokens up to 16 tokens a call; above, sm_90a's hold 32
    (wgmma N = 32) and sm_100a's 16. Every width is a multiple of 16 (the
    MMAs' N steps) and at most 32 (a gatherer lane per token); ``GROUPS``
    lists each width once."""
    assert gp.GroupedPlan(**GLM5, tokens=16, grid=132, arch="sm_90a").group == 16
    assert gp.GroupedPlan(**GLM5, tokens=17, grid=132, arch="sm_90a").group == 32
    assert gp.GroupedPlan(**GLM5, tokens=64, grid=132, arch="sm_100a").group == 16
    assert gp.unit_group(64, "sm_120a") == gp.unit_group(64, "sm_100a")  # unknown arch
    widths = {g for pair in gp.UNIT_TOKENS.values() for g in pair}
    assert all(g % 16 == 0 and g <= 32 for g in widths)
    # The workspaces are sized for every width a plan can take.
    assert widths <= set(gp.GROUPS)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tokens", [8, 16, 17, 32, 48, 64, 96, 128, 133, 256, 300, 512])
def test_unit_capacity_is_reached(tokens, arch):
    """An adversarial routing of the real shape has exactly capacity units
    (greedy: one route per expert, then ``group`` more routes per extra unit)."""
    p = plan(tokens=tokens, arch=arch)
    g = p.group
    routes, experts = p.routes, p.experts
    counts = [1] * min(routes, experts) + [0] * max(0, experts - routes)
    left = routes - sum(counts)
    for e in itertools.cycle(range(experts)):
        if left < g:
            break
        if counts[e] + g <= tokens:
            counts[e] += g
            left -= g
    e = 0
    while left:  # leftovers onto experts that keep their unit count
        room = min(left, tokens - counts[e], -counts[e] % g)
        counts[e] += room
        left -= room
        e += 1
    units = gp.number_units(p, routing_of(counts, tokens, p.top_k))
    assert len(units) == p.max_units
    assert p.max_units <= gp.unit_capacity(p.experts, p.top_k)  # MAX_TOKENS sizing
    assert p.max_units * g <= gp.hidden_rows(p.experts, p.top_k)  # the hidden workspace


# Unit numbering --------------------------------------------------------------------


def random_routing(p, rng, skew):
    weights = [rng.random() ** skew for _ in range(p.experts)]
    ids = []
    for _ in range(p.tokens):
        picked = set()
        while len(picked) < p.top_k:
            picked.add(rng.choices(range(p.experts), weights)[0])
        row = list(picked)
        rng.shuffle(row)
        ids.append(row)
    return ids


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shared", [1, 0])
@pytest.mark.parametrize(
    "tokens,skew",
    [
        (8, 1),
        (16, 1),
        (32, 8),
        (48, 20),
        (64, 1),
        (64, 30),
        (96, 4),
        (128, 1),
        (128, 30),
        (320, 1),
        (512, 1),
        (512, 30),
    ],
)
def test_number_units(tokens, skew, shared, arch):
    rng = random.Random(tokens * 1000 + skew)
    p = plan(tokens=tokens, shared_experts=shared, arch=arch)
    g = p.group
    assert p.shared_units == shared * gp.ceil_div(tokens, g)
    ids = random_routing(p, rng, skew)
    u = gp.number_units(p, ids)
    assert len(u) <= p.max_units
    # The shared expert's units first, covering every token in order.
    shared = [t for i in range(p.shared_units) for t in u.tokens(i, p.top_k)]
    assert shared == list(range(tokens)) * p.shared_experts
    assert set(u.uexp[: p.shared_units]) == ({-1} if p.shared_experts else set())
    assert -1 not in u.uexp[p.shared_units :]
    # Routed units: experts ascending, each full but its last, tokens ascending,
    # and every route in exactly one unit.
    seen = []
    for i in range(p.shared_units, len(u)):
        e, rows = u.uexp[i], u.flat[u.uoff[i] : u.uoff[i] + u.ucnt[i]]
        assert 1 <= u.ucnt[i] <= g and u.uoff[i + 1] == u.uoff[i] + u.ucnt[i]
        assert all(ids[r // p.top_k][r % p.top_k] == e for r in rows)
        assert rows == sorted(rows)
        if i + 1 < len(u) and u.uexp[i + 1] == e:
            assert u.ucnt[i] == g
        seen += rows
    assert sorted(seen) == list(range(p.routes))
    assert u.uexp[p.shared_units :] == sorted(u.uexp[p.shared_units :])
    assert all(u.flat[u.eoff[e]] // p.top_k >= 0 for e in set(u.uexp) - {-1})
    assert len(u) == p.shared_units + sum(
        gp.ceil_div(sum(row.count(e) for row in ids), g) for e in range(p.experts)
    )


# Ranges, ownership and the FC1 cover -------------------------------------------------


@pytest.mark.parametrize("size", [1, 5, 127, 128, 131, 132, 133, 1000, 5120, 39168])
@pytest.mark.parametrize("grid", [1, 7, 132, 148])
def test_owner_agrees_with_ranges(size, grid):
    p = plan(grid=grid)
    lo = [c * size // grid for c in range(grid + 1)]
    for s in range(size):
        c = gp.owner(p, s, size)
        assert lo[c] <= s < lo[c + 1]


@pytest.mark.parametrize("units", [1, 2, 39, 40, 41, 42, 77, 306])
def test_halves_split_above_split_units(units):
    """Up to SPLIT_UNITS units one half holds them all; above, half A holds
    ceil(units / 2) and half B the rest; every CTA's ranges tile each half
    (CTA c from c * size // grid), and the FC2 job counts follow the halves."""
    p = plan(grid=7)
    split = units if units <= gp.SPLIT_UNITS else -(-units // 2)
    rs = [gp.ranges(p, units, cta) for cta in range(p.grid)]
    for cta, r in enumerate(rs):
        assert (r.units, r.split) == (units, split)
        assert (r.s1a, r.s1b) == (split * p.unit1, (units - split) * p.unit1)
        assert (r.j2a, r.j2b) == (split * p.tiles2, (units - split) * p.tiles2)
        assert (r.lo1a, r.lo1b) == (cta * r.s1a // p.grid, cta * r.s1b // p.grid)
    for size, lo, count in (("s1a", "lo1a", "n1a"), ("s1b", "lo1b", "n1b")):
        starts = [getattr(r, lo) for r in rs]
        counts = [getattr(r, count) for r in rs]
        assert [a + n for a, n in zip(starts, counts, strict=True)] == starts[1:] + [
            getattr(rs[0], size)
        ]


def check_cover(p, units):
    """Every FC1 stage of every unit once, in the right half; pair pieces
    consistent: one finisher per pair, publishers = the owner's wait count,
    at most one published partial per CTA and half (the ``partial``
    workspace), publish first and own last in a CTA's half."""
    seen = {}
    finishers, publishers, waits = {}, {}, {}
    for cta in range(p.grid):
        r = gp.ranges(p, units, cta)
        for n in range(r.n1a + r.n1b):
            word = gp.describe(p, r, n)
            fc2, half, unit, tile, kb, _, _ = gp.unpack(word)
            assert not fc2 and (half == 1) == (unit >= r.split)
            key = (unit, tile, kb)
            assert key not in seen, key
            seen[key] = cta
            for d in range(p.depth):  # the stage's K blocks stay in range
                assert kb + d < p.nk1
        per_half = {0: [], 1: []}
        for piece in gp.pieces(p, units, cta):
            per_half[piece.half].append(piece)
            pair = (piece.unit, piece.pair)
            if piece.role == "publish":
                publishers[pair] = publishers.get(pair, 0) + 1
            else:
                assert pair not in finishers
                finishers[pair] = cta
                waits[pair] = piece.pieces_before
        for half_pieces in per_half.values():
            published = [i for i, x in enumerate(half_pieces) if x.role == "publish"]
            owned = [i for i, x in enumerate(half_pieces) if x.role == "own"]
            assert published in ([], [0])
            assert owned in ([], [len(half_pieces) - 1])
    expected = {
        (unit, tile, kb)
        for unit in range(units)
        for tile in range(2 * p.pairs)
        for kb in range(0, p.nk1, p.depth)
    }
    assert set(seen) == expected
    assert set(finishers) == {(u, q) for u in range(units) for q in range(p.pairs)}
    for pair, count in waits.items():
        assert publishers.get(pair, 0) == count
    # The owner holds the pair's first stage.
    for (unit, q), cta in finishers.items():
        assert seen[(unit, q, 0)] == cta


@pytest.mark.parametrize(
    "units,grid", [(1, 132), (2, 132), (5, 132), (40, 132), (41, 132), (60, 148), (306, 132)]
)
def test_fc1_stages_covered_once(units, grid):
    check_cover(plan(grid=grid), units)


def test_fc1_cover_small_shapes():
    """Tiny shapes where pieces are long and short against the pair span."""
    for hidden, inter, grid, units in [(256, 256, 3, 1), (512, 256, 5, 3), (1024, 512, 7, 45),
                                       (640, 384, 5, 7), (128, 128, 3, 2), (384, 256, 11, 9)]:  # fmt: skip
        p = gp.GroupedPlan(hidden, inter, 32, 2, 16, grid)
        check_cover(p, units)


@pytest.mark.parametrize("hidden,inter,top_k,units", [
    (1024, 128, 1, 1), (1024, 128, 1, 3), (1024, 128, 2, 8), (2048, 128, 1, 2),
    (1024, 256, 1, 1), (4096, 128, 1, 1), (1024, 1024, 1, 1), (4096, 512, 1, 1),
])  # fmt: skip
def test_fc1_cover_halves_of_fewer_stages_than_ctas(hidden, inter, top_k, units):
    """A half of fewer FC1 stages than CTAs (a call of few units of a small
    shape: the padded M = 1 call of a top-1 model is one unit) leaves CTAs
    without stages between a pair's owner and its last piece; the owner
    waits for the pieces that exist (hidden 1024 x inter 128 at 132 CTAs
    hung on the H200 while it waited for last - first)."""
    p = gp.GroupedPlan(hidden, inter, 64, top_k, 8, 132, shared_experts=0)
    assert units * p.unit1 < p.grid
    check_cover(p, units)


@pytest.mark.parametrize("size", [0, 1, 16, 100, 131, 132, 133, 264, 1000])
def test_holds_stages_is_a_nonempty_range(size):
    """``holds_stages`` agrees with ``ranges``' stage counts in both halves,
    and ``pair_partials`` counts the CTAs after a pair's owner that hold its
    stages."""
    p = plan(grid=132)
    for cta in range(p.grid):
        lo, hi = cta * size // p.grid, (cta + 1) * size // p.grid
        assert gp.holds_stages(p, cta, size) == (hi > lo)
    for base in range(0, size - p.span + 1, p.span):
        first, last = gp.pair_owners(p, base, size)
        holders = {gp.owner(p, s, size) for s in range(base, base + p.span)}
        assert holders == {c for c in range(first, last + 1) if gp.holds_stages(p, c, size)}
        assert gp.pair_partials(p, first, last, size) == len(holders) - 1


@pytest.mark.parametrize("inter", [512, 384])
@pytest.mark.parametrize("units", [1, 40, 41, 306])
def test_fc2_jobs_cover_every_unit_tile(units, inter):
    p = plan(inter=inter)
    r = gp.ranges(p, units, 0)
    got = [gp.job_of(p, 0, j) for j in range(r.j2a)]
    got += [gp.job_of(p, r.split, j) for j in range(r.j2b)]
    assert sorted(got) == [(u, t) for u in range(units) for t in range(p.tiles2)]
    words = gp.fc2_words(p, 3, 7)
    assert len(words) == p.job and p.job * p.depth == p.nk2
    parts = [gp.unpack(w) for w in words]
    assert [x[4] for x in parts] == list(range(0, p.nk2, p.depth))
    assert parts[0][5] and parts[-1][6] and all(x[0] and x[2:4] == (3, 7) for x in parts)


@pytest.mark.parametrize(
    "hidden,inter", [(4096, 512), (512, 768), (256, 256), (5120, 384), (640, 256), (128, 128)]
)
@pytest.mark.parametrize("expert", [-1, 0, 5, 31])
def test_a_unit_streams_each_weight_box_of_its_expert_once(hidden, inter, expert):
    """The weight boxes (``weight_box``) of a unit's FC1 stages (its
    ``describe`` words) and of its FC2 jobs (``fc2_words``) are every box of
    its expert's GEMM1 and GEMM2 weights exactly once, from the expert's
    maps: w13 / w2 for a routed expert, s13 / s2 (expert 0) for the shared
    one, K-block coordinate expert * K/128 + kb in the (128, rows,
    experts * K/128) view."""
    p = gp.GroupedPlan(hidden, inter, 32, 2, 16, 1)
    r = gp.ranges(p, 1, 0)
    words = [gp.describe(p, r, n) for n in range(r.n1a + r.n1b)]
    words += [w for tile in range(p.tiles2) for w in gp.fc2_words(p, 0, tile)]
    got = []
    for word in words:
        fc2, _, unit, tile, kb, _, _ = gp.unpack(word)
        assert unit == 0
        index, row_tile, chunk = gp.weight_box(p, fc2, expert, tile, kb)
        got += [(index, row_tile, chunk + d) for d in range(p.depth)]
    e, shared = max(expert, 0), 2 if expert < 0 else 0
    want = [(shared, t, e * p.nk1 + k) for t in range(2 * p.pairs) for k in range(p.nk1)]
    want += [(shared + 1, t, e * p.nk2 + k) for t in range(p.tiles2) for k in range(p.nk2)]
    assert sorted(got) == sorted(want)


@pytest.mark.parametrize("hidden,inter,experts", [(256, 256, 32), (512, 768, 64)])
def test_scale_index_is_the_row_major_index_of_the_abi_shapes(hidden, inter, experts):
    """``scale_index`` of (expert, row tile, K block) enumerates w13_scale
    and w2_scale (kernels/abi.py shapes) in row-major order."""
    from kernels.abi import shapes

    p = gp.GroupedPlan(hidden, inter, experts, 2, 16, 1)
    table = shapes(hidden, inter, experts, 2, 16, 4, "float32")
    for fc2, name in ((False, "w13_scale"), (True, "w2_scale")):
        _, shape, _ = table[name]
        got = [gp.scale_index(p, fc2, e, t, k) for e, t, k in itertools.product(*map(range, shape))]
        assert got == list(range(len(got)))


@pytest.mark.parametrize("tokens", [16, 64])
@pytest.mark.parametrize("arch", ARCHS)
def test_b_tile_chunks_are_a_128_byte_swizzle(arch, tokens):
    """A stage's B tile: DEPTH tiles of ``group`` token rows x 128 K bytes;
    the 16-byte chunks of a row are a permutation of the row, chunk 0 of row
    r at r % 8 (the 128-byte swizzle of the MMA's shared-memory descriptor)."""
    layout = gp.fit_layout(plan(tokens=tokens, arch=arch), arch, 3)
    g = layout.group
    assert layout.depth == gp.DEPTH
    seen = set()
    for d in range(gp.DEPTH):
        for row in range(g):
            chunks = [gp.b_chunk(layout, d, row, c) for c in range(8)]
            base = (d * g + row) * TILE
            assert sorted(chunks) == [base + 16 * c for c in range(8)]
            assert chunks[0] == base + 16 * (row % 8)
            seen.update(chunks)
    assert len(seen) == gp.DEPTH * g * 8
    assert max(seen) + 16 == gp.DEPTH * g * TILE == layout.b_bytes


@pytest.mark.parametrize("inter", [512, 384])
@pytest.mark.parametrize("arch,gatherers,slots", [("sm_90a", 3, 0), ("sm_100a", 2, 16)])
def test_scale_ring_entries_live_a_whole_ring(arch, gatherers, slots, inter):
    """``ring_index``: a stage's DEPTH x group column scales are distinct
    entries of the ring region, and no stage's entries are reused before
    ``ring`` more stages were written (the readers lag at most stages +
    slots < ring stages behind)."""
    layout = gp.fit_layout(plan(inter=inter, arch=arch), arch, gatherers, slots)
    g = layout.group
    size = layout.ring * layout.depth * g
    entries = [
        [gp.ring_index(layout, n, d, t) for d in range(layout.depth) for t in range(g)]
        for n in range(3 * layout.ring)
    ]
    assert all(0 <= i < size for stage in entries for i in stage)
    for n in range(len(entries) - layout.ring + 1):
        window = [i for stage in entries[n : n + layout.ring] for i in stage]
        assert len(set(window)) == len(window) == size
    assert layout.ring > layout.stages + layout.slots


@pytest.mark.parametrize(
    "hidden,inter,depth",
    [(4096, 512, 2), (7168, 256, 2), (5120, 384, 1), (4096, 384, 1), (1152, 512, 1), (128, 128, 1)],
)
def test_stage_depth_divides_both_k_extents(hidden, inter, depth):
    """Two K blocks a stage when both GEMMs' K block counts are even, else
    one: a pair (FC1) and a job (FC2) are whole stages either way, and the
    ring holds the same bytes in flight."""
    p = plan(hidden=hidden, inter=inter)
    assert p.depth == gp.stage_depth(hidden, inter) == depth
    assert p.span * p.depth == 2 * p.nk1 and p.job * p.depth == p.nk2
    most, fewest = gp.stage_bounds(depth)
    assert most * depth == gp.MAX_STAGES * gp.DEPTH and fewest * depth == gp.MIN_STAGES * gp.DEPTH
    layout = gp.fit_layout(p, "sm_90a", 3)
    assert layout.depth == depth and fewest <= layout.stages <= most
    assert layout.a_bytes == depth * gp.STAGE_BYTES


def test_pack_roundtrip_and_end():
    rng = random.Random(1)
    for _ in range(2000):
        fields = (
            bool(rng.getrandbits(1)), rng.getrandbits(1), rng.getrandbits(gp.UNIT_BITS),
            rng.getrandbits(gp.TILE_BITS), rng.getrandbits(gp.KB_BITS),
            bool(rng.getrandbits(1)), bool(rng.getrandbits(1)),
        )  # fmt: skip
        word = gp.pack(*fields)
        assert gp.unpack(word) == fields and word != gp.END


# The device runs these formulas ------------------------------------------------------

#: The formulas of ``grouped_plan`` the device code calls itself (its docstring's list).
DEVICE_FORMULAS = (
    "ranges", "locate", "describe", "unpack", "fc2_word", "job_of", "pair_of", "pair_owners",
    "pair_partials", "holds_stages", "weight_box", "scale_index", "mask_slot", "rank_in_mask",
    "units_of", "unit_size", "ring_index", "b_chunk", "partial_slot", "pair_counter", "zero_share",
    "call_parity", "call_limit",
)  # fmt: skip


def test_the_device_code_calls_the_plan_formulas():
    """Each formula is called as ``gp.<name>(...)`` by the device modules, so
    the tests above exercise the code the kernels are compiled from (a copy
    in the device code would leave them checking a bystander)."""
    import ast
    from pathlib import Path

    root = Path(gp.__file__).parent
    called = set()
    for name in ("grouped_common.py", "grouped_moe_sm90.py", "grouped_moe_sm100.py"):
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if isinstance(node.func.value, ast.Name) and node.func.value.id == "gp":
                    called.add(node.func.attr)
    assert set(DEVICE_FORMULAS) <= called, sorted(set(DEVICE_FORMULAS) - called)
    for name in DEVICE_FORMULAS:
        assert f"``{name}``" in gp.__doc__, name


def test_local_routing_up_to_one_token_a_warp():
    """Calls of up to ``LOCAL_ROUTING_TOKENS`` route in every CTA (warp w token
    w of 8 warps); a bucket above takes the grid-wide wait, on both archs. CTA
    c quantizes token c, so a grid smaller than M takes it too (a GPU of 7
    SMs at M = 8 would otherwise wait for a count that never comes)."""
    for arch in ("sm_90a", "sm_100a"):
        served = [m for m in (1, 2, 4, 8, 16, 32, 64) if plan(tokens=m, arch=arch).local_routing]
        assert served == [1, 2, 4, 8], arch
    assert [g for g in (1, 4, 7, 8, 9) if plan(tokens=8, grid=g).local_routing] == [8, 9]
    assert plan(tokens=4, grid=4).local_routing and not plan(tokens=4, grid=3).local_routing


# Call parity ---------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [1, 2, 5, 132])
def test_call_parity_under_any_interleaving(grid):
    """Within a call, a CTA reads the counter after any number (< grid) of
    the others have counted; each call must see parity = call % 2."""
    rng = random.Random(grid)
    calls = 0
    for call in range(50):
        order = list(range(grid))
        rng.shuffle(order)
        counted, started = set(), []
        for cta in order:
            # CTAs that read before this one may have finished (a CTA counts
            # at its end, after its read).
            for other in rng.sample(started, rng.randint(0, len(started))):
                if other not in counted:
                    counted.add(other)
                    calls = gp.count_call(calls, grid)
            assert gp.call_parity(calls, grid) == call % 2
            started.append(cta)
        for other in order:
            if other not in counted:
                calls = gp.count_call(calls, grid)
        assert calls == (call + 1) % 2 * grid


# Workspaces, counters and shared memory ------------------------------------------------


def test_the_shared_units_fit_one_warp():
    """The routing warp writes the shared expert's unit table, one unit a
    lane: the plan refuses a bucket whose shared units (at the narrowest
    width) would outnumber the lanes, and MAX_TOKENS stays within it."""
    assert gp.ceil_div(MAX_TOKENS, min(gp.GROUPS)) <= routing.LANES == 32
    assert not gp.plan_problems(4096, 512, 288, 8, MAX_TOKENS)
    assert any("one a lane" in r for r in gp.plan_problems(4096, 512, 288, 8, 32 * 16 + 1))


def test_workspaces_and_counters():
    p = plan()
    c = p.counters
    units = gp.unit_capacity(p.experts, p.top_k)
    assert c.unit_ready == c.pairs + units * p.pairs
    assert c.jobs == c.unit_ready + units and c.finished == c.jobs + 2 == c.words - 1
    ws = {w.name: w for w in gp.workspaces(p.hidden, p.inter, p.experts, p.top_k, p.grid)}
    assert [n for n in ws] == ["plan_x", "plan_s", "hidden", "hscale", "partial", "counters"]
    assert ws["counters"].zero and not any(w.zero for n, w in ws.items() if n != "counters")
    assert ws["counters"].bytes == 4 * (2 * c.words + 1)
    assert ws["plan_x"].bytes == MAX_TOKENS * p.hidden
    rows = gp.hidden_rows(p.experts, p.top_k)
    assert rows == max(gp.unit_capacity(p.experts, p.top_k, MAX_TOKENS, g) * g for g in gp.GROUPS)
    assert ws["hidden"].bytes == rows * p.inter and ws["hscale"].bytes == rows * p.nk2 * 4
    # Every bucket's tables, on every arch, fit the MAX_TOKENS-sized workspaces.
    for tokens in (8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512):
        for arch in ARCHS:
            q = plan(tokens=tokens, arch=arch)
            assert q.max_units <= units and q.max_units * q.group <= rows


#: (hidden, inter, experts, top_k) the layout tests run over: glm5 and smaller shapes.
SHAPES = [(4096, 512, 288, 8), (256, 256, 32, 2), (1024, 512, 64, 4), (2048, 1024, 128, 8),
          (512, 768, 32, 1)]  # fmt: skip
GRIDS = [1, 7, 114, 132, 148]


def parity_words(p, c, units) -> dict[str, list[int]]:
    """Word offsets inside one parity block of every counter the kernel
    keeps there (kernels/grouped_common.py: ready tokens at the block's
    start, then pair arrivals ``pair_counter``, unit readiness, the FC2 job
    counters of halves A and B, finished CTAs)."""
    return {
        "ready": [0],
        "pairs": [gp.pair_counter(p, u, q) for u in range(units) for q in range(p.pairs)],
        "unit_ready": [c.unit_ready + u for u in range(units)],
        "jobs": [c.jobs, c.jobs + 1],
        "finished": [c.finished],
    }


@pytest.mark.parametrize("hidden,inter,experts,top_k", SHAPES)
def test_call_counter_and_parity_words_never_overlap(hidden, inter, experts, top_k):
    """The counters workspace: two parity blocks of ``words`` int32, then the
    call counter. No two counters share a word, the blocks are disjoint,
    the call counter lies in neither (a call zeroes the other parity's block
    while the previous call's CTAs may still count on the call counter), and
    everything fits the declared bytes, whatever the grid."""
    pairs = inter // TILE
    units = gp.unit_capacity(experts, top_k)  # sized for MAX_TOKENS
    c = gp.counters(experts, top_k, pairs)
    fields = parity_words(gp.GroupedPlan(hidden, inter, experts, top_k, MAX_TOKENS, 1), c, units)
    block = [w for words in fields.values() for w in words]
    assert len(set(block)) == len(block), "two counters of one parity share a word"
    assert len(block) == 1 + units * pairs + units + 2 + 1  # the documented counters
    assert 0 <= min(block) and max(block) < c.words
    for grid in GRIDS:
        for tokens in (1, 8, 64, 128, 256):
            assert gp.GroupedPlan(hidden, inter, experts, top_k, tokens, grid).counters == c
        blocks = [{parity * c.words + w for w in block} for parity in (0, 1)]
        assert not blocks[0] & blocks[1]
        assert c.calls not in blocks[0] | blocks[1], (c.calls, c.words)
        ws = {w.name: w for w in gp.workspaces(hidden, inter, experts, top_k, grid)}
        assert ws["counters"].zero and ws["counters"].bytes == 4 * c.total
        assert max(blocks[1] | {c.calls}) < c.total
        # start_call: CTA ``cta`` zeroes words cta * per_cta .. of the other
        # parity's block. Together: that whole block, and never the call counter.
        per_cta = gp.zero_share(c.words, grid)
        for parity in (0, 1):
            other = (1 - parity) * c.words
            zeroed = [other + cta * per_cta + i for cta in range(grid) for i in range(per_cta)
                      if cta * per_cta + i < c.words]  # fmt: skip
            assert len(set(zeroed)) == len(zeroed) and blocks[1 - parity] <= set(zeroed)
            assert c.calls not in zeroed and not set(zeroed) & blocks[parity]


def partial_piece_bytes(p) -> int:
    """Bytes of one published FC1 partial: a CTA's piece of an (up, gate)
    pair, two row tiles of TILE rows x ``group`` tokens in FP32."""
    return 2 * TILE * p.group * 4


def unit_counts(p) -> list[int]:
    """Unit counts worth checking: few, around the A/B split, the most."""
    top = gp.unit_capacity(p.experts, p.top_k)
    if top <= 3 * gp.SPLIT_UNITS:
        return list(range(1, top + 1))
    return sorted({1, 2, gp.SPLIT_UNITS, gp.SPLIT_UNITS + 1, gp.SPLIT_UNITS + 2, top - 1, top})


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("grid", [1, 7, 132])
@pytest.mark.parametrize("hidden,inter,experts,top_k", SHAPES[:4])
def test_partial_workspace_holds_every_published_partial(hidden, inter, experts, top_k, grid, arch):
    """A CTA publishes at most one FC1 partial per half (the piece that starts
    its range), at slot half * grid + cta of the ``partial`` workspace. The
    declared bytes cover the highest slot any unit count can write, found by
    enumerating every CTA's pieces."""
    declared = {w.name: w for w in gp.workspaces(hidden, inter, experts, top_k, grid)}
    p = gp.GroupedPlan(hidden, inter, experts, top_k, MAX_TOKENS, grid, arch=arch)
    need, split_published = 0, False
    for units in unit_counts(p):
        for cta in range(grid):
            slots = [gp.partial_slot(p, piece.half, cta)
                     for piece in gp.pieces(p, units, cta) if piece.role == "publish"]  # fmt: skip
            assert len(slots) == len(set(slots))  # one per CTA and half
            for slot in slots:
                need = max(need, (slot + 1) * partial_piece_bytes(p))
                split_published |= slot >= grid
    assert declared["partial"].bytes >= need, (declared["partial"].bytes, need)
    # Every shape here with more than SPLIT_UNITS units publishes in half B
    # (so the upper half of the workspace is written), except on one CTA.
    assert split_published == (grid > 1 and max(unit_counts(p)) > gp.SPLIT_UNITS)


@pytest.mark.parametrize("gatherers,slots", [(1, 0), (3, 0), (2, 4), (2, 16), (4, 32)])
@pytest.mark.parametrize("tokens", [1, 8, 17, 48, 64])
def test_fit_layout_keeps_the_device_contract(gatherers, slots, tokens):
    """The builder for any gatherer and slot counts (the kernels' own layouts
    are checked in test_grouped_sm100.py and test_grouped_sm90_compile.py):
    the deepest stage count in MIN_STAGES..MAX_STAGES that fits the limit,
    every region as large and aligned as its users need, none overlapping
    (``grouped_layout``)."""
    for arch, limit in SMEM_LIMIT.items():
        p = plan(tokens=tokens, arch=arch)
        layout = gp.fit_layout(p, arch, gatherers=gatherers, slots=slots)
        assert (layout.gatherers, layout.slots) == (gatherers, slots)
        assert gp.MIN_STAGES <= layout.stages <= gp.MAX_STAGES
        assert not layout_problems(layout, p, limit), layout_problems(layout, p, limit)
        if layout.stages < gp.MAX_STAGES:
            assert gp.smem_layout(p, layout.stages + 1, gatherers, slots).total > limit


def test_layout_contract_catches_a_short_region():
    """The contract check itself: a region placed over the last barrier, a
    ring one stage too shallow and a total over the limit are reported."""
    import dataclasses

    p = plan(tokens=64)
    layout = gp.fit_layout(p, "sm_100a", gatherers=2, slots=16)
    limit = SMEM_LIMIT["sm_100a"]
    assert not layout_problems(layout, p, limit)
    over = dataclasses.replace(layout, off_tmem=layout.off_bar + (layout.bars - 1) * 8)
    assert any("tmem" in r and "overlaps" in r for r in layout_problems(over, p, limit))
    shallow = dataclasses.replace(layout, ring=layout.stages + layout.slots)
    assert any(r.startswith("ring") for r in layout_problems(shallow, p, limit))
    assert any("exceeds" in r for r in layout_problems(layout, p, layout.total - 1))


def test_plan_refuses_unservable_shapes():
    with pytest.raises(ValueError, match="ranks 1..1024"):
        gp.GroupedPlan(4096, 512, 1056, 8, 64, 132)
    with pytest.raises(ValueError, match="tokens"):
        gp.GroupedPlan(4096, 512, 288, 8, MAX_TOKENS + 1, 132)
    with pytest.raises(ValueError, match="positive multiples of 128"):
        gp.GroupedPlan(4096, 320, 288, 8, 64, 132)
    with pytest.raises(ValueError, match="at most 64 blocks of 128"):
        gp.GroupedPlan(8320, 512, 288, 8, 64, 132)
    assert gp.plan_problems(4096, 512, 288, 8, 64) == []
    assert gp.plan_problems(8192, 384, 288, 8, 64) == []  # 64 K blocks: indices 0..63


def test_the_unit_field_bounds_each_bucket_not_the_largest_one():
    """The stage words hold a bucket's own units: 960 experts at top-8 have
    at most 972 units at 128 tokens (served) and 1044 at 256 (refused,
    naming the bucket), whatever MAX_TOKENS sizes the counters for."""
    assert gp.unit_capacity(960, 8, 128) < 1 << gp.UNIT_BITS <= gp.unit_capacity(960, 8, 256)
    assert gp.plan_problems(4096, 512, 960, 8, 128) == []
    (reason,) = gp.plan_problems(4096, 512, 960, 8, 256)
    assert "1044 units at 256 tokens" in reason and f"{gp.UNIT_BITS}-bit" in reason


def test_shape_rules_name_the_plan_limits(monkeypatch):
    from kernels.shapes import unsupported

    assert unsupported("grouped", "sm_90a", 4096, 512, 288, 8, 64) == []
    assert unsupported("grouped", "sm_90a", 5120, 384, 160, 8, 64) == []
    assert unsupported("grouped", "sm_90a", 1536, 512, 40, 8, 64) == []  # a partial row of 32
    reasons = unsupported("grouped", "sm_90a", 4096, 320, 1056, 8, 64)
    assert any("inter 320" in r for r in reasons) and any("experts 1056" in r for r in reasons)
    # Both archs' layouts at the bucket: a 32-route shape whose tables fill
    # sm_100a's shared memory at 224 tokens and sm_90a's at 192.
    assert unsupported("grouped", "sm_100a", 2176, 896, 512, 32, 192) == []
    for arch, tokens in (("sm_100a", 224), ("sm_90a", 192)):
        (reason,) = unsupported("grouped", arch, 2176, 896, 512, 32, tokens)
        assert reason.startswith(f"grouped {arch} shared memory"), reason
    # A target whose shared memory cannot hold the smallest ring.
    monkeypatch.setitem(SMEM_LIMIT, "sm_90a", 100 * 1024)
    assert any("shared memory" in r for r in unsupported("grouped", "sm_90a", 4096, 512, 288, 8, 8))


def test_fc2_claims_per_arch():
    """sm_90a claims 2 FC2 jobs at every bucket; sm_100a 2 up to 16 tokens and
    8 above; a plan without an arch (a shape check) takes sm_100a's; the spec's
    arch reaches the plan."""
    for tokens in (8, 16, 32, 64):
        assert gp.GroupedPlan(4096, 512, 288, 8, tokens, 132, 1, "sm_90a").chunk == 2
        assert gp.GroupedPlan(4096, 512, 288, 8, tokens, 148, 1, "sm_100a").chunk == (
            2 if tokens <= 16 else 8
        )
        assert gp.GroupedPlan(4096, 512, 288, 8, tokens, 148).chunk == (2 if tokens <= 16 else 8)


def test_stamps_sit_after_the_partials_of_a_diagnostics_build():
    """A diagnostics build's ``partial`` holds the FC1 partials, then one word
    per CTA and stamp point; a release build's holds the partials only; the
    build switch is the environment variable, exactly "1"."""
    grid = 132
    plain = {w.name: w for w in gp.workspaces(4096, 512, 288, 8, grid)}
    stamped = {w.name: w for w in gp.workspaces(4096, 512, 288, 8, grid, stamps=True)}
    points = len(gp.STAMP_POINTS)
    assert plain["partial"].bytes == gp.partial_bytes(grid)
    assert stamped["partial"].bytes == gp.partial_bytes(grid) + grid * points * 4
    assert {n: w for n, w in stamped.items() if n != "partial"} == {
        n: w for n, w in plain.items() if n != "partial"
    }
    last = gp.stamp_offset(grid, grid - 1, points - 1)
    assert gp.stamp_offset(grid, 0, 0) == gp.partial_bytes(grid)
    assert last + 4 == stamped["partial"].bytes
    assert len(set(gp.STAMP_POINTS)) == points and set(gp.STAMP_COUNTS) <= set(gp.STAMP_POINTS)
    assert gp.stamps_enabled({gp.STAMPS_ENV: "1"})
    assert not gp.stamps_enabled({gp.STAMPS_ENV: "0"}) and not gp.stamps_enabled({})
