"""Architecture-independent device code of the grouped kernel (sm_90a and
sm_100a): the call's start (routing, activation quantization, parity
counters), unit numbering and route ranking, stage ranges and ownership,
stage words, the weight producer, the B-tile gatherers, the FC1 pair close
(partials, clamped SwiGLU, FP8 hidden), the FC2 output rows and the
finalize; and the compile step both kernels share (fake arguments from the
ABI table, ``build_common.compile_entry``, one notes schema).

The formulas (stage ranges, owners, stage words, weight boxes, unit
numbering, ring and B-tile offsets, counter words) are ``grouped_plan``'s
own, called here with the DSL's select, branch, min and popcount
(``select``, ``branch``, ``cutlass.min``, ``cute.arch.popc``) and integer
types: one statement, tested on the CPU. What differs per architecture is
only the MMA and where its accumulators live (``grouped_moe_sm90``,
``grouped_moe_sm100``: their warp roles and the empty / accumulator rings);
an architecture's epilogue describes its accumulator fragment with a
``Fragment`` (which tokens and logical rows each thread holds) and calls
``close_pair`` / ``store_rows``.

Shared memory (``grouped_plan.SmemLayout``, from the 1024-aligned dynamic
base, in address order): ``w`` the weight stages (stages x depth 128 x 128
FP8 boxes, 128-byte swizzle), ``b`` the B tiles (stages x depth x group
token rows of 128 K bytes, ``b_chunk``; ``group`` = the plan's tokens of a
unit), ``ring`` the column scales (``ring_index``: ring stages x depth x
group FP32), ``hs`` each gatherer's hidden scales [group, I/128], ``amax``
four warps' per-token amax, then the
unit tables ``picks`` (ids), ``mask`` (``mask_words`` per expert, ``mask_slot``),
``eoff``, ``uexp``, ``uoff``, ``ucnt``, ``flat``, the scalars ``scal`` (call
parity and ``grouped_plan.RANGE_SCALARS``), ``desc`` (posts stage words),
``bar`` (full[stages], empty[stages], acc_full[slots], acc_empty[slots],
posted[posts]) and ``tmem`` (sm_100a's TMEM address).

Rings (stage n: slot n % stages, phase (n // stages) % 2; its word at
desc[n % posts], posted[n % posts]): the producer waits empty for n >=
stages, writes the word, arrives on posted (1 arrival), then arrives on full
with the weights' transaction bytes and issues the TMA (END: a plain
arrival). The gatherer of stage n (n % gatherers) waits empty and posted,
issues its B-tile cp.async and column scales, then each of its lanes
arrives on full twice: its cp.async completion and itself
(``FULL_ARRIVALS`` = 1 + 32 + 32). The consumers wait full; what frees
empty is architecture-dependent. The scale ring and stage words are read up
to stages + slots stages after they are written, so both are stages + slots
+ 2 deep.

Phases of a call, and what each waits on:

1. sm_90a: thread 0 issues ``griddepcontrol.launch_dependents`` first, so
   the next grid (the next call, under PDL) may be launched once every CTA
   of this one has started, not only once all have exited; before its own
   ``griddepcontrol.wait`` a grid only prefetches static inputs and writes
   its own shared memory (and a diagnostics build its entry stamp), and
   that wait returns only once the previous grid has completed with its
   writes visible, so no call sees another's workspaces early. (sm_100a
   does not issue it: not measured on a B200.) Barrier init
   and L2 prefetches of static inputs; ``__syncthreads``;
   ``griddepcontrol.wait`` (the previous call's grid has finished).
2. ``start_call``: CTA t < M routes token t (warp 0) and quantizes it (the
   epilogue group), and where the bucket exceeds the grid tokens t + grid,
   t + 2 grid, ... too (token t reads x and logits row min(t, valid - 1):
   the i32 ``valid`` is the rows the caller passed, so a call below its
   bucket needs no padded copy); thread 32 reads the call counter (parity =
   ``call_parity``); ``__syncthreads``; every CTA zeroes its ``zero_share``
   of the other parity's counters; thread 0 of CTA t < M counts its tokens
   on the ready word (release), and thread 0 of every CTA waits (acquire)
   until all M are counted; ``__syncthreads``. With ``plan.local_routing``
   (M <= ``grouped_plan.LOCAL_ROUTING_TOKENS``) every CTA routes every token
   into its own ``picks`` (warp w token w; CTA t also stores token t's ids
   and weights), and CTA t < M first quantizes token t on the epilogue warps,
   which count it on the ready word (release) as soon as they are done; no
   thread waits here: only the gatherers wait (acquire) until all M are
   counted (``await_tokens``, before their first B tile); the producer's
   weight loads start once this CTA's tables are done.
3. ``number_units``: route masks (``red.or`` in shared memory),
   ``__syncthreads``; warp 0 counts and scans the experts, writes the unit
   tables and (lane 31) this CTA's ranges, then arrives on named barrier
   BAR_TABLES and goes on as the producer; warps 1-7 wait BAR_TABLES, rank
   the routes into ``flat`` and meet at BAR_RANKED (224 threads) before
   gathering or consuming.
4. The stages: FC1 ranges (A then B), then FC2 jobs claimed ``chunk`` at a
   time with ``atom.add`` on each half's job counter, then one END per
   gatherer. A gatherer's first FC2 stage of a unit waits (acquire) until
   the unit's readiness counter reaches ``pairs``. An FC1 pair piece that is
   not the whole pair is published (FP32 partial at ``partial_slot``,
   release on the ``pair_counter``) or, by its owner (``pair_owners``), waited
   for (acquire, ``pair_partials`` publications: one from each later CTA of
   the pair that holds a stage of the half) and summed; a finished pair
   publishes its hidden block and scales and releases the unit's readiness
   counter.
5. ``end_call``, after a ``__syncthreads`` (every role is through its
   stages): with the finalize, every CTA releases the finished counter and
   waits (acquire) for all ``grid``, then sums its share of the ``valid``
   tokens into ``final`` (rows past them are never written); thread 0
   counts the call (``atom.inc``, ``call_limit``).

Every cross-CTA wait polls with a ``%globaltimer`` bound and traps after
``WAIT_TIMEOUT_NS`` (the runtime launches cooperatively: all CTAs resident).

Conventions: global addresses are ``Int64`` bytes (``tensor.iterator.toint()``),
shared addresses ``Int32``; ``e`` is a thread's index in the 128-thread
epilogue group. Every kernel runs ``THREADS`` = 256 threads: warp 0 is the
weight producer, then the gatherer warps, and the epilogue's four warps last.
Measurements: docs/notes/grouped-sm90.md, docs/notes/grouped-sm100.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from kernels import grouped_plan as gp
from kernels import moe_common as mc
from kernels import ptx, routing
from kernels.abi import (
    GROUPED_MAPS,
    GROUPED_PARAMS,
    GROUPED_ROUTED_MAPS,
    GROUPED_ROUTED_PARAMS,
    fake_arguments,
    param_kind,
)
from kernels.build_common import compile_entry, launch_named
from kernels.grouped_plan import (
    END,
    S_J2A,
    S_J2B,
    S_N1A,
    S_N1B,
    S_PARITY,
    S_S1A,
    S_S1B,
    S_SPLIT,
    SCALARS,
    STAGE_BYTES,
    WAIT_TIMEOUT_NS,
    GroupedPlan,
    SmemLayout,
)
from kernels.spec import CompiledKernel, LaunchShape, Param, Workspace
from runtime.constants import SMEM_LIMIT, TILE

#: Both kernels' parameters and tensor maps (``weight_box``'s map indices
#: 0..3): kernels/abi.py; a model without a shared expert drops the shared
#: expert's (``ROUTED_PARAMS``, ``ROUTED_MAPS``: maps 0 and 1 only).
PARAMS, TENSOR_MAPS = GROUPED_PARAMS, GROUPED_MAPS
ROUTED_PARAMS, ROUTED_MAPS = GROUPED_ROUTED_PARAMS, GROUPED_ROUTED_MAPS
THREADS = 256
EPILOGUE_THREADS = 128
#: A stage's full barrier: the producer's expect_tx, then per gatherer lane its
#: cp.async completion and its own arrival after its scale-ring stores and its
#: reads of the stage word. Every lane arrives (not lane 0 after __syncwarp),
#: so each lane's shared-memory accesses are ordered by an mbarrier of its own
#: (docs/notes/grouped-sm90.md).
FULL_ARRIVALS = 1 + 32 + 32
# Named barriers (0 is __syncthreads): 1 the epilogue group, 2 unit tables
# ready, 3 routes ranked.
BAR_EPILOGUE, BAR_TABLES, BAR_RANKED = 1, 2, 3


def select(cond, a, b):
    """``a`` where ``cond`` holds, else ``b``: the select the plan's formulas
    take on the device (``grouped_plan.pick`` on the host). A Python ``cond``
    picks at trace time; the result has the type of the first DSL operand
    (``Int32`` when both are Python ints)."""
    if isinstance(cond, (bool, int)):
        return a if cond else b
    kind = next((type(v) for v in (a, b) if isinstance(v, cutlass.Numeric)), Int32)
    return kind(cutlass.select_(cond, kind(a), kind(b)))


@cute.jit
def branch(cond, then, other):
    """``then()`` where ``cond`` holds, else ``other()``, as a branch (each
    side's loads stay on its side): the branch the plan's formulas take on
    the device (``grouped_plan.choose`` on the host)."""
    return then() if cond else other()


def unpack(word):
    """``grouped_plan.unpack`` of a ``Uint32`` stage word, fields as ``Int32``."""
    return gp.unpack(word, Int32)


@cute.jit
def wait_at_least(counter: Int64, target: Uint32):
    """Polls the global word ``counter`` (acquire, GPU scope) until it is at
    least ``target``. Other CTAs raise it; every CTA of the grid is resident
    at once (cooperative launch), so the wait ends. If it has not after
    ``WAIT_TIMEOUT_NS`` the thread traps, so the launch fails with an error
    instead of spinning forever."""
    start = ptx.globaltimer()
    while ptx.ld_acquire_gpu_u32(counter) < target:
        if ptx.globaltimer() - start > Int64(WAIT_TIMEOUT_NS):
            ptx.trap()


def view(addr: Int32, dtype, n: int, align: int = 4):
    """A shared-memory tensor of ``n`` ``dtype`` at shared address ``addr``."""
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.smem, assumed_align=align)
    return cute.make_tensor(ptr, cute.make_layout((n,)))


@dataclass(frozen=True)
class Tables:
    """Views of one CTA's shared memory (``SmemLayout``) from its 1024-aligned
    base address; barriers as addresses. (Frozen: the DSL then passes it
    through runtime control flow as a compile-time value.)"""

    base: object  # Int32 shared address
    layout: SmemLayout
    plan: GroupedPlan
    #: A diagnostics build: Int64 address of this CTA's stamps (``stamp``).
    stamps: object = None

    def _view(self, offset: int, dtype, n: int):
        return view(self.base + offset, dtype, n)

    picks = property(lambda t: t._view(t.layout.off_picks, Int32, t.plan.routes))
    mask = property(lambda t: t._view(t.layout.off_mask, Uint32,
                                      t.plan.mask_words * t.plan.experts))  # fmt: skip
    eoff = property(lambda t: t._view(t.layout.off_eoff, Int32, t.plan.experts))
    uexp = property(lambda t: t._view(t.layout.off_uexp, Int32, t.plan.max_units))
    uoff = property(lambda t: t._view(t.layout.off_uoff, Int32, t.plan.max_units + 1))
    ucnt = property(lambda t: t._view(t.layout.off_ucnt, Int32, t.plan.max_units))
    flat = property(lambda t: t._view(t.layout.off_flat, Int32, t.plan.routes + t.plan.tokens))
    scal = property(lambda t: t._view(t.layout.off_scal, Int32, SCALARS))
    desc = property(lambda t: t._view(t.layout.off_desc, Uint32, t.layout.posts))
    ring = property(
        lambda t: t._view(
            t.layout.off_ring, Float32, t.layout.ring * t.layout.depth * t.layout.group
        )
    )
    amax = property(lambda t: t._view(t.layout.off_amax, Float32, 4 * t.layout.group))
    weights = property(lambda t: t.base + t.layout.off_w)  # stage s at + s * a_bytes
    tokens = property(lambda t: t.base + t.layout.off_b)  # stage s at + s * b_bytes

    ranges = property(lambda t: ScalarRanges(t.scal))

    def hs(self, gatherer):
        """The hidden scales [group, nk2] of gatherer ``gatherer``'s FC2 unit."""
        size = self.layout.group * self.plan.nk2
        return view(self.base + self.layout.off_hs + gatherer * (size * 4), Float32, size)

    def _bar(self, index):
        return self.base + self.layout.off_bar + index * 8

    def full(self, slot):
        return self._bar(slot)

    def empty(self, slot):
        return self._bar(self.layout.stages + slot)

    def acc_full(self, slot):
        return self._bar(2 * self.layout.stages + slot)

    def acc_empty(self, slot):
        return self._bar(2 * self.layout.stages + self.layout.slots + slot)

    def posted(self, index):
        return self._bar(2 * self.layout.stages + 2 * self.layout.slots + index)


@dataclass(frozen=True)
class ScalarRanges:
    """This CTA's ``grouped_plan.Ranges`` as stored in ``scal``: each field is
    loaded where a formula reads it."""

    scal: object

    def __getattr__(self, name):
        if name not in gp.RANGE_SCALARS:
            raise AttributeError(name)
        return self.scal[gp.RANGE_SCALARS[name]]


class Fragment:
    """Which (token, logical row) each epilogue thread holds in its
    ``values``-long register tensors (``up`` / ``gate``): ``slots`` tokens,
    ``rows`` rows each; ``index(s, r)`` is the register of slot s, row r
    (trace-time ints); ``token(s)`` / ``row(s, r)`` (row within a 128-row tile)
    may be runtime values. ``paired``: rows 2i and 2i + 1 of a slot are
    logical neighbours (even first), stored as one 2-element word.
    ``shuffles``: xor lane offsets joining the lanes that hold the same tokens
    (a token's amax over the warp); ``warp``: the thread's warp in the group;
    ``amax_writer``: this lane writes its warp's amax; ``scale_writer``: this
    thread writes the tokens' hidden scales (one thread per token of the whole
    group). Subclasses are frozen dataclasses (compile-time values to the
    DSL's control flow)."""

    slots: int
    rows: int
    paired: bool
    shuffles: tuple

    @property
    def values(self) -> int:
        return self.slots * self.rows


@dataclass(frozen=True)
class RowFragment(Fragment):
    """One logical row per thread (thread e holds physical row e), every
    token of the unit (``slots`` = the plan's ``group``): the tcgen05
    ``32x32b`` TMEM load layout."""

    e: object  # Int32: thread in the epilogue group
    logical: object  # Int32: its logical row
    slots: int  # tokens of a unit
    rows = 1
    paired = False
    shuffles = (1, 2, 4, 8, 16)

    warp = property(lambda f: f.e // 32)
    amax_writer = property(lambda f: f.e % 32 == 0)
    scale_writer = property(lambda f: f.e == 0)

    def index(self, s, r):
        return s

    def token(self, s):
        return s

    def row(self, s, r):
        return self.logical


class GroupedCommon:
    """Device code shared by the grouped kernels, and their entry points
    (``__call__`` / ``routed_only``: the launches with and without the shared
    expert; ``kernel`` / ``kernel_routed``: the two ABIs' kernels). An
    architecture's kernel class derives from it and provides ``GATHERERS``,
    ``EPILOGUE_WARP`` (first warp of the epilogue group), ``ENTRY`` (the
    entry name's prefix), ``launch(kernel, stream)`` and ``body`` (the kernel
    on the ABI's tensors, the shared expert's as addresses)."""

    GATHERERS = 2
    EPILOGUE_WARP = 4
    ENTRY = "moe_grouped"

    def __init__(self, spec, layout: SmemLayout):
        self.spec = spec
        self.plan = plan = GroupedPlan.from_spec(spec)
        self.layout = layout
        self.hidden, self.inter, self.experts = plan.hidden, plan.inter, plan.experts
        self.top_k, self.tokens, self.grid = plan.top_k, plan.tokens, plan.grid
        self.limit, self.scale, self.ue8m0 = spec.limit, spec.scale, spec.ue8m0
        self.finalize = spec.finalize
        self.logits_bf16 = spec.logits_dtype == "bfloat16"
        self.routing = spec.routing
        self.shared_experts = plan.shared_experts
        #: The variant's parameters and tensor maps (with or without the shared expert's).
        self.params = PARAMS if self.shared_experts else ROUTED_PARAMS
        self.maps = TENSOR_MAPS if self.shared_experts else ROUTED_MAPS
        self.nk1, self.nk2, self.pairs, self.tiles2 = plan.nk1, plan.nk2, plan.pairs, plan.tiles2
        self.span, self.unit1, self.job = plan.span, plan.unit1, plan.job
        self.depth = plan.depth  # K blocks (weight boxes) of one stage
        self.routes, self.shared_units = plan.routes, plan.shared_units
        self.max_units, self.chunk = plan.max_units, plan.chunk
        self.group = plan.group  # tokens of a unit (B-tile rows, the MMA's N)
        self.counters = plan.counters
        self.stages, self.posts = layout.stages, layout.posts
        #: A diagnostics build (``grouped_plan.STAMPS_ENV``): ``stamp`` writes.
        self.stamps = gp.stamps_enabled()
        assert self.GATHERERS + 1 <= self.EPILOGUE_WARP
        assert THREADS == 32 * self.EPILOGUE_WARP + EPILOGUE_THREADS
        assert gp.LOCAL_ROUTING_TOKENS <= THREADS // 32  # warp w routes token w

    def launch_shape(self) -> LaunchShape:
        """One CTA per SM of ``THREADS`` threads, the layout's dynamic shared
        memory, PDL; no cluster."""
        return LaunchShape(
            grid=(self.grid, 1, 1), block=(THREADS, 1, 1), cluster=None,
            smem=self.layout.total, pdl=True,
        )  # fmt: skip

    def notes(self, **extra) -> dict:
        """The compile notes of a grouped variant, in the mega kernels' schema
        where the same thing is meant (``mega_common.notes``: ``stages``,
        ``stage_bytes`` = shared-memory bytes of one ring stage, so that
        stages x stage_bytes is the ring, ``ctas_per_sm``, ``threads``,
        ``smem_layout`` {name: [offset, bytes]}, ``smem_limit``); an
        architecture adds its own keys through ``extra``."""
        layout, plan = self.layout, self.plan
        return {
            "stages": layout.stages,
            "stage_bytes": layout.a_bytes + layout.b_bytes,
            "b_tile_bytes": layout.b_bytes,
            "ctas_per_sm": 1,
            "threads": THREADS,
            "gatherers": self.GATHERERS,
            "accumulator_slots": layout.slots,
            "max_units": plan.max_units,
            "fc2_jobs_per_claim": plan.chunk,
            "resident_ctas_required": plan.grid,
            "smem_layout": layout.table(),
            "smem_limit": SMEM_LIMIT[self.spec.arch],
            **({"stamps": list(gp.STAMP_POINTS)} if self.stamps else {}),
            **extra,
        }

    # -- diagnostics ----------------------------------------------------------------------

    def stamp_base(self, partial: Int64, cta: Int32):
        """Address of CTA ``cta``'s stamps (a diagnostics build), else None."""
        if not self.stamps:
            return None
        return partial + Int64(gp.stamp_offset(self.grid, cta, 0))

    def stamp(self, t: Tables, point: str, value=None):
        """A diagnostics build only: stores ``value`` (default: the low 32 bits
        of ``%globaltimer``) as stamp ``point`` of this CTA
        (``grouped_plan.STAMP_POINTS``); the caller picks the one thread."""
        if self.stamps:
            if value is None:
                value = ptx.globaltimer() & Int64(0xFFFFFFFF)
            ptx.st_global_u32(t.stamps + Int64(gp.STAMP_POINTS.index(point) * 4), Uint32(value))

    @cute.jit
    def stamp_thread0(self, t: Tables, tid: Int32, point: cutlass.Constexpr[int]):
        """A diagnostics build only: thread 0 stores stamp ``STAMP_POINTS[point]``
        (the call's entry, PDL wait, tokens ready and exit, on both archs)."""
        if cutlass.const_expr(self.stamps):
            if tid == 0:
                self.stamp(t, gp.STAMP_POINTS[point])

    @cute.jit
    def clear_stamps(self, t: Tables, cta: Int32):
        """A diagnostics build, one thread after the PDL wait (the previous
        call's grid is done with the stamps): zeroes every point this call
        may not write, so none reads an earlier call's time: the points from
        ``tokens_ready`` on (written after ``start_call``'s first
        ``__syncthreads``, some not by every CTA: a CTA without FC2 stages),
        and in a CTA that quantizes no token (``cta`` >= M) the start's own
        that it does not write (the stamps may hold a larger bucket's call on
        the same stream)."""
        start = gp.STAMP_POINTS.index("route_done")
        later = gp.STAMP_POINTS.index("tokens_ready")
        for i in cutlass.range_constexpr(start, len(gp.STAMP_POINTS)):
            if cutlass.const_expr(i >= later):
                ptx.st_global_u32(t.stamps + Int64(i * 4), Uint32(0))
            elif cta >= self.tokens:
                ptx.st_global_u32(t.stamps + Int64(i * 4), Uint32(0))

    # -- the call's start ---------------------------------------------------------------

    # -- entry points (both archs; ``launch`` and ``body`` are the arch's) ------------------

    @cute.jit
    def __call__(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
                 s13_scale: cute.Tensor, s2_scale: cute.Tensor, s13: cute.Tensor,
                 s2: cute.Tensor, x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor,
                 rows: cute.Tensor, out: cute.Tensor, shared_out: cute.Tensor,
                 final: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor,
                 plan_x: cute.Tensor, plan_s: cute.Tensor, hidden: cute.Tensor,
                 hscale: cute.Tensor, partial: cute.Tensor, counters: cute.Tensor,
                 valid: Int32, stream):  # fmt: skip
        """Launch with the shared expert (``grouped_common.PARAMS``)."""
        launch_named(self, self.kernel,
                     (maps, w13_scale, w2_scale, s13_scale, s2_scale, s13, s2, x, logits, bias,
                      rows, out, shared_out, final, ids, weights, plan_x, plan_s, hidden, hscale,
                      partial, counters, valid), stream)  # fmt: skip

    @cute.jit
    def routed_only(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
                    x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor, rows: cute.Tensor,
                    out: cute.Tensor, final: cute.Tensor, ids: cute.Tensor,
                    weights: cute.Tensor, plan_x: cute.Tensor, plan_s: cute.Tensor,
                    hidden: cute.Tensor, hscale: cute.Tensor, partial: cute.Tensor,
                    counters: cute.Tensor, valid: Int32, stream):  # fmt: skip
        """Launch without a shared expert (``grouped_common.ROUTED_PARAMS``)."""
        launch_named(self, self.kernel_routed,
                     (maps, w13_scale, w2_scale, x, logits, bias, rows, out, final, ids, weights,
                      plan_x, plan_s, hidden, hscale, partial, counters, valid), stream)  # fmt: skip

    @cute.kernel
    def kernel(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
               s13_scale: cute.Tensor, s2_scale: cute.Tensor, s13: cute.Tensor,
               s2: cute.Tensor, x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor,
               rows: cute.Tensor, out: cute.Tensor, shared_out: cute.Tensor,
               final: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor,
               plan_x: cute.Tensor, plan_s: cute.Tensor, hidden: cute.Tensor,
               hscale: cute.Tensor, partial: cute.Tensor, counters: cute.Tensor,
               valid: Int32):  # fmt: skip
        self.body(
            maps, w13_scale, w2_scale, s13_scale.iterator.toint(), s2_scale.iterator.toint(),
            s13.iterator.toint(), s2.iterator.toint(), x, logits, bias, rows, out,
            shared_out.iterator.toint(), final, ids, weights, plan_x, plan_s, hidden, hscale,
            partial, counters, valid,
        )  # fmt: skip

    @cute.kernel
    def kernel_routed(self, maps: cute.Tensor, w13_scale: cute.Tensor, w2_scale: cute.Tensor,
                      x: cute.Tensor, logits: cute.Tensor, bias: cute.Tensor,
                      rows: cute.Tensor, out: cute.Tensor, final: cute.Tensor,
                      ids: cute.Tensor, weights: cute.Tensor, plan_x: cute.Tensor,
                      plan_s: cute.Tensor, hidden: cute.Tensor, hscale: cute.Tensor,
                      partial: cute.Tensor, counters: cute.Tensor, valid: Int32):  # fmt: skip
        none = Int64(0)  # no shared expert: never read
        self.body(
            maps, w13_scale, w2_scale, none, none, none, none, x, logits, bias, rows, out, none,
            final, ids, weights, plan_x, plan_s, hidden, hscale, partial, counters, valid,
        )  # fmt: skip

    @cute.jit
    def init_barriers(self, t: Tables, empty_arrivals: cutlass.Constexpr[int]):
        """One thread: every barrier of the rings (``empty_arrivals`` per
        consumed stage, architecture-dependent)."""
        for s in cutlass.range_constexpr(self.stages):
            ptx.mbarrier_init(t.full(s), FULL_ARRIVALS)
            ptx.mbarrier_init(t.empty(s), empty_arrivals)
        for s in cutlass.range_constexpr(self.layout.slots):
            ptx.mbarrier_init(t.acc_full(s), 1)
            ptx.mbarrier_init(t.acc_empty(s), 4)
        for p in cutlass.range_constexpr(self.posts):
            ptx.mbarrier_init(t.posted(p), 1)
        ptx.fence_mbarrier_init()

    @cute.jit
    def prefetch_static(self, s13: Int64, s2: Int64, w13_scale: Int64, w2_scale: Int64,
                        cta: Int32, which: cutlass.Constexpr[int]):  # fmt: skip
        """Pulls this CTA's slice of static inputs into L2 before the PDL wait
        (weights never depend on the previous kernel): ``which`` 0 the shared
        expert's weights (every call reads them), 1 the routed experts' block
        scales (on the gatherers' critical path)."""
        sizes = (
            (self.hidden * 2 * self.inter, self.inter * self.hidden)  # s13, s2 bytes
            if which == 0
            else (
                self.experts * 2 * self.pairs * self.nk1 * 4,  # w13_scale bytes
                self.experts * self.tiles2 * self.nk2 * 4,  # w2_scale bytes
            )
        )
        for k in cutlass.range_constexpr(2):
            addr = (s13 if k == 0 else s2) if which == 0 else (w13_scale if k == 0 else w2_scale)
            size = sizes[k]
            piece = (size // self.grid + 255) // 256 * 256
            start = cta * piece
            if start < size:
                self._prefetch(addr + Int64(start), cutlass.min(piece, size - start))

    @cute.jit
    def _prefetch(self, addr: Int64, size: Int32):
        """L2 prefetch of ``size`` bytes (a multiple of 16) in 32 KiB pieces."""
        for off in cutlass.range(0, size, 32768, unroll=1):
            ptx.prefetch_l2_bulk(addr + Int64(off), cutlass.min(size - off, 32768))

    @cute.jit
    def route(self, logits: Int64, bias: Int64, ids: Int64, weights: Int64, token: Int32,
              lane: Int32, last: Int32):  # fmt: skip
        """One warp: top-k of ``token`` into ``ids`` / ``weights`` (row token;
        ``last`` as in ``route_of``)."""
        expert, weight = self.route_of(logits, bias, token, lane, last)
        if lane < self.top_k:
            self.store_route(ids, weights, token * self.top_k + lane, expert, weight)

    def store_route(self, ids: Int64, weights: Int64, route, expert, weight):
        """Route ``route``'s (token * top_k + k) expert and weight into the
        call's ``ids`` / ``weights`` rows."""
        ptx.st_global_u32(ids + Int64(route) * 4, Uint32(expert))
        ptx.st_global_f32(weights + Int64(route) * 4, weight)

    def route_of(self, logits: Int64, bias: Int64, token, lane: Int32, last: Int32):
        """One warp: ``moe_common.route_token`` of ``token`` (lane k < top_k:
        route k's expert and weight), from logits row ``min(token, last)``
        (``start_call``: a token past the call's rows repeats its last)."""
        esize = 2 if self.logits_bf16 else 4
        row = logits + Int64(cutlass.min(token, last)) * (self.experts * esize)
        return mc.route_token(
            row, bias, lane, self.experts, self.top_k, self.scale, self.logits_bf16, self.routing
        )

    @cute.jit
    def route_local(self, t: Tables, logits: Int64, bias: Int64, ids: Int64, weights: Int64,
                    token: Int32, lane: Int32, cta: Int32, last: Int32):  # fmt: skip
        """One warp of any CTA (``plan.local_routing``): top-k of ``token``
        into this CTA's ``picks``; CTA ``token`` also stores them in ``ids`` /
        ``weights`` (every CTA computes the same bits: the same code on the
        same inputs, no atomics)."""
        expert, weight = self.route_of(logits, bias, token, lane, last)
        picks = t.picks
        if lane < self.top_k:
            route = token * self.top_k + lane
            picks[route] = expert
            if cta == token:
                self.store_route(ids, weights, route, expert, weight)

    @cute.jit
    def quantize(self, x: Int64, plan_x: Int64, plan_s: Int64, token: Int32, e: Int32,
                 last: Int32):  # fmt: skip
        """The epilogue group: FP8 per 128 columns of x row ``min(token,
        last)`` into the plan's row ``token`` (codes [token, H], scales
        [token, H/128]); four threads per 128 columns, 32 values each."""
        chunks = self.hidden // 32
        for i in cutlass.range_constexpr((chunks + EPILOGUE_THREADS - 1) // EPILOGUE_THREADS):
            c = e + i * EPILOGUE_THREADS
            active = c < chunks
            values = cute.make_rmem_tensor(cute.make_layout((32,)), Float32)
            for v in cutlass.range_constexpr(32):
                values[v] = Float32(0.0)
            source = x + (Int64(cutlass.min(token, last)) * self.hidden + Int64(c) * 32) * 2
            if active:
                for h in cutlass.range_constexpr(4):
                    mc.load_bf16x8(source + h * 16, values, 8 * h)
            words, sx = mc.quantize_activations(values, 4, self.ue8m0)
            if active:
                target = plan_x + Int64(token) * self.hidden + Int64(c) * 32
                for h in cutlass.range_constexpr(2):
                    ptx.st_global_v4_u32(
                        target + 16 * h, words[4 * h], words[4 * h + 1], words[4 * h + 2],
                        words[4 * h + 3],
                    )  # fmt: skip
                if c % 4 == 0:
                    ptx.st_global_f32(plan_s + (Int64(token) * self.nk1 + c // 4) * 4, sx)

    def parity_block(self, counters: Int64, parity) -> Int64:
        """Address of counter block ``parity``."""
        return counters + Int64(parity) * (self.counters.words * 4)

    @cute.jit
    def start_call(self, t: Tables, counters: Int64, logits: Int64, bias: Int64, ids: Int64,
                   weights: Int64, x: Int64, plan_x: Int64, plan_s: Int64, cta: Int32,
                   tid: Int32, warp: Int32, lane: Int32, valid: Int32):  # fmt: skip
        """After the PDL wait: CTA c routes and quantizes tokens c, c + grid, ...
        (token c alone where M <= grid); every CTA
        learns its call parity, zeroes its slice of the other parity's counters
        (the next call's) and waits until every token is in the plan. With
        ``plan.local_routing``: CTA c < M quantizes token c and counts it,
        every CTA routes every token into its ``picks``, and no thread waits
        (the gatherers do, ``await_tokens``). Returns this call's counter
        block.

        ``valid``: the rows of x and logits the call holds (1..M, the
        ``valid`` parameter). Every one of the bucket's M tokens is routed
        and quantized; token t >= valid reads row valid - 1, so the call
        computes what it would for inputs padded by repeating their last row
        (``runtime.plan.pad_rows``) and reads no row past valid - 1."""
        last = cutlass.max(valid - 1, 0)
        words = self.counters.words
        calls = counters + self.counters.calls * 4
        scal = t.scal
        if tid == 32:
            scal[S_PARITY] = gp.call_parity(Int32(ptx.ld_global_cg_u32(calls)), self.grid)
        if cutlass.const_expr(self.stamps):
            if tid == 0:
                self.clear_stamps(t, cta)
        if cutlass.const_expr(self.plan.local_routing):
            # Every CTA routes every token, warp w token w; CTA c < M first
            # quantizes token c on the epilogue warps and counts it on the
            # ready word as soon as they are done (named barrier, release),
            # so the other CTAs' gatherers wait on the quantization only.
            if cta < self.tokens:
                if warp >= self.EPILOGUE_WARP:
                    e = tid - self.EPILOGUE_WARP * 32
                    # The call counter again (thread 32's copy in ``scal`` is
                    # not synchronized yet), in flight while quantizing.
                    called = Int32(ptx.ld_global_cg_u32(calls))
                    self.quantize(x, plan_x, plan_s, cta, e, last)
                    if cutlass.const_expr(self.stamps):
                        if e == 0:
                            self.stamp(t, "quantized")
                    ptx.fence_acq_rel_gpu()
                    ptx.bar_sync(BAR_EPILOGUE, EPILOGUE_THREADS)
                    if e == 0:
                        ready = self.parity_block(counters, gp.call_parity(called, self.grid))
                        ptx.red_add_release_gpu_u32(ready, Uint32(1))
            if warp < self.tokens:
                self.route_local(t, logits, bias, ids, weights, warp, lane, cta, last)
                if cutlass.const_expr(self.stamps):
                    if tid == 0:
                        self.stamp(t, "route_done")
        # Up to the SM count (the buckets up to 128 on the H200 and B200) CTA
        # c takes token c alone: an ``if``, not the loop below.
        elif cutlass.const_expr(self.tokens <= self.grid):
            if cta < self.tokens:
                if warp == 0:
                    self.route(logits, bias, ids, weights, cta, lane, last)
                    if cutlass.const_expr(self.stamps):
                        if lane == 0:
                            self.stamp(t, "route_done")
                elif warp >= self.EPILOGUE_WARP:
                    self.quantize(x, plan_x, plan_s, cta, tid - self.EPILOGUE_WARP * 32, last)
                    if cutlass.const_expr(self.stamps):
                        if tid == self.EPILOGUE_WARP * 32:
                            self.stamp(t, "quantized")
                ptx.fence_acq_rel_gpu()
        else:
            # More tokens than CTAs (a bucket above the SM count): CTA c takes
            # tokens c, c + grid, ...
            for token in cutlass.range(cta, self.tokens, self.grid, unroll=1):
                if warp == 0:
                    self.route(logits, bias, ids, weights, token, lane, last)
                elif warp >= self.EPILOGUE_WARP:
                    self.quantize(x, plan_x, plan_s, token, tid - self.EPILOGUE_WARP * 32, last)
            if cutlass.const_expr(self.stamps):  # after this CTA's last token
                if tid == 0:
                    self.stamp(t, "route_done")
                if tid == self.EPILOGUE_WARP * 32:
                    self.stamp(t, "quantized")
            ptx.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if cutlass.const_expr(self.stamps):
            if self.plan.local_routing or cta < self.tokens:  # compile-time first
                self.stamp_thread0(t, tid, gp.STAMP_POINTS.index("routed"))
        parity = scal[S_PARITY]
        mine = self.parity_block(counters, parity)
        other = self.parity_block(counters, 1 - parity)
        per_cta = gp.zero_share(words, self.grid)
        for i in cutlass.range(tid, per_cta, THREADS, unroll=1):
            if cta * per_cta + i < words:
                ptx.st_global_u32(other + Int64(cta * per_cta + i) * 4, Uint32(0))
        if cutlass.const_expr(not self.plan.local_routing):
            if tid == 0:
                if cta < self.tokens:
                    # One count per token this CTA put in the plan.
                    if cutlass.const_expr(self.tokens <= self.grid):
                        ptx.red_add_release_gpu_u32(mine, Uint32(1))
                    else:
                        ptx.red_add_release_gpu_u32(
                            mine, Uint32((self.tokens - 1 - cta) // self.grid + 1))  # fmt: skip
                wait_at_least(mine, Uint32(self.tokens))
            cute.arch.sync_threads()
            ptx.fence_acq_rel_gpu()
            self.stamp_thread0(t, tid, gp.STAMP_POINTS.index("tokens_ready"))
        return mine

    @cute.jit
    def await_tokens(self, t: Tables, mine: Int64, lane: Int32, gatherer: Int32):
        """A gatherer warp with ``plan.local_routing``, before its first B
        tile: lane 0 waits (acquire) until every token is counted on the
        ready word ``mine``, then the warp fences (the quantized rows and
        scales of other CTAs are read after it). Without local routing
        ``start_call`` waited already."""
        if cutlass.const_expr(self.plan.local_routing):
            if lane == 0:
                wait_at_least(mine, Uint32(self.tokens))
                if cutlass.const_expr(self.stamps):
                    if gatherer == 0:
                        self.stamp(t, "tokens_ready")
            cute.arch.sync_warp()
            ptx.fence_acq_rel_gpu()

    # -- units ----------------------------------------------------------------------------

    @cute.jit
    def number_units(self, t: Tables, ids: Int64, tid: Int32, warp: Int32, lane: Int32,
                     cta: Int32):  # fmt: skip
        """Unit tables: the shared expert's units (tokens 0..group-1, group..,
        ...), then the routed experts in expert order, each expert's routes in
        token order, one unit per started ``group``; and this CTA's stage
        ranges. Warp 0
        (the producer) goes on once the tables are written; the other warps
        also rank the routes into ``flat`` (named barrier BAR_RANKED)."""
        experts, routes = self.experts, self.routes
        mask, picks, eoff, flat = t.mask, t.picks, t.eoff, t.flat
        uexp, uoff, ucnt = t.uexp, t.uoff, t.ucnt
        words = self.plan.mask_words
        for i in cutlass.range(tid, words * experts, THREADS, unroll=1):
            mask[i] = Uint32(0)
        if cutlass.const_expr(not self.plan.local_routing):  # else routed into picks
            for r in cutlass.range(tid, routes, THREADS, unroll=1):
                picks[r] = Int32(ptx.ld_global_cg_u32(ids + Int64(r) * 4))
        cute.arch.sync_threads()
        mask_addr = t.base + self.layout.off_mask
        for r in cutlass.range(tid, routes, THREADS, unroll=1):
            word, bit = gp.mask_slot(picks[r], r // self.top_k, words)
            ptx.red_or_shared_u32(mask_addr + word * 4, Uint32(1) << Uint32(bit))
        cute.arch.sync_threads()
        if warp == 0:
            # Lane l counts experts l * per .. l * per + per - 1 (in order, so
            # the scan over lanes gives expert order); when 32 does not divide
            # the experts, the last lanes' numbers past E hold no expert.
            per = routing.candidates(experts)
            partial = experts % routing.LANES != 0
            counts = cute.make_rmem_tensor(cute.make_layout((per,)), Int32)
            distinct = Int32(0)
            count = Int32(0)
            for j in cutlass.range_constexpr(per):
                e = lane * per + j
                n = Int32(0)
                if cutlass.const_expr(partial):
                    for w in cutlass.range_constexpr(words):
                        got = Int32(cute.arch.popc(mask[words * cutlass.min(e, experts - 1) + w]))
                        n = n + (got if e < experts else Int32(0))
                else:
                    for w in cutlass.range_constexpr(words):
                        n = n + Int32(cute.arch.popc(mask[words * e + w]))
                counts[j] = n
                count = count + counts[j]
                distinct = distinct + gp.units_of(counts[j], self.group)
            units = distinct
            routed = count
            for shift in cutlass.range_constexpr(5):
                a = cute.arch.shuffle_sync_up(units, offset=1 << shift)
                b = cute.arch.shuffle_sync_up(routed, offset=1 << shift)
                if lane >= (1 << shift):
                    units = units + a
                    routed = routed + b
            unit = units - distinct + self.shared_units
            start = routed - count + self.tokens
            for j in cutlass.range_constexpr(per):
                e = lane * per + j
                n = counts[j]
                if cutlass.const_expr(partial):
                    if e < experts:
                        eoff[e] = start
                else:
                    eoff[e] = start
                # Experts of more than ``group`` tokens run as several units.
                for i in cutlass.range(0, n, self.group, unroll=1):
                    uexp[unit] = e
                    uoff[unit] = start + i
                    ucnt[unit] = gp.unit_size(n, i, self.group, cutlass.min)
                    unit = unit + 1
                start = start + n
            if lane < self.shared_units:
                uexp[lane] = Int32(-1)
                uoff[lane] = lane * self.group
                ucnt[lane] = gp.unit_size(self.tokens, lane * self.group, self.group, cutlass.min)
            if lane == 31:
                uoff[units + self.shared_units] = start
                self.ranges(t, units + self.shared_units, cta)
        for i in cutlass.range(tid, self.tokens, THREADS, unroll=1):
            flat[i] = i
        if warp == 0:
            cute.arch.sync_warp()
            ptx.bar_arrive(BAR_TABLES, THREADS)
        else:
            ptx.bar_sync(BAR_TABLES, THREADS)
            self.rank_routes(t, tid - 32)
            ptx.bar_sync(BAR_RANKED, THREADS - 32)

    @cute.jit
    def rank_routes(self, t: Tables, i: Int32):
        """``flat``: each expert's routes in token order (rows ``eoff[e]``..)."""
        mask, picks, eoff, flat = t.mask, t.picks, t.eoff, t.flat
        words = self.plan.mask_words
        for r in cutlass.range(i, self.routes, THREADS - 32, unroll=1):
            e = picks[r]
            rank = gp.rank_in_mask(r // self.top_k, lambda w, e=e: mask[words * e + w], words,
                                   cute.arch.popc, select, Uint32)  # fmt: skip
            flat[eoff[e] + Int32(rank)] = r

    def ranges(self, t: Tables, units: Int32, cta: Int32):
        """Stores this CTA's FC1 stage ranges of halves A and B and their FC2
        job counts (``grouped_plan.ranges``) in ``scal``."""
        scal = t.scal
        r = gp.ranges(self.plan, units, cta, select)
        for name, index in gp.RANGE_SCALARS.items():
            scal[index] = getattr(r, name)

    def locate(self, t: Tables, n):
        """``grouped_plan.locate`` of this CTA's n-th FC1 stage."""
        return gp.locate(self.plan, t.ranges, n, select, branch)

    def describe(self, t: Tables, n):
        """This CTA's n-th FC1 stage word (``grouped_plan.describe``)."""
        return gp.describe(self.plan, t.ranges, n, select, branch, Uint32)

    # -- weights --------------------------------------------------------------------------

    def weight_box(self, t: Tables, word):
        """``grouped_plan.weight_box`` of a stage word: (tensor map index, row
        tile, first K-block coordinate); maps are w13, w2, s13, s2."""
        fc2, _, unit, tile, kb, _, _ = unpack(word)
        return gp.weight_box(self.plan, fc2, t.uexp[unit], tile, kb, select)

    @cute.jit
    def weight_scale(self, t: Tables, word, d, w13_scale: Int64, w2_scale: Int64,
                     s13_scale: Int64, s2_scale: Int64):  # fmt: skip
        """The FP32 weight block scale of K block d of a stage."""
        fc2, _, unit, tile, kb, _, _ = unpack(word)
        expert = t.uexp[unit]
        safe = Int64(cutlass.max(expert, Int32(0)))
        value = Float32(0.0)
        if fc2:
            index = gp.scale_index(self.plan, True, safe, tile, kb) + d
            base = w2_scale
            if expert < 0:
                base = s2_scale
            value = ptx.ld_global_nc_f32(base + index * 4)
        else:
            index = gp.scale_index(self.plan, False, safe, tile, kb) + d
            base = w13_scale
            if expert < 0:
                base = s13_scale
            value = ptx.ld_global_nc_f32(base + index * 4)
        return value

    # -- the producer (warp 0, one lane) -------------------------------------------------

    @cute.jit
    def post(self, t: Tables, maps: Int64, n, word, waits=None):
        """Posts stage n's word, then loads its weights (END: arrive only).
        ``waits`` (a diagnostics build: Int64 [1] in registers) sums the ns
        spent waiting for the free stage."""
        slot = n % self.stages
        if n >= self.stages:
            if cutlass.const_expr(self.stamps):
                start = ptx.globaltimer()
            ptx.mbarrier_wait(t.empty(slot), ((n // self.stages) - 1) % 2)
            if cutlass.const_expr(self.stamps):
                waits[0] = waits[0] + (ptx.globaltimer() - start)
        desc = t.desc
        desc[n % self.posts] = word
        ptx.mbarrier_arrive(t.posted(n % self.posts))
        if word == Uint32(END):
            ptx.mbarrier_arrive(t.full(slot))
        else:
            index, tile, chunk = self.weight_box(t, word)
            ptx.mbarrier_arrive_expect_tx(t.full(slot), self.layout.a_bytes)
            tmap = maps + Int64(index) * 128
            # Weights stream through L2 once: evict them first, keeping the
            # plan, hidden blocks, partials and outputs there
            # (docs/notes/grouped-sm90.md).
            policy = ptx.create_policy_evict_first()
            for d in cutlass.range_constexpr(self.depth):
                ptx.tma_load_3d_hint(
                    t.weights + slot * self.layout.a_bytes + d * STAGE_BYTES, tmap,
                    t.full(slot), Int32(0), tile * TILE, chunk + d, policy,
                )  # fmt: skip

    @cute.jit
    def produce(self, t: Tables, maps: Int64, jobs: Int64):
        """Weights of this CTA's FC1 stages, then of the FC2 jobs it claims
        ``chunk`` at a time from the per-half job counters (FC2 balances FC1's
        uneven finish), then one END per gatherer."""
        self.stamp(t, "tables")
        waits = None
        if cutlass.const_expr(self.stamps):
            waits = cute.make_rmem_tensor(cute.make_layout((1,)), Int64)
            waits[0] = Int64(0)
        n1 = t.scal[S_N1A] + t.scal[S_N1B]
        for n in cutlass.range(n1, unroll=1):
            self.post(t, maps, n, self.describe(t, n), waits)
        self.stamp(t, "fc1_posted")
        n = n1
        half = Int32(0)
        claim = Int32(ptx.atom_add_release_gpu_u32(jobs, Uint32(self.chunk)))
        while half < 2:
            count = t.scal[S_J2A]
            first = Int32(0)
            if half == 1:
                count = t.scal[S_J2B]
                first = t.scal[S_SPLIT]
            if claim < count:
                start = claim
                # The next claim is in flight while these jobs' stages load.
                claim = Int32(ptx.atom_add_release_gpu_u32(jobs + Int64(half) * 4,
                                                           Uint32(self.chunk)))  # fmt: skip
                for job in cutlass.range(start, cutlass.min(start + self.chunk, count), unroll=1):
                    unit, tile = gp.job_of(self.plan, first, job)
                    for k in cutlass.range_constexpr(self.job):
                        self.post(t, maps, n, gp.fc2_word(self.plan, unit, tile, k, Uint32), waits)
                        n = n + 1
            else:
                half = half + 1
                if half < 2:
                    claim = Int32(ptx.atom_add_release_gpu_u32(jobs + 4, Uint32(self.chunk)))
        for g in cutlass.range_constexpr(self.GATHERERS):
            self.post(t, maps, n + g, Uint32(END), waits)
        if cutlass.const_expr(self.stamps):
            self.stamp(t, "all_posted")
            self.stamp(t, "wait_empty", waits[0])
            self.stamp(t, "fc1_stages", n1)
            self.stamp(t, "fc2_stages", n - n1)
            self.stamp(t, "units", t.scal[gp.S_UNITS])

    # -- the gatherers ----------------------------------------------------------------------

    @cute.jit
    def gather(self, t: Tables, plan_x: Int64, plan_s: Int64, hidden: Int64, hscale: Int64,
               unit_ready: Int64, lane: Int32, w13_scale: Int64, w2_scale: Int64,
               s13_scale: Int64, s2_scale: Int64, gatherer: Int32):  # fmt: skip
        """Stages ``gatherer``, ``gatherer + GATHERERS``, ... up to END: each
        stage's B tile, the unit's token rows of K blocks kb.. (FC1: the
        quantized tokens, FC2: the unit's hidden), 128B-swizzled (16-byte
        chunk c of row j at c ^ (j % 8)), and its column scales (weight block
        scale times the token's activation or hidden scale) into the scale
        ring. Columns past the unit's tokens are left stale: their results are
        computed and never stored."""
        w = self.group
        hs = t.hs(gatherer)
        ring, desc, flat, ucnt, uoff = t.ring, t.desc, t.flat, t.ucnt, t.uoff
        chunks = w * 8 // 32
        rows = cute.make_rmem_tensor(cute.make_layout((chunks,)), Int64)
        for k in cutlass.range_constexpr(chunks):
            rows[k] = Int64(-1)
        current = Int32(-1)  # unit (FC2: + max_units) of ``rows``
        token_scales = Int64(0)
        count = Int32(0)
        n = gatherer
        word = Uint32(0)
        while word != Uint32(END):
            slot = n % self.stages
            if n >= self.stages:
                ptx.mbarrier_wait(t.empty(slot), ((n // self.stages) - 1) % 2)
            ptx.mbarrier_wait(t.posted(n % self.posts), (n // self.posts) % 2)
            word = Uint32(desc[n % self.posts])
            if word != Uint32(END):
                fc2, _, unit, _, kb, _, _ = unpack(word)
                # Lane d < depth: the weight block scale of K block kb + d.
                ws = Float32(0.0)
                if lane < self.depth:
                    ws = self.weight_scale(t, word, lane, w13_scale, w2_scale, s13_scale,
                                           s2_scale)  # fmt: skip
                key = unit
                if fc2:
                    key = unit + self.max_units
                if key != current:
                    count = ucnt[unit]
                    first = uoff[unit]
                    routed = unit >= self.shared_units
                    if fc2:
                        if lane == 0:
                            ready = unit_ready + Int64(unit) * 4
                            wait_at_least(ready, Uint32(self.pairs))
                            if cutlass.const_expr(self.stamps):
                                if n < t.scal[S_N1A] + t.scal[S_N1B] + self.GATHERERS:
                                    self.stamp(t, "fc2_ready")
                        cute.arch.sync_warp()
                        ptx.fence_acq_rel_gpu()
                        for i in cutlass.range(lane, count * self.nk2, 32, unroll=1):
                            hs[i] = ptx.ld_global_cg_f32(
                                hscale + (Int64(unit) * (w * self.nk2) + i) * 4
                            )
                        cute.arch.sync_warp()
                    for k in cutlass.range_constexpr(chunks):
                        j = (lane + 32 * k) // 8
                        rows[k] = Int64(-1)
                        if j < count:
                            if fc2:
                                rows[k] = hidden + (Int64(unit) * w + j) * self.inter
                            else:
                                token = flat[first + j]
                                if routed:
                                    token = token // self.top_k
                                rows[k] = plan_x + Int64(token) * self.hidden
                    if lane < count:
                        token = flat[first + lane]
                        if routed:
                            token = token // self.top_k
                        token_scales = plan_s + Int64(token) * (self.nk1 * 4)
                    current = key
                # The tokens' activation scales (FC1), in flight with ``ws``.
                xs = cute.make_rmem_tensor(cute.make_layout((self.depth,)), Float32)
                for d in cutlass.range_constexpr(self.depth):
                    xs[d] = Float32(0.0)
                if not fc2:
                    if lane < count:
                        for d in cutlass.range_constexpr(self.depth):
                            xs[d] = ptx.ld_global_cg_f32(token_scales + (kb + d) * 4)
                dst = t.tokens + slot * self.layout.b_bytes
                for k in cutlass.range_constexpr(chunks):
                    if rows[k] >= Int64(0):
                        i = lane + 32 * k
                        j = i // 8
                        c = i % 8
                        for d in cutlass.range_constexpr(self.depth):
                            ptx.cp_async_cg_16(
                                dst + gp.b_chunk(self.layout, d, j, c),
                                rows[k] + (kb + d) * TILE + c * 16,
                            )
                for d in cutlass.range_constexpr(self.depth):
                    w_d = cute.arch.shuffle_sync(ws, d)
                    if lane < count:
                        scale = xs[d]
                        if fc2:
                            scale = hs[lane * self.nk2 + kb + d]
                        ring[gp.ring_index(self.layout, n, d, lane)] = w_d * scale
            ptx.cp_async_mbarrier_arrive_noinc(t.full(slot))
            ptx.mbarrier_arrive(t.full(slot))
            n = n + self.GATHERERS

    def ring_scale(self, t: Tables, n, d: int, token):
        """The column scale of K block d, token ``token`` of stage n."""
        return t.ring[gp.ring_index(self.layout, n, d, token)]

    # -- the epilogue group: FC1 pair close, FC2 rows --------------------------------------

    @cute.jit
    def close_pair(self, t: Tables, frag: Fragment, up, gate, n, opened, count, unit,
                   half, cta: Int32, e: Int32, hidden: Int64, hscale: Int64,
                   partial: Int64, mine: Int64):  # fmt: skip
        """End of this CTA's piece (stages ``opened``..``n``) of an FC1 pair:
        finish the pair when the piece is all of it; else publish the partial
        (the piece starts this CTA's range) for the pair's owner, or, as the
        owner (the piece ends this CTA's range), add the others' partials in
        CTA order and finish the pair. Partial layout: [values / 2 words of 4
        floats][128 threads][4]."""
        _, _, _, _, s = self.locate(t, n)
        base, pair, whole = gp.pair_of(self.plan, s, n, opened)
        unit_ready = mine + self.counters.unit_ready * 4
        if whole:
            self.finish(t, frag, up, gate, unit, pair, count, e, hidden, hscale, unit_ready)
        else:
            size = t.scal[S_S1A]
            if half == 1:
                size = t.scal[S_S1B]
            first, last = gp.pair_owners(self.plan, base, size)
            arrivals = mine + gp.pair_counter(self.plan, unit, pair) * 4
            v = frag.values
            piece_bytes = 2 * v * EPILOGUE_THREADS * 4
            if cta != first:
                piece = partial + gp.partial_slot(self.plan, Int64(half), cta) * piece_bytes
                for i in cutlass.range_constexpr(2 * v // 4):
                    src = up if i < v // 4 else gate
                    o = (i % (v // 4)) * 4
                    ptx.st_global_v4_u32(
                        piece + (Int64(i) * EPILOGUE_THREADS + e) * 16,
                        ptx.float_bits(src[o]), ptx.float_bits(src[o + 1]),
                        ptx.float_bits(src[o + 2]), ptx.float_bits(src[o + 3]),
                    )  # fmt: skip
                ptx.bar_sync(BAR_EPILOGUE, EPILOGUE_THREADS)
                if e == 0:
                    # Cumulative: releases the stores the barrier ordered first.
                    ptx.fence_acq_rel_gpu()
                    ptx.red_add_release_gpu_u32(arrivals, Uint32(1))
            else:
                if e == 0:
                    wait_at_least(arrivals, Uint32(gp.pair_partials(self.plan, first, last, size,
                                                                    select)))  # fmt: skip
                ptx.bar_sync(BAR_EPILOGUE, EPILOGUE_THREADS)
                ptx.fence_acq_rel_gpu()
                for c in cutlass.range(first + 1, last + 1, unroll=1):
                    # A CTA with no stage in this half published nothing.
                    if gp.holds_stages(self.plan, c, size):
                        piece = partial + gp.partial_slot(self.plan, Int64(half), c) * piece_bytes
                        for i in cutlass.range_constexpr(2 * v // 4):
                            got = ptx.ld_global_cg_v4_u32(
                                piece + (Int64(i) * EPILOGUE_THREADS + e) * 16
                            )
                            o = (i % (v // 4)) * 4
                            for k in cutlass.range_constexpr(4):
                                if cutlass.const_expr(i < v // 4):
                                    up[o + k] = up[o + k] + ptx.bits_float(got[k])
                                else:
                                    gate[o + k] = gate[o + k] + ptx.bits_float(got[k])
                self.finish(t, frag, up, gate, unit, pair, count, e, hidden, hscale, unit_ready)

    @cute.jit
    def finish(self, t: Tables, frag: Fragment, up, gate, unit, pair, count, e: Int32,
               hidden: Int64, hscale: Int64, unit_ready: Int64):  # fmt: skip
        """Clamped SwiGLU of hidden block ``pair``, FP8 per 128 per token
        (scale amax / 448), published for FC2: codes [unit, group, I], scales
        [unit, group, I/128], then one release on the unit's counter. Columns
        past ``count`` are computed, never stored."""
        w = self.group
        amax_smem = t.amax
        for v in cutlass.range_constexpr(frag.values):
            up[v] = mc.swiglu(gate[v], up[v], self.limit)
        for s in cutlass.range_constexpr(frag.slots):
            amax = Float32(0.0)
            for r in cutlass.range_constexpr(frag.rows):
                amax = ptx.fmax_abs(amax, up[frag.index(s, r)])
            for off in cutlass.range_constexpr(len(frag.shuffles)):
                amax = ptx.fmax_nan(
                    amax, cute.arch.shuffle_sync_bfly(amax, offset=frag.shuffles[off])
                )
            if frag.amax_writer:
                amax_smem[frag.warp * w + frag.token(s)] = amax
        ptx.bar_sync(BAR_EPILOGUE, EPILOGUE_THREADS)
        unit_rows = hidden + Int64(unit) * (w * self.inter) + pair * TILE
        for s in cutlass.range_constexpr(frag.slots):
            token = Int32(frag.token(s))
            amax = ptx.fmax_nan(
                ptx.fmax_nan(t.amax[token], t.amax[w + token]),
                ptx.fmax_nan(t.amax[2 * w + token], t.amax[3 * w + token]),
            )
            scale = mc.hidden_scale(amax)
            if token < count:
                row = unit_rows + Int64(token) * self.inter
                if cutlass.const_expr(frag.paired):
                    for r in cutlass.range_constexpr(frag.rows // 2):
                        lo = mc.fp8_code(up[frag.index(s, 2 * r)], scale)
                        hi = mc.fp8_code(up[frag.index(s, 2 * r + 1)], scale)
                        ptx.st_global_u16(row + Int64(frag.row(s, 2 * r)), lo | (hi << 8))
                else:
                    for r in cutlass.range_constexpr(frag.rows):
                        code = mc.fp8_code(up[frag.index(s, r)], scale)
                        ptx.st_global_u8(row + Int64(frag.row(s, r)), code)
                if frag.scale_writer:
                    ptx.st_global_f32(
                        hscale + ((Int64(unit) * w + token) * self.nk2 + pair) * 4, scale
                    )
        ptx.bar_sync(BAR_EPILOGUE, EPILOGUE_THREADS)
        if e == 0:
            ptx.fence_acq_rel_gpu()
            ptx.red_add_release_gpu_u32(unit_ready + Int64(unit) * 4, Uint32(1))

    @cute.jit
    def store_rows(self, t: Tables, frag: Fragment, acc, unit, tile, count, out: Int64,
                   shared_out: Int64):  # fmt: skip
        """An FC2 job's BF16 output rows: route rows of ``out`` [M * top_k, H]
        (finalize-ready, unweighted) or token rows of ``shared_out``."""
        first = t.uoff[unit]
        base = out + Int64(tile) * (TILE * 2)
        if unit < self.shared_units:
            base = shared_out + Int64(tile) * (TILE * 2)
        for s in cutlass.range_constexpr(frag.slots):
            token = Int32(frag.token(s))
            if token < count:
                row = base + Int64(t.flat[first + token]) * (self.hidden * 2)
                if cutlass.const_expr(frag.paired):
                    for r in cutlass.range_constexpr(frag.rows // 2):
                        word = ptx.cvt_bf16x2(
                            acc[frag.index(s, 2 * r)], acc[frag.index(s, 2 * r + 1)]
                        )
                        ptx.st_global_u32(row + Int64(frag.row(s, 2 * r)) * 2, word)
                else:
                    for r in cutlass.range_constexpr(frag.rows):
                        ptx.st_global_u16(
                            row + Int64(frag.row(s, r)) * 2, ptx.cvt_bf16(acc[frag.index(s, r)])
                        )

    # -- the call's end -------------------------------------------------------------------

    @cute.jit
    def end_call(self, t: Tables, counters: Int64, mine: Int64, out: Int64, shared_out: Int64,
                 final: Int64, weights: Int64, cta: Int32, tid: Int32,
                 valid: Int32):  # fmt: skip
        """Every thread of the CTA: the finalize of the call's ``valid``
        tokens (once every CTA is through FC2), then this CTA's count on the
        call counter."""
        if cutlass.const_expr(self.finalize):
            finished = mine + self.counters.finished * 4
            if tid == 0:
                ptx.fence_acq_rel_gpu()
                ptx.red_add_release_gpu_u32(finished, Uint32(1))
                wait_at_least(finished, Uint32(self.grid))
                self.stamp(t, "finished")
            cute.arch.sync_threads()
            ptx.fence_acq_rel_gpu()
            self.finish_tokens(out, shared_out, final, weights, cta, tid, valid)
        if tid == 0:
            ptx.atom_inc_relaxed_gpu_u32(
                counters + self.counters.calls * 4, Uint32(gp.call_limit(self.grid))
            )

    @cute.jit
    def finish_tokens(self, out: Int64, shared_out: Int64, final: Int64, weights: Int64,
                      cta: Int32, tid: Int32, valid: Int32):  # fmt: skip
        """``final`` = the routes' rows weighted by their routing weights (FP32,
        top-k order) plus the shared expert's row (when the model has one),
        eight columns a thread; rows 0..valid - 1 only (``valid`` clamped to
        the bucket), so ``final`` may be a tensor of the call's rows (a
        chunk's rows of the caller's output, ``runtime.chunks``)."""
        per_token = self.hidden // 8
        rows = cutlass.min(cutlass.max(valid, 0), self.tokens)
        for v in cutlass.range(cta * THREADS + tid, rows * per_token, self.grid * THREADS,
                               unroll=1):  # fmt: skip
            token = v // per_token
            column = Int64((v % per_token) * 8)
            total = cute.make_rmem_tensor(cute.make_layout((8,)), Float32)
            for c in cutlass.range_constexpr(8):
                total[c] = Float32(0.0)
            for k in cutlass.range_constexpr(self.top_k):
                route = Int64(token * self.top_k + k)
                got = ptx.ld_global_cg_v4_u32(out + (route * self.hidden + column) * 2)
                wk = ptx.ld_global_cg_f32(weights + route * 4)
                for c in cutlass.range_constexpr(4):
                    total[2 * c] = total[2 * c] + wk * ptx.bf16_low(got[c])
                    total[2 * c + 1] = total[2 * c + 1] + wk * ptx.bf16_high(got[c])
            row = (Int64(token) * self.hidden + column) * 2
            if cutlass.const_expr(self.shared_experts):
                shared = ptx.ld_global_cg_v4_u32(shared_out + row)
                words = [
                    ptx.cvt_bf16x2(
                        total[2 * c] + ptx.bf16_low(shared[c]),
                        total[2 * c + 1] + ptx.bf16_high(shared[c]),
                    )
                    for c in range(4)
                ]
                ptx.st_global_v4_u32(final + row, *words)
            else:
                words = [ptx.cvt_bf16x2(total[2 * c], total[2 * c + 1]) for c in range(4)]
                ptx.st_global_v4_u32(final + row, *words)


# -- build -----------------------------------------------------------------------------------


def workspaces(plan: GroupedPlan) -> tuple[Workspace, ...]:
    """The variant's workspaces (``grouped_plan.workspaces``; one set serves
    every bucket of a model)."""
    return gp.workspaces(plan.hidden, plan.inter, plan.experts, plan.top_k, plan.grid,
                         gp.stamps_enabled())  # fmt: skip


def check_spec(spec, arch: str, module: str) -> None:
    """Refuses a spec that is not ``grouped``/``arch``."""
    if spec.kernel != "grouped" or spec.arch != arch:
        raise ValueError(f"{module} builds grouped/{arch}, not {spec.kernel}/{spec.arch}")


def compile_grouped(kernel: GroupedCommon, prefix: str, **notes) -> CompiledKernel:
    """Compiles ``kernel`` (a grouped kernel object: its ``__call__`` is the
    launch) over fake arguments of the ABI (``kernels.abi``, workspaces by
    name and bytes) with ``build_common.compile_entry``; ``notes``: the
    architecture's own compile notes."""
    spec, plan = kernel.spec, kernel.plan
    spaces = workspaces(plan)
    params, maps = kernel.params, kernel.maps
    args = fake_arguments(params, spec.hidden, spec.inter, spec.experts, spec.top_k, spec.tokens,
                          len(maps), spec.logits_dtype,
                          workspace={w.name: w.bytes for w in spaces})  # fmt: skip
    entry_point = kernel if kernel.shared_experts else kernel.routed_only
    cubin, ptx_text, entry = compile_entry(entry_point, args, prefix)
    return CompiledKernel(
        cubin=cubin, entry=entry, params=tuple(Param(name, param_kind(name)) for name in params),
        launch=kernel.launch_shape(), tensor_maps=maps, workspace=spaces, ptx=ptx_text,
        notes=kernel.notes(**notes),
    )  # fmt: skip
