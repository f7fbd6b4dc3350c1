"""Host-side statement of the mega kernel (pure Python: no cutlass, no torch).

The mega kernel runs every (token, expert) route of M tokens (M = 1..4), and
with a shared expert each token's shared expert, as one cluster of CTAs per
route in one launch. A cluster streams its expert's weights once:

* GEMM1 (W31 rows: I/128 up row tiles, then I/128 gate row tiles): CTA
  ``rank`` owns row tile ``rank // split`` over K part ``rank % split``
  (``blocks1`` = H/128/split K blocks). The parts of a row tile meet over
  DSMEM, each gate tile hands its values to the matching up tile, and each
  up tile's CTA turns its 128 values into one FP8 hidden K block (clamped
  SwiGLU, one scale) that it sends to every CTA of the cluster.
* GEMM2: CTA ``rank`` owns output rows ``rank * rows2 .. + rows2`` (``tiles2``
  row tiles of 128, ``gemm2_tile``) over all I/128 hidden K blocks. When the
  H/128 output row tiles do not divide by the cluster, ``tiles2`` rounds up:
  the last ranks' slices end at H, and a CTA past the end recomputes the
  last tile and stores nothing (``stores_tile``); every CTA streams the same
  number of stages, so the critical path is the one of an even split with
  that many tiles. The sm_90a kernel keeps at most ``GEMM2_GROUP`` tiles'
  accumulators live at once (``gemm2_groups``).

A CTA streams ``loads`` = blocks1 + tiles2 * I/128 weight stages (one 128 x
128 FP8 box each, ``gemm1_box`` then ``gemm2_box``) through a ring of
``stages``. The clusters of one launch are ordered by ``cluster_role``.

Per architecture (``ARCH``), each row tile's K runs in ``split`` parts
(``mega_split``). sm_90a (warpgroup MMA, B tiles of 8 token rows: ``wgmma
m64n8k32``) runs one CTA per row tile over the whole K, except where the
split grid is still one wave (``split_one_wave``, ``one_wave``): then K
doubles into parts while the cluster stays within 8 CTAs and each part keeps
at least 8 K blocks (2 parts for the TP8 shards' 4-CTA clusters at M = 1..4;
up to 4 at inter 128); sm_100a splits into the most parts, up to
8, that keep the cluster within 16 CTAs and divide H/128, each part's K
blocks the columns of UMMA N = 16 accumulators in TMEM (GLM-5: 8 row tiles x
2 K parts of 16 K blocks), 2 CTAs per SM with 256 columns each, or 1 with all
512 where the accumulators need more (``MegaPlan.alone``).
The CTAs per SM and the ring depth follow from the call's grid (sm_90a,
``occupancy``): the fewest CTAs per SM at which every cluster of a call is
resident at once (one wave), and the deepest ring that occupancy leaves the
shared memory for, since with fewer CTAs per SM each needs more bytes in
flight (``resident_clusters``: the count recorded for the target, as the
driver's cluster occupancy reported it on the H200 — 15 8-CTA clusters
resident at 1 CTA per SM, 30 at 2, 45 at 3; 17 6-CTA and 7 12-CTA at 1 —
else the SM count over the cluster size);
GLM-5's M * (top_k + 1) clusters then take 1, 2, 2 and 3 CTAs per SM at
M = 1..4. ``docs/notes/mega-sm90.md`` has the measurements behind each
choice.

The formulas here are written once, for Python integers and for the DSL's
integers alike (arithmetic and comparisons only; branches only on values
fixed at compile time), so the CPU tests of this module exercise the code the
cubins contain: the kernels call ``cluster_role``, ``gemm1_box``,
``gemm2_box`` and ``b_chunk`` themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels import routing
from kernels.smem import Regions
from runtime.constants import RESIDENT_CLUSTERS, SMEM_LIMIT, SMEM_PER_SM, SMEM_RESERVED, TILE

STAGE_BYTES = TILE * TILE  # one 128 x 128 FP8 weight box
#: Cluster orders: which clusters of the grid run the shared experts. The
#: first M ("shared_first": cluster g < M is token g's shared expert, the
#: routes follow in order), or the last M, after the routes in order
#: ("shared_last") or in reverse order ("shared_last_reversed").
ORDERS = ("shared_first", "shared_last", "shared_last_reversed")
MEGA_TOKENS = 4  # the largest bucket the mega kernel serves


@dataclass(frozen=True)
class MegaArch:
    """What one architecture's mega kernel fixes: at most ``max_split`` CTAs
    per GEMM1 row tile (K parts, ``mega_split``), ``b_rows`` token rows of a
    B tile (the MMA's N), ``ring`` = CTAs per SM -> ring depth (the CTAs per
    SM a variant takes: ``occupancy``), per token bucket the cluster
    ``order``, and the accumulator limits of its MMA."""

    arch: str
    max_split: int
    b_rows: int
    ring: dict[int, int]
    order: dict[int, str]
    #: The range of GEMM1 K blocks (hidden / 128) the kernel holds.
    k_blocks: tuple[int, int] = (8, 64)
    #: sm_100a: TMEM columns an SM holds (``tmem_alloc`` shares them among
    #: the CTAs of an SM).
    tmem_columns: int = 0
    #: Whether GEMM2 may split the output row tiles unevenly over the
    #: cluster (``gemm2_tile``); else hidden must divide by cluster * 128.
    uneven_gemm2: bool = False
    #: Most CTAs of a cluster (one per GEMM1 row tile and K part).
    max_cluster: int = 16
    #: Most CTAs of a cluster that splits K (``mega_split``).
    split_cluster: int = 16
    #: K splits only while every cluster of the split grid stays resident at
    #: once at the arch's most CTAs per SM (``mega_split``, ``one_wave``);
    #: False: always the most parts.
    split_one_wave: bool = False
    #: Fewest GEMM1 K blocks of a K part (sm_90a: the rotating B tiles).
    min_blocks: int = 1
    #: sm_100a: the ring depth of a variant whose accumulators (``tmem_alloc``)
    #: exceed the TMEM columns one of its ``ring`` CTAs per SM holds (GEMM2's
    #: row tiles on few CTAs: inter 128 or 256 with a hidden/128 that K splits
    #: into too few parts; ``MegaPlan.alone``). Such a variant runs alone on its SM, 1 CTA per SM
    #: with all the columns, and its shared memory must keep a second CTA off
    #: the SM (``problems``): the kernel relinquishes its allocation permit,
    #: so a second CTA there would wait for the first's columns. 0: refused.
    alone_ring: int = 0


ARCH = {
    "sm_90a": MegaArch(
        arch="sm_90a", max_split=8, b_rows=8,
        ring={1: 10, 2: 6, 3: 3},
        split_cluster=8, split_one_wave=True, min_blocks=8,
        order={1: "shared_last_reversed", 2: "shared_first", 3: "shared_first",
               4: "shared_last_reversed"},
        k_blocks=(8, 64), uneven_gemm2=True,
    ),
    "sm_100a": MegaArch(
        arch="sm_100a", max_split=8, b_rows=16,
        ring={2: 4}, alone_ring=8,
        order={m: "shared_last" for m in range(1, MEGA_TOKENS + 1)},
        tmem_columns=512, uneven_gemm2=True,
    ),
}  # fmt: skip


def resident_clusters(arch: str, sms: int, cluster: int, ctas_per_sm: int) -> int:
    """Clusters of ``cluster`` CTAs resident at once at ``ctas_per_sm`` on a
    target of ``arch`` with ``sms`` SMs (the config's ``targets[].sms``):
    the count recorded for that target (``RESIDENT_CLUSTERS``, measured with
    the driver's cluster occupancy), else ``sms // cluster`` per CTA per SM,
    an upper bound: GPC boundaries leave some SMs unfilled (the H200 holds
    15 eight-CTA clusters per CTA per SM, not 16, and 17 six-CTA ones, not
    22). ``moe-build bench`` records each variant's residency on the device
    it runs on."""
    counts = RESIDENT_CLUSTERS.get((arch, sms), {}).get(cluster, ())
    if ctas_per_sm <= len(counts):
        return counts[ctas_per_sm - 1]
    return ctas_per_sm * (sms // cluster)


def occupancy(arch: str, clusters: int, cluster: int, sms: int) -> int:
    """CTAs per SM of a variant of ``clusters`` clusters of ``cluster`` CTAs
    for a target of ``sms`` SMs: the fewest of the arch's ``ring`` levels at
    which every cluster is resident at once (``resident_clusters``), else the
    most; with ``sms`` 0 (unknown: a shape check) the fewest, whose ring is
    the deepest."""
    levels = sorted(ARCH[arch].ring)
    if sms <= 0:
        return levels[0]
    for c in levels:
        if clusters <= resident_clusters(arch, sms, cluster, c):
            return c
    return levels[-1]


def one_wave(arch: str, clusters: int, cluster: int, sms: int) -> bool:
    """Whether ``clusters`` clusters of ``cluster`` CTAs are all resident at
    once on a target of ``sms`` SMs at the arch's most CTAs per SM (its
    deepest ``ring`` level: ``resident_clusters``); False for ``sms`` 0."""
    return sms > 0 and clusters <= resident_clusters(arch, sms, cluster, max(ARCH[arch].ring))


def mega_split(arch: str, hidden: int, inter: int, groups: int = 0, sms: int = 0) -> int:
    """K parts of a GEMM1 row tile of a variant of ``groups`` clusters for a
    target of ``sms`` SMs: doubled (a power of two up to the arch's
    ``max_split``) while the cluster (row tiles x parts) stays within
    ``split_cluster`` CTAs, the parts divide the K blocks and keep at least
    ``min_blocks`` each, and, where the arch sets ``split_one_wave``, every
    cluster of the split grid stays resident at once (``one_wave``: more CTAs
    a route stream its weights in parallel and spread the call over more
    SMs, at the cost of a DSMEM reduction; a second wave would cost a whole
    call's time again). With ``sms`` 0 (a shape check) such an arch does not
    split.

    sm_90a: a TP8 shard (inter 256: 4-CTA clusters) runs 9 clusters at M = 1,
    36 CTAs, 43% of the copy bandwidth on the H200; 2 parts make 72 CTAs, as
    GLM-5's M = 1 runs unsplit. At M = 2 and 3 (72 and 108 CTAs) the split
    (twice the CTAs, 2 per SM) gained up to 6 us on the 7168-hidden shards,
    and at M = 4 (144 CTAs at 2 per SM, 6 stages, 168 registers with a spill,
    against 288 at 3 per SM, 3 stages, 114 registers) 3-5 us
    (``docs/notes/mega-sm90.md``). Split clusters stay within 8 CTAs there:
    the H200 holds fewer 12- and 16-CTA clusters at once than its SM count
    allows (7 of each at one CTA per SM)."""
    cfg = ARCH[arch]
    tiles1, nk1 = 2 * inter // TILE, hidden // TILE
    split = 1
    while (split * 2 <= cfg.max_split and tiles1 * split * 2 <= cfg.split_cluster
           and nk1 % (split * 2) == 0 and nk1 // (split * 2) >= cfg.min_blocks):  # fmt: skip
        if cfg.split_one_wave and not one_wave(arch, groups, tiles1 * split * 2, sms):
            break
        split *= 2
    return split


#: The shallowest ring a mega variant runs (the producer keeps two boxes in
#: flight while the MMA reads a third).
MIN_STAGES = 3
#: sm_90a GEMM1 B operand: 8 rotating tiles (tile b only ever holds a token
#: K block in row b, so a refill needs no zeroing), refilled 4 K blocks at a time.
B1_ROTATING = 8
#: Most GEMM2 row tiles whose accumulators the sm_90a kernel keeps live at
#: once (8 registers a tile per thread; GLM-5's 4 tiles run as one group).
GEMM2_GROUP = 4


@dataclass(frozen=True)
class MegaPlan:
    """One mega variant's shapes, work split, ring and shared-memory layout
    (``regions``: bytes from the 1024-aligned dynamic base)."""

    arch: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    tokens: int
    shared_experts: int
    #: The target's SM count (``KernelSpec.sms``); 0 for a shape check.
    sms: int = 0
    regions: Regions = field(compare=False, repr=False, default_factory=Regions)

    @property
    def config(self) -> MegaArch:
        return ARCH[self.arch]

    # Shapes --------------------------------------------------------------------------
    @property
    def nk1(self) -> int:  # GEMM1 K blocks (hidden / 128)
        return self.hidden // TILE

    @property
    def nk2(self) -> int:  # GEMM2 K blocks = hidden blocks = up row tiles
        return self.inter // TILE

    @property
    def tiles1(self) -> int:  # GEMM1 row tiles (up, then gate)
        return 2 * self.inter // TILE

    @property
    def split(self) -> int:  # K parts of a GEMM1 row tile (CTAs per row tile)
        return mega_split(self.arch, self.hidden, self.inter, self.groups, self.sms)

    @property
    def cluster(self) -> int:
        return self.tiles1 * self.split

    @property
    def blocks1(self) -> int:  # GEMM1 K blocks of one CTA (its K part)
        return self.nk1 // self.split

    @property
    def sets1(self) -> int:  # sm_100a: GEMM1 accumulators of b_rows columns (K blocks)
        return -(-self.blocks1 // self.config.b_rows)

    @property
    def tmem_alloc(self) -> int:
        """sm_100a: TMEM columns a CTA allocates, a power of two >= 32 holding
        GEMM1's ``sets1`` and GEMM2's ``tiles2`` accumulators of ``b_rows``
        columns each."""
        need = self.config.b_rows * (self.sets1 + self.tiles2)
        return max(32, 1 << (need - 1).bit_length())

    @property
    def tiles_out(self) -> int:  # GEMM2 output row tiles (hidden / 128)
        return self.hidden // TILE

    @property
    def tiles2(self) -> int:  # GEMM2 row tiles of one CTA (the last may be past H)
        return -(-self.tiles_out // self.cluster)

    @property
    def even2(self) -> bool:  # every CTA's tiles lie inside the output
        return self.tiles_out % self.cluster == 0

    @property
    def rows2(self) -> int:  # GEMM2 output rows of one CTA's slice (fewer past H)
        return self.tiles2 * TILE

    @property
    def gemm2_groups(self) -> tuple[tuple[int, int], ...]:
        """sm_90a: (first tile, tiles) of each group of at most GEMM2_GROUP
        tiles whose accumulators are live together."""
        size = min(self.tiles2, GEMM2_GROUP)
        return tuple((t, min(size, self.tiles2 - t)) for t in range(0, self.tiles2, size))

    @property
    def loads(self) -> int:  # weight stages one CTA streams
        return self.blocks1 + self.tiles2 * self.nk2

    # Clusters ------------------------------------------------------------------------
    @property
    def routes(self) -> int:
        return self.tokens * self.top_k

    @property
    def shared(self) -> int:  # shared-expert clusters (one per token)
        return self.tokens * self.shared_experts

    @property
    def groups(self) -> int:  # clusters of the grid
        return self.routes + self.shared

    @property
    def grid(self) -> int:
        return self.cluster * self.groups

    @property
    def arrivals(self) -> int:
        """Clusters that write one token's rows: its routes and its shared
        expert. The finalize of a (token, rank) slice runs in the CTA of rank
        ``rank`` that arrives last of that many."""
        return self.top_k + self.shared_experts

    @property
    def arrival_bytes(self) -> int:
        """The ``arrivals`` workspace: one u32 per (token, rank)."""
        return 4 * self.tokens * self.cluster

    @property
    def order(self) -> str:
        return self.config.order[self.tokens]

    @property
    def stages(self) -> int:  # ring depth (``_ring_depth``), as the layout holds it
        return self.regions.sizes["stages"] // STAGE_BYTES

    def _ring_depth(self) -> int:
        """The arch's ``ring`` at the variant's CTAs per SM (``alone_ring``
        for a variant ``alone`` on its SM), fewer where that many CTAs of this
        shape would not fit an SM's shared memory (``SMEM_PER_SM``) or one
        would pass a CTA's (``SMEM_LIMIT``), at least MIN_STAGES."""
        c = self.ctas_per_sm
        deepest = self.config.alone_ring if self.alone else self.config.ring[c]
        for stages in range(deepest, MIN_STAGES, -1):
            end = self._layout(stages).end
            if end <= SMEM_LIMIT[self.arch] and c * (end + SMEM_RESERVED) <= SMEM_PER_SM[self.arch]:
                return stages
        return MIN_STAGES

    @property
    def alone(self) -> bool:
        """sm_100a: whether the accumulators need more TMEM columns than one
        of ``occupancy``'s CTAs per SM holds, so the variant runs 1 CTA per SM
        (``MegaArch.alone_ring``)."""
        cfg = self.config
        if not cfg.alone_ring:
            return False
        c = occupancy(self.arch, self.groups, self.cluster, self.sms)
        return c > 1 and self.tmem_alloc > cfg.tmem_columns // c

    @property
    def ctas_per_sm(self) -> int:
        if self.alone:
            return 1
        return occupancy(self.arch, self.groups, self.cluster, self.sms)

    @property
    def entry_cluster_wait(self) -> bool:
        """sm_90a: whether the MMA warpgroup waits on the cluster barrier at
        entry, before the PDL wait, rather than just before GEMM1 (after the
        token's quantization, the producer warp's pick and the scale loads).
        Where the variant runs 2 or more CTAs per SM (rings of 6 or 3
        stages): on the H200 the wait before GEMM1 cost GLM-5.3 0.4-0.7 us a
        call at M = 2..4 that the entry wait does not, while at 1 CTA per SM
        (10 stages) the entry wait read 0.1-0.3 us slower, about what two
        identical builds read apart (``docs/notes/mega-sm90.md``, "The MMA
        warps' cluster wait at entry")."""
        return self.ctas_per_sm > 1

    # Shared memory -------------------------------------------------------------------
    @property
    def b_bytes(self) -> int:  # one B tile: b_rows token rows of 128 K bytes
        return self.config.b_rows * TILE

    @property
    def b1_tiles(self) -> int:
        return B1_ROTATING if self.arch == "sm_90a" else self.blocks1

    @property
    def bars(self) -> int:
        return self._bars(self.stages)

    def _bars(self, stages: int) -> int:
        """mbarriers: full[stages], empty[stages], gate_in, hrecv; sm_100a
        also acc1, b_ready, acc2[tiles2], pair and one spare; sm_90a pair
        where K splits."""
        if self.arch == "sm_100a":
            extra = 2 + self.tiles2 + 2
        else:
            extra = 1 if self.split > 1 else 0
        return 2 * stages + 2 + extra

    @property
    def smem(self) -> int:
        return self.regions.end

    def offset(self, name: str) -> int:
        return self.regions.offsets[name]

    def __post_init__(self):
        object.__setattr__(self, "regions", self._layout(self._ring_depth()))

    def _layout(self, stages: int) -> Regions:
        """The shared-memory regions at ``stages`` ring stages."""
        r = Regions()
        r.take("stages", stages * STAGE_BYTES, 1024)
        r.take("b1", self.b1_tiles * self.b_bytes, 1024)
        r.take("b2", self.nk2 * self.b_bytes, 1024)
        if self.split > 1:
            r.take("partial", (self.split - 1) * TILE * 4)  # the other K parts' row sums
        r.take("gate", TILE * 4)  # gate values in logical row order
        r.take("stage", TILE)  # this up tile's FP8 hidden block
        r.take("amax", 16)  # per-warp amax of the hidden block
        r.take("hscale", 4 * self.nk2, 4)  # every hidden block's scale
        r.take("xscale", 4 * self.blocks1, 4)  # the token's activation scales
        r.take("flag", 4, 4)  # the finalize's "this CTA arrived last" word
        if self.arch == "sm_90a":
            r.take("pick", 4, 4)  # the route's expert, from the producer warp
            r.take("route_weights", 4 * self.top_k, 4)  # route k's weight at k
        r.take("bar", 8 * self._bars(stages), 8)
        if self.arch == "sm_100a":
            r.take("tmem", 16, 8)  # the TMEM allocation's address
        return r


def problems(arch: str, hidden: int, inter: int, experts: int, top_k: int, tokens: int = 1,
             shared_experts: int = 1) -> list[str]:  # fmt: skip
    """Why the mega kernel for ``arch`` cannot serve this shape (empty: it
    can): the one statement of the shapes mega serves."""
    if arch not in ARCH:
        return [f"arch {arch!r}: the mega kernel is built for {', '.join(ARCH)}"]
    cfg = ARCH[arch]
    reasons = []
    if not 1 <= tokens <= MEGA_TOKENS:
        reasons.append(f"tokens {tokens}: the mega kernel serves 1..{MEGA_TOKENS}")
    if shared_experts not in (0, 1):
        reasons.append(f"shared_experts {shared_experts}: the mega kernel runs 0 or 1")
    reasons += routing.experts_problems(experts, top_k)
    if hidden % TILE or inter % TILE or hidden < TILE or inter < TILE:
        reasons.append(f"hidden {hidden}, inter {inter}: must be positive multiples of {TILE}")
        return reasons
    tiles1, nk1, nk2 = 2 * inter // TILE, hidden // TILE, inter // TILE
    cluster = tiles1 * mega_split(arch, hidden, inter)
    if not 2 <= cluster <= cfg.max_cluster:
        reasons.append(f"inter {inter}: the {arch} mega kernel runs one CTA per GEMM1 row tile "
                       f"(and K part) in a cluster of at most {cfg.max_cluster}: inter at most "
                       f"{cfg.max_cluster * TILE // 2}")  # fmt: skip
    if not cfg.uneven_gemm2 and hidden % (cluster * TILE):
        reasons.append(f"hidden {hidden}: GEMM2 splits hidden over {cluster} CTAs in 128-row "
                       f"tiles: hidden must be a multiple of {cluster * TILE}")  # fmt: skip
    low, high = cfg.k_blocks
    if not low <= nk1 <= high:
        reasons.append(f"hidden {hidden}: the {arch} mega kernel holds hidden/128 K blocks "
                       f"in {low}..{high} (hidden {low * TILE}..{high * TILE})")  # fmt: skip
    if nk2 > cfg.b_rows:
        reasons.append(f"inter {inter}: inter/128 hidden blocks are columns of an "
                       f"N={cfg.b_rows} tile (at most {cfg.b_rows})")  # fmt: skip
    if cfg.tmem_columns and not reasons:
        plan = MegaPlan(arch, hidden, inter, experts, top_k, tokens, shared_experts)
        budget = cfg.tmem_columns // plan.ctas_per_sm
        if plan.tmem_alloc > budget:
            reasons.append(f"{plan.sets1} GEMM1 and {plan.tiles2} GEMM2 accumulators of "
                           f"{cfg.b_rows} TMEM columns exceed the {budget} columns of one of "
                           f"{plan.ctas_per_sm} CTAs per SM")  # fmt: skip
    if not reasons:
        plan = MegaPlan(arch, hidden, inter, experts, top_k, tokens, shared_experts)
        if plan.smem > SMEM_LIMIT[arch]:
            reasons.append(f"{plan.smem} B of shared memory exceed {arch}'s {SMEM_LIMIT[arch]}")
        elif plan.alone and 2 * (plan.smem + SMEM_RESERVED) <= SMEM_PER_SM[arch]:
            reasons.append(f"{plan.tmem_alloc} TMEM columns a CTA need it alone on its SM, but "
                           f"its {plan.smem} B of shared memory would let a second CTA "
                           f"share it")  # fmt: skip
    return reasons


def plan_for(arch: str, hidden: int, inter: int, experts: int, top_k: int, tokens: int,
             shared_experts: int, sms: int = 0) -> MegaPlan:  # fmt: skip
    """The plan of one variant for a target of ``sms`` SMs; ValueError naming
    every rule it breaks."""
    reasons = problems(arch, hidden, inter, experts, top_k, tokens, shared_experts)
    if reasons:
        raise ValueError(f"mega/{arch} cannot serve this shape: " + "; ".join(reasons))
    return MegaPlan(arch, hidden, inter, experts, top_k, tokens, shared_experts, sms)


def plan_of(spec) -> MegaPlan:
    """``plan_for`` of a ``kernels.spec.KernelSpec``."""
    return plan_for(spec.arch, spec.hidden, spec.inter, spec.experts, spec.top_k, spec.tokens,
                    spec.shared_experts, spec.sms)  # fmt: skip


# -- formulas the kernels run (Python or DSL integers) --------------------------------------


def cluster_role(plan: MegaPlan, group):
    """``(route, shared_token, is_shared)`` of cluster ``group``: a route
    r (token r // top_k, pick r % top_k) or token ``shared_token``'s shared
    expert, by ``plan.order``. ``route`` is meaningless for a shared cluster
    and ``shared_token`` for a route."""
    routes, shared = plan.routes, plan.shared
    if plan.order == "shared_first":
        return group - shared, group, group < shared
    route = group if plan.order == "shared_last" else routes - 1 - group
    return route, group - routes, group >= routes


def gemm1_box(plan: MegaPlan, rank, n, expert):
    """``(first row, K block)`` of the weight box of CTA ``rank``'s n-th
    GEMM1 stage (n < blocks1) for ``expert``, in the w13 map (rows of W31,
    K blocks ``expert * nk1 + kb``)."""
    part = rank % plan.split
    return (rank // plan.split) * TILE, expert * plan.nk1 + part * plan.blocks1 + n


def gemm2_tile(plan: MegaPlan, rank, t, minimum=min):
    """The output row tile of CTA ``rank``'s t-th GEMM2 tile: ``rank *
    tiles2 + t``, clamped to the last tile when the split is uneven (a CTA
    past the end recomputes it; ``stores_tile`` says it stores nothing).
    ``minimum``: min of the caller's integers (``cutlass.min`` on the
    device)."""
    tile = rank * plan.tiles2 + t
    if plan.even2:
        return tile
    return minimum(tile, plan.tiles_out - 1)


def stores_tile(plan: MegaPlan, rank, t):
    """Whether CTA ``rank``'s t-th GEMM2 tile is its own (inside the output)."""
    return rank * plan.tiles2 + t < plan.tiles_out


def slice_rows(plan: MegaPlan, rank, minimum=min):
    """Output rows (a multiple of 8) of CTA ``rank``'s slice: ``rows2``, fewer
    where the slice reaches past H (0 or less: none)."""
    if plan.even2:
        return plan.rows2
    return minimum(plan.rows2, plan.hidden - rank * plan.rows2)


def gemm2_box(plan: MegaPlan, rank, m, expert, minimum=min):
    """``(first row, K block)`` of CTA ``rank``'s m-th GEMM2 stage (its tile
    ``m // nk2``: ``gemm2_tile``; hidden block ``m % nk2``) in the w2 map."""
    if plan.even2:
        first = rank * plan.rows2 + (m // plan.nk2) * TILE
    else:
        first = gemm2_tile(plan, rank, m // plan.nk2, minimum) * TILE
    return first, expert * plan.nk2 + m % plan.nk2


def b_chunk(plan: MegaPlan, tile, row, chunk):
    """Byte offset, within a set of B tiles, of 16-byte chunk ``chunk`` of
    token row ``row`` of tile ``tile`` (128-byte swizzle: chunk c of row r is
    stored at c ^ (r % 8))."""
    return tile * plan.b_bytes + row * TILE + (chunk ^ (row % 8)) * 16
