"""The mega kernel's plan (kernels/mega_plan.py), for both archs: the shapes
it serves, the work split, the cluster order, the weight boxes each CTA
streams and the B-tile swizzle. The kernels call these same functions (on
the DSL's integers), so a wrong formula here is a wrong cubin.

Expectations are derived from the layout contract (artifacts/FORMAT.md:
w13 [E, H/128, 2I, 128], w2 [E, I/128, H, 128]; one box = 128 rows x one K
block), never from the functions under test.
"""

from __future__ import annotations

import itertools

import pytest

from kernels import mega_plan as mp
from kernels import routing
from runtime.constants import SMEM_LIMIT, TILE

GLM5 = {"hidden": 4096, "inter": 512, "experts": 288, "top_k": 8}
ARCHS = tuple(mp.ARCH)
#: Shapes each arch's rules accept (for the enumerations below).
SHAPES = {
    "sm_90a": [GLM5, {**GLM5, "inter": 256}, {**GLM5, "hidden": 2048, "inter": 128},
               {**GLM5, "hidden": 8192, "inter": 1024, "top_k": 4},
               # Output row tiles that do not divide by the cluster (GLM-4.5,
               # Qwen3-30B), DeepSeek-V3's 56 K blocks, an odd K block count.
               {**GLM5, "hidden": 5120, "inter": 384, "experts": 160},
               {**GLM5, "hidden": 2048, "inter": 768, "experts": 128},
               {**GLM5, "hidden": 7168, "inter": 256, "experts": 256},
               {**GLM5, "hidden": 1152, "inter": 384, "experts": 64}],
    "sm_100a": [GLM5, {**GLM5, "hidden": 5120, "inter": 384, "experts": 160},
                {**GLM5, "hidden": 2048, "inter": 768, "experts": 128},
                {**GLM5, "hidden": 7168, "inter": 256, "experts": 256},
                {**GLM5, "hidden": 1152, "inter": 128, "experts": 64},
                {**GLM5, "hidden": 8192, "inter": 1024, "top_k": 4}],
}  # fmt: skip


def plan(arch="sm_90a", tokens=1, shared=1, sms=0, **shape) -> mp.MegaPlan:
    return mp.plan_for(arch, **{**GLM5, **shape}, tokens=tokens, shared_experts=shared, sms=sms)


def cases():
    for arch in ARCHS:
        for shape in SHAPES[arch]:
            for tokens in range(1, mp.MEGA_TOKENS + 1):
                for shared in (0, 1):
                    yield arch, shape, tokens, shared


@pytest.mark.parametrize("arch,shape,tokens,shared", list(cases()))
def test_every_cluster_is_one_route_or_one_shared_expert(arch, shape, tokens, shared):
    p = mp.plan_for(arch, **shape, tokens=tokens, shared_experts=shared)
    routes, shared_tokens = [], []
    for group in range(p.groups):
        route, token, is_shared = mp.cluster_role(p, group)
        if is_shared:
            shared_tokens.append(token)
        else:
            routes.append(route)
    assert sorted(routes) == list(range(tokens * shape["top_k"]))
    assert sorted(shared_tokens) == (list(range(tokens)) if shared else [])
    assert p.grid == p.cluster * (tokens * shape["top_k"] + tokens * shared)


@pytest.mark.parametrize("order", mp.ORDERS)
def test_orders_place_the_shared_clusters(order, monkeypatch):
    p = plan(tokens=2)
    monkeypatch.setitem(p.config.order, 2, order)
    roles = [mp.cluster_role(p, g) for g in range(p.groups)]
    where = [g for g, (_, _, s) in enumerate(roles) if s]
    if order == "shared_first":
        assert where == [0, 1]
        assert [r for r, _, s in roles if not s] == list(range(16))
    else:
        assert where == [16, 17]
        routes = [r for r, _, s in roles if not s]
        assert routes == (list(range(16)) if order == "shared_last" else list(range(15, -1, -1)))
    assert [t for _, t, s in roles if s] == [0, 1]


@pytest.mark.parametrize("sms", (0, 132))
@pytest.mark.parametrize("arch,shape", [(a, s) for a in ARCHS for s in SHAPES[a]])
def test_a_cluster_streams_each_weight_box_of_its_expert_once(arch, shape, sms):
    """Every weight box of the expert is streamed by exactly one CTA that
    stores its result; an uneven GEMM2 split adds only repeats of the last
    tile (never stored). With the SM count of an H200 the sm_90a kernel
    splits the K while the split grid is one wave (``mega_split``)."""
    p = mp.plan_for(arch, **shape, tokens=1, shared_experts=1, sms=sms)
    h, i, expert = shape["hidden"], shape["inter"], 5
    w13, w2 = [], []
    for rank in range(p.cluster):
        w13 += [mp.gemm1_box(p, rank, n, expert) for n in range(p.blocks1)]
        for m in range(p.loads - p.blocks1):
            box = mp.gemm2_box(p, rank, m, expert)
            if mp.stores_tile(p, rank, m // p.nk2):
                w2.append(box)
            else:  # past the end: the last tile again, never stored
                assert box[0] == h - TILE and not p.even2
    # w13: every 128-row tile of the 2I rows, at every K block of the expert.
    assert sorted(w13) == sorted(itertools.product(range(0, 2 * i, TILE),
                                                   range(expert * (h // TILE),
                                                         (expert + 1) * (h // TILE))))  # fmt: skip
    # w2: every 128-row tile of the H rows, at every hidden block of the expert.
    assert sorted(w2) == sorted(itertools.product(range(0, h, TILE),
                                                  range(expert * (i // TILE),
                                                        (expert + 1) * (i // TILE))))  # fmt: skip
    # A CTA's GEMM1 boxes are one row tile's K part, in K order; its GEMM2
    # rows are its own slice of H.
    for rank in range(p.cluster):
        rows = {mp.gemm1_box(p, rank, n, expert)[0] for n in range(p.blocks1)}
        blocks = [mp.gemm1_box(p, rank, n, expert)[1] for n in range(p.blocks1)]
        assert len(rows) == 1 and blocks == sorted(blocks)
        assert blocks[-1] - blocks[0] == p.blocks1 - 1
        rows2 = {mp.gemm2_box(p, rank, m, expert)[0] for m in range(p.loads - p.blocks1)
                 if mp.stores_tile(p, rank, m // p.nk2)}  # fmt: skip
        start = rank * p.rows2
        assert rows2 == set(range(start, min(start + p.rows2, h), TILE))
        assert len(rows2) * TILE == max(0, mp.slice_rows(p, rank))
        assert p.loads == p.blocks1 + p.tiles2 * p.nk2  # every CTA streams the same stages


@pytest.mark.parametrize("arch", ARCHS)
def test_b_tile_chunks_are_a_128_byte_swizzle(arch):
    p = plan(arch)
    seen = set()
    for tile in range(p.nk2):
        for row in range(p.config.b_rows):
            chunks = [mp.b_chunk(p, tile, row, c) for c in range(8)]
            base = tile * p.config.b_rows * TILE + row * TILE
            assert sorted(chunks) == [base + 16 * c for c in range(8)]  # a permutation of the row
            assert chunks[0] == base + 16 * (row % 8)  # chunk 0 of row r sits at r % 8
            seen.update(chunks)
    assert len(seen) == p.nk2 * p.config.b_rows * 8


@pytest.mark.parametrize("arch,shape,tokens,shared", list(cases()))
def test_shared_memory_regions_are_disjoint_aligned_and_fit(arch, shape, tokens, shared):
    p = mp.plan_for(arch, **shape, tokens=tokens, shared_experts=shared)
    table = p.regions.table()
    spans = sorted((off, off + size, name) for name, (off, size) in table.items())
    for (_, end, _), (start, _, _) in zip(spans, spans[1:], strict=False):
        assert end <= start
    assert p.smem == spans[-1][1] <= SMEM_LIMIT[arch]
    # MMA operands: 128-byte swizzle atoms need 1024-byte alignment.
    for name in ("stages", "b1", "b2"):
        assert table[name][0] % 1024 == 0
    assert table["stages"][1] == p.stages * 128 * 128
    assert table["b2"][1] == (shape["inter"] // TILE) * p.config.b_rows * TILE
    assert table["stage"][0] % 16 == 0  # 16-byte st.async sources
    assert table["bar"][0] % 8 == 0 and table["bar"][1] == 8 * p.bars
    assert table["xscale"][1] == 4 * p.blocks1 and table["hscale"][1] == 4 * p.nk2


def test_glm5_closed_forms():
    p90, p100 = plan("sm_90a"), plan("sm_100a")
    assert (p90.cluster, p90.split, p90.blocks1, p90.rows2, p90.tiles2) == (8, 1, 32, 512, 4)
    assert p90.loads == 32 + 4 * 4
    assert (p100.cluster, p100.split, p100.blocks1, p100.rows2, p100.tiles2) == (16, 2, 16, 256, 2)
    assert p100.loads == 16 + 2 * 4
    # M = 1: 8 routes and the shared expert.
    assert p90.groups == p100.groups == 9 and p90.grid == 72 and p100.grid == 144
    assert plan("sm_90a", tokens=4, shared=0).groups == 32


def test_sm90_splits_k_while_the_split_grid_is_one_wave():
    """sm_90a: 2 K parts where every cluster of the split grid is still
    resident at once at 3 CTAs per SM (``one_wave``) and the split cluster
    stays within 8 CTAs; never without an SM count (a shape check) and never
    for GLM-5."""
    tp8 = {"hidden": 7168, "inter": 256, "experts": 256}
    one = plan(tokens=1, sms=132, **tp8)
    # 9 clusters (8 routes + the shared expert) of 4 CTAs -> 9 of 8.
    assert (one.split, one.cluster, one.grid, one.blocks1) == (2, 8, 72, 28)
    assert one.regions.sizes["partial"] == TILE * 4 and one.bars == 2 * one.stages + 3
    assert plan(tokens=1, sms=0, **tp8).split == 1
    # M = 2..4: 18, 27, 36 eight-CTA clusters, the H200 holding 45 at 3 a SM.
    got = [plan(tokens=m, sms=132, **tp8) for m in (2, 3, 4)]
    assert [(p.split, p.grid, p.ctas_per_sm, p.stages) for p in got] == [
        (2, 144, 2, 6), (2, 216, 2, 6), (2, 288, 3, 3)]  # fmt: skip
    assert mp.resident_clusters("sm_90a", 132, 8, 3) == 45
    # 90 SMs hold 3 x 11 = 33 eight-CTA clusters (the bound): M = 4's 36
    # would be a second wave, so it stays at 36 four-CTA clusters.
    assert (plan(tokens=4, sms=90, **tp8).split, plan(tokens=4, sms=100, **tp8).split) == (1, 2)
    assert plan(tokens=1, sms=300, **tp8).split == 2  # 16 CTAs a cluster is too many
    for tokens in range(1, mp.MEGA_TOKENS + 1):
        for shared in (0, 1):
            assert plan(tokens=tokens, shared=shared, sms=132).split == 1  # GLM-5: 16 CTAs
    # 6-CTA clusters do not split (12 CTAs: more than 8), 12-CTA ones neither.
    assert plan(tokens=1, sms=132, hidden=5120, inter=384, experts=160).split == 1
    # Each part keeps at least the 8 rotating B tiles' K blocks.
    assert plan(tokens=1, sms=132, hidden=1920, inter=256).split == 1  # 15 K blocks: odd
    assert plan(tokens=1, sms=132, hidden=2048, inter=256).split == 2  # 16 -> 2 x 8
    assert plan(tokens=1, sms=132, hidden=1024, inter=128).split == 1  # 8: 2 x 4 too few


def test_dsmem_bytes_match_the_expected_transactions():
    """What ``hrecv``, ``gate_in`` and ``pair`` expect equals what the senders
    send: every up tile sends each CTA 8 chunks of 16 bytes (its FP8 hidden
    block) and one 4-byte scale; a gate tile sends its up tile 128 FP32
    values; with a K split, each part past 0 sends part 0 its 128 row sums."""
    tp8 = {"hidden": 7168, "inter": 256, "experts": 256}
    plans = [plan(arch) for arch in ARCHS] + [plan("sm_90a", sms=132, **tp8)]  # K split
    assert [p.split for p in plans] == [1, 2, 2]
    for p in plans:
        assert 8 * p.cluster <= 128  # the group of 128 threads covers every (peer, chunk)
        ups = [r // p.split for r in range(p.cluster) if r % p.split == 0 and r // p.split < p.nk2]
        assert ups == list(range(p.nk2))
        assert p.nk2 * (8 * 16 + 4) == p.nk2 * (TILE + 4)
        # Each row tile's parts are ranks tile * split + 0..split-1; part 0
        # receives 128 words from each other part (the ``partial`` region
        # holds them) and, for an up tile, from part 0 of its gate tile.
        for tile in range(p.tiles1):
            parts = [r for r in range(p.cluster) if r // p.split == tile]
            assert parts == [tile * p.split + q for q in range(p.split)]
        if p.split > 1:
            assert p.regions.sizes["partial"] == (p.split - 1) * TILE * 4
        gate_peers = [(t - p.nk2) * p.split for t in range(p.nk2, p.tiles1)]
        assert gate_peers == [u * p.split for u in range(p.nk2)]  # part 0 of up tiles 0..


@pytest.mark.parametrize(
    ("arch", "shape", "words"),
    [
        ("sm_90a", {"inter": 1152}, "cluster of at most 16"),
        ("sm_90a", {"hidden": 8320, "inter": 256}, "hidden/128 K blocks in 8..64"),
        ("sm_90a", {"hidden": 896, "inter": 128}, "hidden/128 K blocks in 8..64"),
        ("sm_90a", {"experts": 1056}, "ranks 1..1024"),
        ("sm_90a", {"top_k": 33}, "one route per lane"),
        ("sm_90a", {"experts": 6, "top_k": 8}, "min(32, experts)"),
        ("sm_90a", {"inter": 1000}, "multiples of 128"),
        ("sm_100a", {"inter": 1152}, "cluster of at most 16"),
        ("sm_100a", {"hidden": 8320}, "hidden/128 K blocks in 8..64"),
        ("sm_100a", {"hidden": 8064, "inter": 128}, "TMEM columns"),
        ("sm_100a", {"experts": 2048}, "ranks 1..1024"),
    ],
)
def test_refusals_name_the_rule(arch, shape, words):
    reasons = mp.problems(arch, **{**GLM5, **shape})
    assert reasons and any(words in r for r in reasons), reasons
    with pytest.raises(ValueError, match="cannot serve"):
        mp.plan_for(arch, **{**GLM5, **shape}, tokens=1, shared_experts=1)


def test_glm5_is_served_on_both_archs_and_other_inputs_are_refused():
    for arch in ARCHS:
        assert mp.problems(arch, **GLM5) == []
        assert mp.problems(arch, **GLM5, tokens=5)
        assert mp.problems(arch, **GLM5, shared_experts=2)
    assert mp.problems("sm_80", **GLM5)


def test_ring_depth_holds_every_cluster_at_its_ctas_per_sm():
    """sm_90a: with c CTAs per SM a target holds the clusters recorded for it
    (``RESIDENT_CLUSTERS``: what the H200's driver reported), else at most c
    * (sms // cluster) (``resident_clusters``); a variant takes the fewest
    CTAs per SM at which its call's clusters are all resident (else the
    most), and the ring is as deep as the shared memory at that occupancy
    allows. GLM-5 at M = 1..4: 1, 2, 2, 3 CTAs per SM with 10, 6, 6, 3 stages
    (what was measured best, docs/notes/mega-sm90.md)."""
    glm5 = [plan("sm_90a", tokens=m, sms=132) for m in range(1, mp.MEGA_TOKENS + 1)]
    assert [(p.ctas_per_sm, p.stages) for p in glm5] == [(1, 10), (2, 6), (2, 6), (3, 3)]
    # The H200's recorded counts (GPC boundaries: fewer than 132 // cluster)...
    assert [mp.resident_clusters("sm_90a", 132, 8, c) for c in (1, 2, 3)] == [15, 30, 45]
    assert [mp.resident_clusters("sm_90a", 132, 6, c) for c in (1, 2)] == [17, 39]
    assert mp.resident_clusters("sm_90a", 132, 12, 1) == 7
    # ... and the bound where nothing is recorded: another SM count, another
    # arch, or past a recorded list's end.
    assert mp.resident_clusters("sm_90a", 114, 8, 2) == 2 * (114 // 8)
    assert mp.resident_clusters("sm_100a", 148, 16, 2) == 18
    assert mp.resident_clusters("sm_90a", 132, 6, 3) == 3 * 22
    # Two waves avoided: GLM-4.5's M = 2 (18 six-CTA clusters, 17 held at 1
    # CTA per SM) and Qwen3-30B's M = 1 (8 twelve-CTA clusters, 7 held) take 2.
    assert plan(tokens=2, sms=132, hidden=5120, inter=384, experts=160).ctas_per_sm == 2
    assert plan(tokens=1, shared=0, sms=132, hidden=2048, inter=768,
                experts=128).ctas_per_sm == 2  # fmt: skip
    for shape in SHAPES["sm_90a"]:
        for tokens in range(1, mp.MEGA_TOKENS + 1):
            p = plan("sm_90a", tokens=tokens, sms=132, **shape)
            levels = sorted(p.config.ring)
            c = p.ctas_per_sm
            held = mp.resident_clusters("sm_90a", 132, p.cluster, c)
            assert p.groups <= held or c == levels[-1]
            assert c == levels[0] or p.groups > mp.resident_clusters("sm_90a", 132, p.cluster,
                                                                     c - 1)  # fmt: skip
            assert p.ctas_per_sm * (p.smem + 1024) <= 228 * 1024
            # Fewer CTAs per SM, a deeper ring: the level's, or as deep as fits.
            assert mp.MIN_STAGES <= p.stages <= p.config.ring[c] <= p.config.ring[levels[0]]
            if p.stages < p.config.ring[c]:
                deeper = p._layout(p.stages + 1).end + 1024
                assert c * deeper > 228 * 1024, (shape, tokens)
    # Unknown SM count (a shape check): the deepest ring, the largest shared memory.
    assert plan("sm_90a", tokens=4).ctas_per_sm == 1


def test_sm90_hands_the_producer_warps_routing_over_in_shared_memory():
    """sm_90a: the producer warp routes (its pick for the loads and the block
    scales, then every route's weight for the finalize) and leaves both in
    shared memory for the MMA warps: one u32 and top_k FP32 words, inside the
    layout and apart from every other region; sm_100a has neither."""
    for shape in SHAPES["sm_90a"]:
        for top_k in (1, 8, routing.MAX_TOP_K):
            p = plan("sm_90a", tokens=2, sms=132, **{**shape, "top_k": top_k})
            sizes, offsets = p.regions.sizes, p.regions.offsets
            assert sizes["pick"] == 4 and sizes["route_weights"] == 4 * top_k
            spans = sorted((offsets[n], offsets[n] + sizes[n]) for n in sizes)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
            assert spans[-1][1] <= p.smem
    for shape in SHAPES["sm_100a"]:
        assert "pick" not in plan("sm_100a", **shape).regions.sizes


def test_mma_warps_wait_on_the_cluster_at_entry_only_where_ctas_share_an_sm():
    """sm_90a: the MMA warpgroup's cluster wait moves from just before GEMM1
    to the kernel's entry where the variant runs 2 or more CTAs per SM (its
    ring 6 or 3 stages deep): GLM-5 at M = 2..4, not M = 1 (1 CTA per SM, 10
    stages), nor a shape check without an SM count, nor Qwen3-30B's M = 1 at
    one CTA per SM on a target whose SM count records nothing (the bound
    holds its 8 twelve-CTA clusters at once)."""
    glm5 = [plan("sm_90a", tokens=m, sms=132) for m in range(1, mp.MEGA_TOKENS + 1)]
    assert [p.entry_cluster_wait for p in glm5] == [False, True, True, True]
    assert not plan("sm_90a", tokens=4).entry_cluster_wait
    qwen30b = {"hidden": 2048, "inter": 768, "experts": 128}
    assert plan(tokens=1, shared=0, sms=132, **qwen30b).entry_cluster_wait  # 7 held: 2 a SM
    assert not plan(tokens=1, shared=0, sms=200, **qwen30b).entry_cluster_wait


@pytest.mark.parametrize("arch,shape,tokens,shared", list(cases()))
def test_every_slice_of_final_has_one_last_arriver(arch, shape, tokens, shared):
    """The finalize's protocol (mega_common.finish_slice): a (token, rank)
    slice of ``final`` is written by the CTA of that rank in whichever of the
    token's clusters arrives last; every token has ``plan.arrivals`` clusters
    (its routes and its shared expert), and the arrival words of all
    (token, rank) pairs fit the ``arrivals`` workspace without overlap."""
    p = mp.plan_for(arch, **shape, tokens=tokens, shared_experts=shared)
    clusters = {t: 0 for t in range(tokens)}
    for group in range(p.groups):
        route, token, is_shared = mp.cluster_role(p, group)
        clusters[token if is_shared else route // shape["top_k"]] += 1
    assert set(clusters.values()) == {p.arrivals} == {shape["top_k"] + shared}
    words = {t * p.cluster + r for t in range(tokens) for r in range(p.cluster)}
    assert len(words) == tokens * p.cluster and max(words) * 4 + 4 <= p.arrival_bytes
    # The slices of the ranks tile the row: rows2 columns each, the last
    # ranks' cut at H (an uneven split).
    sizes = [max(0, mp.slice_rows(p, r)) for r in range(p.cluster)]
    assert sum(sizes) == shape["hidden"] and all(n % 8 == 0 for n in sizes)
    assert sizes[0] == p.rows2 and (p.even2 == (sizes == [p.rows2] * p.cluster))
