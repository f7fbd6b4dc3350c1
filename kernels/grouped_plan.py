"""The grouped kernel's plan and formulas (pure Python: no cutlass, no torch).

The grouped kernel (one persistent CTA per SM) cuts one call's work into
*units*: up to ``group`` tokens of one expert (``unit_group``: the MMA's N
side), the shared expert's units first (tokens 0..group-1, group.., ...),
then every routed expert in expert order, its routes in token order, one
unit per started ``group`` of routes. Weights move
in *stages* of ``depth`` K blocks (128 x 128 FP8 boxes) of one row tile
(``DEPTH``, or 1 for a shape with an odd number of K blocks: ``stage_depth``):

* FC1: a unit has ``pairs`` = I/128 pairs (an up and a gate row tile); a
  pair is ``span`` stages (up kb, gate kb, up kb+2, gate kb+2, ...). All
  units' FC1 stages form one list cut into one contiguous range per CTA. A
  pair cut between CTAs is finished by its *owner*, the CTA holding its first
  stage (it reaches the pair at the end of its range); the others publish
  FP32 partials when they start their ranges.
* FC2: (unit, output row tile) *jobs* of ``job`` stages, claimed ``chunk``
  jobs at a time from a counter.
* Above ``SPLIT_UNITS`` units both lists are cut into halves A and B and every
  CTA runs FC1(A), FC1(B), FC2(A), FC2(B).

The formulas the device runs are written here once, for Python integers and
for the DSL's integers alike (arithmetic and comparisons only; a select, a
branch, min or popcount is passed in: ``pick``, ``choose``, ``min`` and
``int.bit_count`` on the host, the DSL's on the device; Python branches only
on values fixed at compile time), so
the CPU tests of this module exercise the code the cubins contain:
``grouped_common`` calls ``ranges``, ``locate``, ``describe`` (``pack``),
``unpack``, ``fc2_word``, ``job_of``, ``pair_of``, ``pair_owners``
(``owner``), ``pair_partials``, ``holds_stages``, ``weight_box``,
``scale_index``, ``mask_slot``, ``rank_in_mask``, ``units_of``, ``unit_size``,
``ring_index``, ``b_chunk``, ``partial_slot``,
``pair_counter``, ``zero_share``, ``call_parity`` and ``call_limit`` itself.
The rest (workspace sizes, the shared-memory layout, unit capacity) sizes
what the kernels are compiled with; ``number_units``, ``pieces`` and
``close_pair`` replay the device's unit tables and pair closes on the host
with the same formulas, for the tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kernels import routing
from kernels.smem import Regions, ceil_div
from kernels.spec import Workspace
from runtime.constants import MAX_TOKENS, SMEM_LIMIT, TILE
from runtime.constants import SMEM_OPTIN as SMEM_OPTIN  # re-exported for its readers

#: Tokens of a unit (the MMA's N side) per architecture: (calls of up to 16
#: tokens, larger calls). A unit's weights stream from HBM once per unit, so
#: an expert of more routes than ``group`` streams its weights once per
#: started group (the shared expert too, ceil(M / group) times). sm_90a's
#: wgmma takes N = 32 within the MMA warpgroup's registers (up and gate of 32
#: tokens plus two K blocks' partials: 128 FP32 a thread); its gatherers map
#: one token to a lane, so at most 32. sm_100a keeps the seed's 16.
#: Measurements: docs/notes/grouped-sm90.md ("Unit width"). Any other arch:
#: sm_100a's.
UNIT_TOKENS = {"sm_90a": (16, 32), "sm_100a": (16, 16)}
#: Every unit width a plan can have: the model-wide workspaces and counters
#: are sized for all of them (every bucket of a model shares one set).
GROUPS = tuple(sorted({g for widths in UNIT_TOKENS.values() for g in widths}))
DEPTH = 2  # K blocks of a weight stage (when both K extents divide by it)
#: Calls of up to this many tokens route every token in every CTA, one warp a
#: token (a CTA's 256 threads are 8 warps), so a CTA's unit tables need no
#: other CTA: its weight loads start once its own warps have routed, and only
#: its gatherers wait, before their first B tile, until every token's
#: quantized row is counted. It needs a CTA for each token too (CTA c
#: quantizes token c), so a grid below M takes the other path. Larger calls
#: route token c in CTA c and every CTA waits for all M before its tables
#: (docs/notes/grouped-sm90.md, "Routing in every CTA").
LOCAL_ROUTING_TOKENS = 8
SPLIT_UNITS = 40  # above this many units, halves A and B
STAGE_BYTES = TILE * TILE  # one FP8 128 x 128 box
#: How long a CTA waits on other CTAs' counters before it traps (ns of
#: ``%globaltimer``). The waits last microseconds when every CTA is resident
#: (the runtime launches the kernel cooperatively, which guarantees that);
#: the bound turns a wait that can never end (a CTA that never runs) into a
#: launch error instead of a hung GPU. Generous, so that a call slowed by
#: compute-sanitizer's instrumentation still ends normally.
WAIT_TIMEOUT_NS = 10_000_000_000

#: A diagnostics build: with this variable set to 1 at compile time (part of
#: the build-cache key: ``pipeline.toolchain.CODE_ENV``), the grouped kernels
#: record ``%globaltimer`` (low 32 bits, ns) at the points ``STAMP_POINTS``
#: of every CTA, after the FC1 partials in the ``partial`` workspace
#: (``stamp_offset``); ``benchmarks/grouped_timeline.py`` reads them.
#: Unset (every release build), the kernels' code is unchanged.
STAMPS_ENV = "MOE_BUILD_STAMPS"
#: Per CTA, in this order (word index = position): times of thread 0 at entry,
#: after the PDL wait; CTAs below M only: the router warp's lane 0 once token
#: ``cta`` is routed, the first quantizing thread once it quantized its part
#: (both before their release fence), thread 0 once both are done and fenced;
#: then thread 0 once every token is planned (with ``local_routing``, in
#: every CTA: warp 0's lane 0 once it routed token 0, thread 0 after the
#: routing's ``__syncthreads`` (no fence: the routes stay in shared memory),
#: the first gatherer once every token is counted); the producer's start
#: (unit tables done), end of its FC1 posts and of all posts; the MMA
#: consumer's first full stage, its last FC1 stage done, its first FC2 stage
#: full and its END; a gatherer's first FC2 unit ready; thread 0 after the
#: finalize's wait and at exit; then counts: FC1 stages, FC2 stages, units;
#: then ``STAMP_SUMS``.
STAMP_POINTS = (
    "entry", "pdl_wait", "route_done", "quantized", "routed", "tokens_ready", "tables", "fc1_posted", "all_posted",
    "first_full", "fc1_done", "first_fc2", "consumer_end", "fc2_ready", "finished", "exit",
    "fc1_stages", "fc2_stages", "units", "wait_full", "closing", "wait_empty",
)  # fmt: skip
#: The stamp points that hold counts, not times.
STAMP_COUNTS = ("fc1_stages", "fc2_stages", "units")
#: The stamp points that hold summed durations (ns, ``%globaltimer``
#: differences) over the call: one MMA consumer thread's time waiting for full
#: stages (``wait_full``: the stream or the gatherers are behind; it includes
#: the wait for the first stage and for the END) and in the closes
#: (``closing``: FC1 pair closes and FC2 row stores, the stages waiting
#: meanwhile), both sm_90a only (``CONSUMER_SUMS``); the producer's time
#: waiting for a free stage (``wait_empty``: the consumer is behind). Where
#: the consumer is the limit, ``wait_empty`` grows and ``wait_full`` shrinks.
#: The timer ticks in steps of about a microsecond, so a wait shorter than a
#: step reads 0 or one step: the sums are right on average over many waits,
#: not each wait.
STAMP_SUMS = ("wait_full", "closing", "wait_empty")
#: The sums only the sm_90a kernel's consumer records.
CONSUMER_SUMS = ("wait_full", "closing")


def stamps_enabled(environ=None) -> bool:
    """Whether this compile is a diagnostics build (``STAMPS_ENV`` = 1)."""
    return (os.environ if environ is None else environ).get(STAMPS_ENV, "") == "1"


def unit_group(tokens: int, arch: str = "") -> int:
    """Tokens of a unit in a ``tokens``-token variant for ``arch``
    (``UNIT_TOKENS``)."""
    small, large = UNIT_TOKENS.get(arch, UNIT_TOKENS["sm_100a"])
    return small if tokens <= 16 else large


def partial_bytes(grid: int) -> int:
    """Bytes of the FC1 partials: one piece per CTA and half, each two sets
    (up, gate) of group x TILE FP32, for the widest unit (``GROUPS``)."""
    return 2 * grid * 2 * max(GROUPS) * TILE * 4


def stamp_offset(grid: int, cta, point: int):
    """Byte offset in ``partial`` of CTA ``cta``'s stamp ``point`` (a
    diagnostics build: after the partials)."""
    return partial_bytes(grid) + (cta * len(STAMP_POINTS) + point) * 4


# Stage word: unit (bits 0-9), row tile (10-15), K block (16-21), FC2 (22),
# half (23), opens (24), closes (25). END ends a role's stage list.
UNIT_BITS, TILE_BITS, KB_BITS = 10, 6, 6
SHIFT_TILE, SHIFT_KB = 10, 16
BIT_FC2, BIT_HALF, BIT_OPENS, BIT_CLOSES = 22, 23, 24, 25
END = 0xFFFFFFFF

#: Stage counts tried, deepest first, for stages of DEPTH boxes (measured on
#: the H200: 4 to 12 stages of 16 KiB reach the copy bandwidth on long
#: streams, docs/notes/h200-measurements.md; a stage here is 32 KiB). Stages
#: of fewer boxes take proportionally more (``stage_bounds``).
MAX_STAGES, MIN_STAGES = 12, 4


def stage_depth(hidden: int, inter: int) -> int:
    """K blocks of one weight stage: DEPTH when both GEMMs' K block counts
    (hidden/128, inter/128) divide by it, else 1 (a job or pair of an odd
    number of K blocks cannot be cut into DEPTH-block stages)."""
    return DEPTH if (hidden // TILE) % DEPTH == 0 and (inter // TILE) % DEPTH == 0 else 1


def stage_bounds(depth: int) -> tuple[int, int]:
    """(most, fewest) ring stages of ``depth`` boxes tried: the same bytes in
    flight as MAX_STAGES / MIN_STAGES stages of DEPTH boxes."""
    return MAX_STAGES * DEPTH // depth, MIN_STAGES * DEPTH // depth


def unit_capacity(
    experts: int, top_k: int, tokens: int = MAX_TOKENS, group: int = min(GROUPS)
) -> int:
    """Most units a call of ``tokens`` tokens can have (any routing), with
    units of ``group`` tokens (default: the narrowest of ``GROUPS``, the most
    units any plan has).

    The shared expert has ceil(tokens / group) units. Routed units: an
    expert's first route opens a unit (one unit per route while experts
    last), every further unit costs ``group`` more routes of one expert, and
    an expert holds at most ``tokens`` routes (each token picks distinct
    experts), so at most ceil(tokens / group) units."""
    routes = tokens * top_k
    first = min(routes, experts)
    more = min((routes - first) // group, experts * (ceil_div(tokens, group) - 1))
    return ceil_div(tokens, group) + first + more


#: FC2 jobs per claim, per architecture: (up to 16 tokens, above 16). The
#: producer claims as soon as its FC1 stages are posted and keeps one claim in
#: flight, so a CTA whose FC1 range ends early takes up to two claims of FC2
#: before a late one takes any: smaller claims balance FC2's end. sm_90a (H200,
#: GLM-5, same seed): 2 jobs a claim above 16 tokens instead of 8, skewed
#: routing M = 32 / 48 / 64 57.1 / 74.0 / 71.8 -> 49.5 / 67.2 / 65.2 us, random
#: unchanged (docs/notes/grouped-sm90.md). sm_100a (B200, an earlier kernel on
#: the same plan): 8 tokens 59 vs 65 us at 2 vs 8; 64 tokens 174 vs 181 us at
#: 8 vs 2 (docs/notes/grouped-sm100.md). Any other arch: sm_100a's.
CLAIM_JOBS = {"sm_90a": (2, 2), "sm_100a": (2, 8)}


def chunk_jobs(tokens: int, arch: str = "") -> int:
    """FC2 jobs per claim of a ``tokens``-token variant for ``arch``
    (``CLAIM_JOBS``)."""
    small, large = CLAIM_JOBS.get(arch, CLAIM_JOBS["sm_100a"])
    return small if tokens <= 16 else large


# Counters ------------------------------------------------------------------


def call_parity(calls, grid: int):
    """The counter block a call uses, from the call counter a CTA reads at its
    start: CTAs of the call before have all counted (``griddepcontrol.wait``),
    CTAs of this one at most ``grid - 1`` times (the reader has not). The
    device runs this on the word it loads."""
    return calls // grid


def call_limit(grid: int) -> int:
    """The limit of every CTA's ``atom.inc`` on the call counter at the end
    of a call: the counter runs 0 .. 2 * grid - 1, then wraps to 0."""
    return 2 * grid - 1


def count_call(calls: int, grid: int) -> int:
    """The call counter after one CTA's ``atom.inc`` with limit ``call_limit``
    (PTX: ``old >= limit ? 0 : old + 1``)."""
    return 0 if calls >= call_limit(grid) else calls + 1


def zero_share(words: int, grid: int) -> int:
    """Words of the other parity's counter block each CTA zeroes at its start:
    CTA c the words c * share .. (c + 1) * share - 1 that lie in the block."""
    return ceil_div(words, grid)


@dataclass(frozen=True)
class Counters:
    """Word offsets (int32) in the ``counters`` workspace. Two blocks of
    ``words`` (one per call parity), then the call counter. Sized for
    MAX_TOKENS whatever the bucket, so one buffer serves every bucket of a
    model (the parity a call uses depends only on how many calls ran)."""

    words: int  # one parity block
    pairs: int  # pair arrival counters start here (unit * pairs + pair)
    unit_ready: int  # hidden blocks published per unit
    jobs: int  # next FC2 job of halves A and B (two words)
    finished: int  # CTAs through FC2 (finalize)
    calls: int  # call counter (2 * grid calls wrap), after both blocks

    @property
    def total(self) -> int:
        return 2 * self.words + 1


def hidden_rows(experts: int, top_k: int) -> int:
    """Rows of the ``hidden`` workspace (and of ``hscale``): unit u's token j
    is row u * group + j, so the most units times the width, over every width
    a model's buckets can have (``GROUPS``)."""
    return max(unit_capacity(experts, top_k, MAX_TOKENS, g) * g for g in GROUPS)


def counter_words(experts: int, top_k: int, pairs: int) -> int:
    """Counters of one call parity: ready tokens, pair arrivals, unit
    readiness, the next FC2 job of halves A and B, finished CTAs."""
    return 4 + unit_capacity(experts, top_k) * (pairs + 1)


def counters(experts: int, top_k: int, pairs: int) -> Counters:
    words = counter_words(experts, top_k, pairs)
    units = unit_capacity(experts, top_k)
    return Counters(
        words=words, pairs=1, unit_ready=1 + units * pairs, jobs=words - 3,
        finished=words - 1, calls=2 * words,
    )  # fmt: skip


# The plan of one variant -------------------------------------------------------


@dataclass(frozen=True)
class GroupedPlan:
    """Static quantities of one grouped variant. ``grid`` is the CTA count
    (the target's SM count, one CTA per SM)."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    tokens: int
    grid: int
    #: 1: the shared expert's units run first; 0: routed units only (the
    #: capacities below stay sized for one, an upper bound).
    shared_experts: int = 1
    #: The target architecture (``group`` and ``chunk`` depend on it); "" in a
    #: shape check.
    arch: str = ""

    def __post_init__(self):
        problems = plan_problems(self.hidden, self.inter, self.experts, self.top_k, self.tokens)
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_spec(cls, spec) -> GroupedPlan:
        return cls(spec.hidden, spec.inter, spec.experts, spec.top_k, spec.tokens, spec.sms,
                   spec.shared_experts, spec.arch)  # fmt: skip

    depth = property(lambda self: stage_depth(self.hidden, self.inter))  # K blocks a stage
    nk1 = property(lambda self: self.hidden // TILE)  # GEMM1 K blocks
    nk2 = property(lambda self: self.inter // TILE)  # GEMM2 K blocks
    pairs = property(lambda self: self.inter // TILE)  # (up, gate) row-tile pairs
    tiles2 = property(lambda self: self.hidden // TILE)  # GEMM2 row tiles (FC2 jobs/unit)
    span = property(lambda self: 2 * self.nk1 // self.depth)  # FC1 stages of a pair
    unit1 = property(lambda self: self.pairs * self.span)  # FC1 stages of a unit
    job = property(lambda self: self.nk2 // self.depth)  # FC2 stages of a job
    routes = property(lambda self: self.tokens * self.top_k)
    mask_words = property(lambda self: mask_words(self.tokens))  # route-mask words an expert
    group = property(lambda self: unit_group(self.tokens, self.arch))  # tokens of a unit
    shared_units = property(lambda self: ceil_div(self.tokens, self.group) * self.shared_experts)
    max_units = property(
        lambda self: unit_capacity(self.experts, self.top_k, self.tokens, self.group)
    )
    chunk = property(lambda self: chunk_jobs(self.tokens, self.arch))
    #: Every CTA routes every token itself (``LOCAL_ROUTING_TOKENS``; CTA c
    #: quantizes token c, so only where the grid has a CTA for every token).
    local_routing = property(lambda self: self.tokens <= min(LOCAL_ROUTING_TOKENS, self.grid))
    counters = property(lambda self: counters(self.experts, self.top_k, self.pairs))


def plan_problems(hidden: int, inter: int, experts: int, top_k: int, tokens: int) -> list[str]:
    """Why the grouped plan cannot serve this shape (empty: it can)."""
    reasons = []
    if hidden % TILE or inter % TILE or hidden < TILE or inter < TILE:
        reasons.append(f"hidden {hidden} and inter {inter} must be positive multiples of {TILE}")
    if hidden // TILE > 1 << KB_BITS or hidden // TILE > 1 << TILE_BITS:
        reasons.append(f"hidden {hidden}: at most {1 << KB_BITS} blocks of 128 (stage words "
                       f"hold K block and row tile indices in {KB_BITS} bits)")  # fmt: skip
    if 2 * inter // TILE >= 1 << TILE_BITS:
        reasons.append(f"inter {inter}: at most {(1 << TILE_BITS) // 2 - 1} blocks of 128")
    reasons += routing.experts_problems(experts, top_k)
    if not 1 <= tokens <= MAX_TOKENS:
        reasons.append(f"tokens {tokens} outside 1..{MAX_TOKENS}")
    # The shared expert's unit table is written by the routing warp, one unit
    # a lane (``grouped_common.number_units``): at the narrowest unit width.
    if ceil_div(tokens, min(GROUPS)) > routing.LANES:
        reasons.append(f"tokens {tokens}: the shared expert's units ({min(GROUPS)} tokens each) "
                       f"are one a lane of a warp, at most {routing.LANES}")  # fmt: skip
    # The stage words hold this bucket's units (the counter blocks, sized for
    # MAX_TOKENS, are memory only): the most units of any width at ``tokens``.
    units = unit_capacity(experts, top_k, tokens) if not reasons else 0
    if units >= 1 << UNIT_BITS:
        reasons.append(f"{units} units at {tokens} tokens exceed the {UNIT_BITS}-bit field of "
                       f"the stage words (fewer tokens a bucket, fewer experts or a smaller "
                       f"top_k)")  # fmt: skip
    return reasons


# Workspaces ----------------------------------------------------------------------


def workspaces(
    hidden: int, inter: int, experts: int, top_k: int, grid: int, stamps: bool = False
) -> tuple[Workspace, ...]:
    """Scratch every call of a model shares (calls run one after another on a
    stream), sized for MAX_TOKENS so that every bucket can use the same
    buffers: quantized tokens, their scales, hidden blocks and scales of every
    unit, FC1 partials (one per CTA and half; a diagnostics build's stamps
    after them) and the parity counters."""
    stamp_bytes = grid * len(STAMP_POINTS) * 4 if stamps else 0
    nk1, nk2 = hidden // TILE, inter // TILE
    return (
        Workspace("plan_x", MAX_TOKENS * hidden),
        Workspace("plan_s", MAX_TOKENS * nk1 * 4),
        Workspace("hidden", hidden_rows(experts, top_k) * inter),
        Workspace("hscale", hidden_rows(experts, top_k) * nk2 * 4),
        Workspace("partial", partial_bytes(grid) + stamp_bytes),
        Workspace("counters", counters(experts, top_k, nk2).total * 4, zero=True),
    )


# Shared memory ------------------------------------------------------------------


@dataclass(frozen=True)
class SmemLayout:
    """Byte offsets in one CTA's dynamic shared memory (base 1024-aligned).

    ``slots``: accumulator slots between MMA issue and epilogue (TMEM on
    sm_100a; 0 on sm_90a, where the MMA warpgroup is the epilogue). ``group``:
    the plan's tokens of a unit (B-tile rows). Rings: ``ring`` stages of
    column scales (``depth`` * ``group`` floats each), ``posts``
    stage words; barriers: full[stages], empty[stages], acc_full[slots],
    acc_empty[slots], posted[posts]. ``placed``: the regions as the shared
    builder (``kernels.smem.Regions``) placed them."""

    stages: int
    slots: int
    gatherers: int
    depth: int  # K blocks (boxes) of one stage: the plan's
    group: int  # tokens of a unit: the plan's
    ring: int
    posts: int
    bars: int
    a_bytes: int  # weights of one stage
    b_bytes: int  # token (B) tile of one stage
    off_w: int
    off_b: int
    off_ring: int
    off_hs: int
    off_amax: int
    off_picks: int
    off_mask: int
    off_eoff: int
    off_uexp: int
    off_uoff: int
    off_ucnt: int
    off_flat: int
    off_scal: int
    off_desc: int
    off_bar: int
    off_tmem: int
    total: int
    placed: Regions = field(default_factory=Regions, compare=False, repr=False)

    def regions(self) -> list[tuple[str, int, int]]:
        """(name, offset, bytes up to the next region or the total) of every
        region, in address order."""
        names = [n[4:] for n in self.__dataclass_fields__ if n.startswith("off_")]
        starts = [getattr(self, "off_" + n) for n in names]
        ends = starts[1:] + [self.total]
        return [(n, s, e - s) for n, s, e in zip(names, starts, ends, strict=True)]

    def table(self) -> dict[str, list[int]]:
        """name -> [offset, bytes] of every region (the compile notes'
        ``smem_layout``, as for the mega kernels)."""
        return self.placed.table()


#: Scalars in the ``scal`` region (int32 indices).
S_PARITY, S_UNITS, S_SPLIT, S_S1A, S_S1B, S_LO1A, S_LO1B = 0, 1, 2, 3, 4, 5, 6
S_J2A, S_J2B, S_N1A, S_N1B = 7, 8, 9, 10
SCALARS = 16


def smem_layout(plan: GroupedPlan, stages: int, gatherers: int, slots: int = 0) -> SmemLayout:
    """The shared-memory layout at ``stages`` weight stages."""
    w, depth = plan.group, plan.depth
    a_bytes = depth * STAGE_BYTES
    b_bytes = depth * w * TILE
    # The scale ring and stage words are read up to ``stages + slots`` stages
    # after they are written (sm_100a's epilogue reads a stage's scales up to
    # ``slots`` stages after its weights were freed); two more as margin.
    ring = slots + stages + 2
    posts = slots + stages + 2
    bars = 2 * stages + 2 * slots + posts
    r = Regions()
    r.take("w", stages * a_bytes, 1024)
    r.take("b", stages * b_bytes, 1024)
    r.take("ring", ring * depth * w * 4)
    r.take("hs", gatherers * w * plan.nk2 * 4)
    r.take("amax", 4 * w * 4)
    r.take("picks", plan.routes * 4)
    r.take("mask", plan.experts * plan.mask_words * 4)
    r.take("eoff", plan.experts * 4)
    r.take("uexp", plan.max_units * 4)
    r.take("uoff", plan.max_units * 4 + 4)
    r.take("ucnt", plan.max_units * 4)
    r.take("flat", (plan.routes + plan.tokens) * 4)
    r.take("scal", SCALARS * 4)
    r.take("desc", posts * 4)
    r.take("bar", bars * 8, 8)
    r.take("tmem", 16)
    return SmemLayout(
        stages=stages, slots=slots, gatherers=gatherers, depth=depth, group=w, ring=ring,
        posts=posts,
        bars=bars,
        a_bytes=a_bytes, b_bytes=b_bytes, total=ceil_div(r.end, 1024) * 1024, placed=r,
        **{"off_" + k: v for k, v in r.offsets.items()},
    )  # fmt: skip


#: Gatherer warps of each architecture's kernel (sm_90a: warps 1-3; sm_100a:
#: warps 2, 3), the layout's ``gatherers``.
GATHERERS = {"sm_90a": 3, "sm_100a": 2}
#: sm_100a: the TMEM columns one CTA allocates (all of the SM's: one CTA per SM).
TMEM_COLUMNS = 512


def tmem_stage_columns(plan: GroupedPlan) -> int:
    """sm_100a: TMEM columns of one stage's accumulators (``group`` per K block)."""
    return plan.depth * plan.group


def accumulator_slots(plan: GroupedPlan, arch: str) -> int:
    """Accumulator slots between MMA issue and epilogue: none on sm_90a (its
    MMA warpgroup is the epilogue); on sm_100a as many stages' accumulators
    as TMEM_COLUMNS hold, at most 32 (16 at two K blocks a stage)."""
    if arch == "sm_90a":
        return 0
    return min(32, TMEM_COLUMNS // tmem_stage_columns(plan))


def arch_layout(plan: GroupedPlan, arch: str) -> SmemLayout:
    """The layout ``arch``'s kernel runs (``fit_layout`` with its gatherers
    and accumulator slots); ValueError where none fits."""
    return fit_layout(plan, arch, GATHERERS[arch], accumulator_slots(plan, arch))


def fit_layout(plan: GroupedPlan, arch: str, gatherers: int, slots: int = 0) -> SmemLayout:
    """The deepest layout (``stage_bounds(plan.depth)``: most down to fewest
    stages) that fits ``arch``'s shared-memory limit (``SMEM_LIMIT``, from
    ``runtime.constants``)."""
    limit = SMEM_LIMIT[arch]
    most, fewest = stage_bounds(plan.depth)
    for stages in range(most, fewest - 1, -1):
        layout = smem_layout(plan, stages, gatherers, slots)
        if layout.total <= limit:
            return layout
    need = smem_layout(plan, fewest, gatherers, slots).total
    raise ValueError(f"{fewest} stages need {need} B of shared memory; {arch} allows {limit}")


def ring_index(layout: SmemLayout, n, d: int, token):
    """Float index in the scale ring of the column scale of K block ``d``,
    token ``token`` of stage ``n`` (the gatherers write it, the MMA consumer
    or epilogue reads it)."""
    return (n % layout.ring) * (layout.depth * layout.group) + d * layout.group + token


def b_chunk(layout: SmemLayout, d: int, row, chunk):
    """Byte offset, within a stage's B tile, of 16-byte chunk ``chunk`` of
    token row ``row`` of K block ``d`` (``depth`` tiles of ``group`` rows x
    128 K bytes; 128-byte swizzle: chunk c of row r is stored at c ^ (r % 8))."""
    return (d * layout.group + row) * TILE + (chunk ^ (row % 8)) * 16


# -- formulas the kernels run (Python or DSL integers) --------------------------------------


def pick(cond, a, b):
    """``a`` if ``cond`` else ``b``: the select the formulas take on the host
    (the device passes the DSL's, ``grouped_common.select``)."""
    return a if cond else b


def choose(cond, then, other):
    """``then()`` if ``cond`` else ``other()``: the branch the formulas take on
    the host, for values only one side may compute or load (the device passes
    a DSL branch, ``grouped_common.branch``; both sides return the same types)."""
    return then() if cond else other()


def _word(value) -> int:
    """A field or flag as a Python int: the formulas' word conversion on the
    host (the device passes ``Uint32``)."""
    return int(value)


# Unit numbering -----------------------------------------------------------------------------


def units_of(routes, group: int):
    """Units of an expert with ``routes`` routes (one per started ``group``)."""
    return (routes + group - 1) // group


def unit_size(count, first, group: int, minimum=min):
    """Tokens of the unit that starts at the ``first``-th of ``count`` routes
    (or tokens, for the shared expert), in units of ``group`` tokens."""
    return minimum(count - first, group)


def mask_words(tokens: int) -> int:
    """Route-mask words (uint32) of each expert in a call of ``tokens``
    tokens: one bit per token."""
    return ceil_div(tokens, 32)


def mask_slot(expert, token, words: int):
    """(word, bit) of ``token`` in the route masks, ``words`` words an
    expert (``mask_words``): expert e's tokens 32 w .. 32 w + 31 are word
    ``words * e + w`` of ``mask``."""
    return words * expert + token // 32, token % 32


def rank_in_mask(token, word_at, words: int, popc=int.bit_count, select=pick, word=_word):
    """How many of an expert's tokens come before ``token``, from its
    ``words`` mask words (``word_at(w)``: tokens 32 w .. 32 w + 31): every
    token of the words below token's, and those of its own word below its
    bit; the route's row in the expert's part of ``flat``."""
    rank = 0
    for w in range(words):
        m = word_at(w)
        bit = token - 32 * w  # token's bit in word w, where 0 <= bit < 32
        below = popc(
            m & ((word(1) << word(select(bit > 0, select(bit < 32, bit, 31), 0))) - word(1))
        )
        rank = rank + select(bit >= 32, popc(m), select(bit >= 0, below, 0))
    return rank


# Stage ranges and ownership ------------------------------------------------------------


@dataclass(frozen=True)
class Ranges:
    """One CTA's FC1 stage ranges in halves A and B and the FC2 job counts."""

    units: int
    split: int  # units of half A
    s1a: int  # FC1 stages of half A (all CTAs)
    s1b: int
    lo1a: int  # this CTA's first stage in half A
    lo1b: int
    n1a: int  # this CTA's stage count in half A
    n1b: int
    j2a: int  # FC2 jobs of half A (claimed at run time)
    j2b: int


#: The ``scal`` index of every ``Ranges`` field, in the order the device stores them.
RANGE_SCALARS = {
    "units": S_UNITS, "split": S_SPLIT, "s1a": S_S1A, "s1b": S_S1B, "lo1a": S_LO1A,
    "lo1b": S_LO1B, "j2a": S_J2A, "j2b": S_J2B, "n1a": S_N1A, "n1b": S_N1B,
}  # fmt: skip


def ranges(plan: GroupedPlan, units, cta, select=pick) -> Ranges:
    """CTA ``cta``'s ranges in a call of ``units`` units: above SPLIT_UNITS
    units half A holds the first ceil(units / 2); each half's stages are cut
    into ``grid`` contiguous ranges, CTA c's from c * size // grid."""
    split = select(units > SPLIT_UNITS, (units + 1) // 2, units)
    s1a = split * plan.unit1
    s1b = (units - split) * plan.unit1
    g = plan.grid
    lo1a, lo1b = cta * s1a // g, cta * s1b // g
    return Ranges(
        units=units, split=split, s1a=s1a, s1b=s1b, lo1a=lo1a, lo1b=lo1b,
        n1a=(cta + 1) * s1a // g - lo1a, n1b=(cta + 1) * s1b // g - lo1b,
        j2a=split * plan.tiles2, j2b=(units - split) * plan.tiles2,
    )  # fmt: skip


def owner(plan: GroupedPlan, s, size):
    """The CTA whose range of a ``size``-stage half holds stage ``s``."""
    return ((s + 1) * plan.grid - 1) // size


def locate(plan: GroupedPlan, r: Ranges, n, select=pick, branch=choose):
    """(half, unit, row tile, K block, stage index in its half) of a CTA's
    n-th FC1 stage: stage q of a unit holds K blocks depth * ((q % span) // 2)
    on of pair q // span, its up tile (even q) or gate tile (odd q). Half B's
    range is read only for a stage in half B."""
    in_b = n >= r.n1a
    s = r.lo1a + n
    unit = s // plan.unit1

    def half_b():
        s_b = r.lo1b + n - r.n1a
        return s_b, r.split + s_b // plan.unit1

    s, unit = branch(in_b, half_b, lambda: (s, unit))
    half = select(in_b, 1, 0)
    q = s % plan.unit1
    tile = q // plan.span + plan.pairs * (q % 2)
    kb = plan.depth * ((q % plan.span) // 2)
    return half, unit, tile, kb, s


def pack(fc2, half, unit, tile, kb, opens, closes, word=_word):
    """The stage word of these fields (``word``: the conversion of a field to
    the word's integer type)."""
    if word is _word:
        assert 0 <= unit < 1 << UNIT_BITS and 0 <= tile < 1 << TILE_BITS
        assert 0 <= kb < 1 << KB_BITS
    return (
        word(unit) | word(tile) << SHIFT_TILE | word(kb) << SHIFT_KB | word(fc2) << BIT_FC2
        | word(half) << BIT_HALF | word(opens) << BIT_OPENS | word(closes) << BIT_CLOSES
    )  # fmt: skip


def unpack(word, field=_word):
    """(FC2, half, unit, row tile, K block, opens, closes) of a stage word
    (``field``: the conversion of a field to the caller's integer type)."""
    return (
        ((word >> BIT_FC2) & 1) != 0, field((word >> BIT_HALF) & 1),
        field(word & ((1 << UNIT_BITS) - 1)),
        field((word >> SHIFT_TILE) & ((1 << TILE_BITS) - 1)),
        field((word >> SHIFT_KB) & ((1 << KB_BITS) - 1)),
        ((word >> BIT_OPENS) & 1) != 0, ((word >> BIT_CLOSES) & 1) != 0,
    )  # fmt: skip


def describe(plan: GroupedPlan, r: Ranges, n, select=pick, branch=choose, word=_word):
    """A CTA's n-th FC1 stage word. A piece of a pair opens at the pair's
    first stage or the start of the CTA's range in a half, and closes at the
    pair's last stage or the end of the range."""
    half, unit, tile, kb, s = locate(plan, r, n, select, branch)
    n1a = r.n1a
    opens = (n == 0) | (n == n1a) | (s % plan.span == 0)
    closes = (n == n1a - 1) | (n == n1a + r.n1b - 1) | (s % plan.span == plan.span - 1)
    return pack(False, half, unit, tile, kb, opens, closes, word)


def fc2_word(plan: GroupedPlan, unit, tile, k: int, word=_word):
    """The word of stage ``k`` (fixed at compile time) of FC2 job (unit,
    output row tile): K blocks depth * k on; the first opens, the last closes."""
    return pack(True, 0, unit, tile, plan.depth * k, k == 0, k == plan.job - 1, word)


def fc2_words(plan: GroupedPlan, unit: int, tile: int) -> list[int]:
    """The stage words of FC2 job (unit, output row tile)."""
    return [fc2_word(plan, unit, tile, k) for k in range(plan.job)]


def job_of(plan: GroupedPlan, first, job):
    """(unit, output row tile) of FC2 job ``job`` of the half whose first unit
    is ``first`` (0 for half A, ``split`` for half B)."""
    return first + job // plan.tiles2, job % plan.tiles2


def pair_of(plan: GroupedPlan, s, n, opened):
    """(first stage of the pair in its half, pair, whether the piece is the
    whole pair) of a CTA's piece of a pair that runs from its ``opened``-th
    to its n-th stage, the n-th at index ``s`` of its half."""
    start = s - (n - opened)
    base = s - s % plan.span
    whole = (start == base) & (s == base + plan.span - 1)
    return base, s % plan.unit1 // plan.span, whole


def pair_owners(plan: GroupedPlan, base, size):
    """(first, last) CTA holding a stage of the pair whose first stage is
    ``base`` in a ``size``-stage half; the first owns (finishes) the pair and
    waits for ``pair_partials`` partials, one from each CTA after it up to
    the last that ``holds_stages``."""
    return owner(plan, base, size), owner(plan, base + plan.span - 1, size)


def holds_stages(plan: GroupedPlan, cta, size):
    """Whether CTA ``cta``'s range of a ``size``-stage half is not empty (its
    stage count in ``ranges``). Every CTA's is when size >= grid; below,
    each range holds at most one stage and grid - size hold none (a call
    of few units whose FC1 stages, ``unit1`` a unit, number fewer than the
    grid's CTAs)."""
    return (cta + 1) * size // plan.grid > cta * size // plan.grid


def pair_partials(plan: GroupedPlan, first, last, size, select=pick):
    """Partials the owner ``first`` of a pair (``pair_owners``) waits for:
    one from each CTA in first + 1 .. last that ``holds_stages``. That is
    every one of them when size >= grid, else (one stage a range at most)
    one a stage of the pair after the first: span - 1."""
    return select(size >= plan.grid, last - first, plan.span - 1)


def partial_slot(plan: GroupedPlan, half, cta):
    """Slot of the ``partial`` workspace where CTA ``cta`` publishes its FC1
    partial of ``half`` (at most one per CTA and half)."""
    return half * plan.grid + cta


def pair_counter(plan: GroupedPlan, unit, pair):
    """Word (in a parity block of ``counters``) counting the partials
    published for pair ``pair`` of ``unit``."""
    return plan.counters.pairs + unit * plan.pairs + pair


# Weights ---------------------------------------------------------------------------------------


def weight_box(plan: GroupedPlan, fc2, expert, tile, kb, select=pick):
    """(tensor map, row tile, K-block coordinate) of a stage's weights, for
    the unit's expert ``expert`` (-1: the shared expert): maps w13, w2, s13,
    s2 are 0..3, viewed as (128 bytes, rows, experts * K blocks); the
    stage's ``depth`` boxes are at coordinates chunk .. chunk + depth - 1."""
    shared = expert < 0
    safe = select(shared, 0, expert)
    index = select(shared, 2, 0)
    index = select(fc2, index + 1, index)
    chunk = select(fc2, safe * plan.nk2 + kb, safe * plan.nk1 + kb)
    return index, tile, chunk


def scale_index(plan: GroupedPlan, fc2: bool, expert, tile, kb):
    """Element index of the block scale of K block ``kb`` of row tile
    ``tile`` of ``expert`` (>= 0; the shared expert's tensors have one) in
    w13_scale [E, 2I/128, H/128] (FC1) or w2_scale [E, H/128, I/128] (FC2);
    ``fc2`` is fixed at compile time."""
    if fc2:
        return (expert * plan.tiles2 + tile) * plan.nk2 + kb
    return (expert * (2 * plan.pairs) + tile) * plan.nk1 + kb


# Host checks built on the formulas ---------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """A CTA's contiguous piece of one pair (a close_pair event)."""

    half: int
    unit: int
    pair: int
    first: int  # stage index in its half
    last: int
    role: str  # "whole" | "publish" | "own"
    pieces_before: int  # for "own": partials it waits for (``pair_partials``)


def close_pair(plan: GroupedPlan, r: Ranges, cta: int, n_open: int, n: int) -> Piece:
    """What a CTA does at the close of its piece (stages n_open..n) of a pair."""
    half, unit, _, _, s = locate(plan, r, n)
    base, pair, whole = pair_of(plan, s, n, n_open)
    start = s - (n - n_open)
    if whole:
        return Piece(half, unit, pair, start, s, "whole", 0)
    size = r.s1a if half == 0 else r.s1b
    first, last = pair_owners(plan, base, size)
    if cta != first:
        return Piece(half, unit, pair, start, s, "publish", 0)
    return Piece(half, unit, pair, start, s, "own", pair_partials(plan, first, last, size))


def pieces(plan: GroupedPlan, units: int, cta: int) -> list[Piece]:
    """Every pair piece of a CTA's FC1 ranges, in stage order."""
    r = ranges(plan, units, cta)
    out, opened = [], 0
    for n in range(r.n1a + r.n1b):
        fc2, *_, opens, closes = unpack(describe(plan, r, n))
        assert not fc2
        if opens:
            opened = n
        if closes:
            out.append(close_pair(plan, r, cta, opened, n))
    return out


@dataclass(frozen=True)
class Units:
    """Unit tables of one call: expert (-1: shared), first row in ``flat``
    and token count of every unit; ``flat`` lists the shared expert's tokens
    (0..M-1), then each routed expert's routes (token * top_k + k) in token
    order, expert ``e``'s from row ``eoff[e]``."""

    uexp: list[int]
    uoff: list[int]  # len(units) + 1: the last is the end of ``flat``
    ucnt: list[int]
    flat: list[int]
    eoff: list[int]

    def __len__(self) -> int:
        return len(self.uexp)

    def tokens(self, unit: int, top_k: int) -> list[int]:
        """The unit's tokens in column order."""
        rows = self.flat[self.uoff[unit] : self.uoff[unit] + self.ucnt[unit]]
        return rows if self.uexp[unit] < 0 else [r // top_k for r in rows]


def number_units(plan: GroupedPlan, ids: list[list[int]]) -> Units:
    """Unit tables for ``ids`` [tokens][top_k] (the routing's experts), built
    the way the device builds them: route masks (``mask_slot``), units per
    expert (``units_of``, ``unit_size``) and each route's rank among its
    expert's (``rank_in_mask``)."""
    tokens, k, experts = plan.tokens, plan.top_k, plan.experts
    assert len(ids) == tokens and all(len(row) == k for row in ids)
    words = plan.mask_words
    mask = [0] * (words * experts)
    for r in range(plan.routes):
        word, bit = mask_slot(ids[r // k][r % k], r // k, words)
        mask[word] |= 1 << bit
    counts = [sum(mask[words * e + w].bit_count() for w in range(words)) for e in range(experts)]
    g = plan.group
    units = plan.shared_units + sum(units_of(n, g) for n in counts)
    uexp, uoff, ucnt = [0] * units, [0] * (units + 1), [0] * units
    for i in range(plan.shared_units):
        uexp[i], uoff[i], ucnt[i] = -1, i * g, unit_size(tokens, i * g, g)
    flat, eoff = list(range(tokens)) + [-1] * plan.routes, []
    unit, start = plan.shared_units, tokens
    for e in range(experts):
        eoff.append(start)
        for i in range(0, counts[e], g):
            uexp[unit], uoff[unit], ucnt[unit] = e, start + i, unit_size(counts[e], i, g)
            unit += 1
        start += counts[e]
    uoff[units] = start
    for r in range(plan.routes):
        e = ids[r // k][r % k]
        rank = rank_in_mask(r // k, lambda w, e=e: mask[words * e + w], words)
        flat[eoff[e] + rank] = r
    return Units(uexp, uoff, ucnt, flat, eoff)
