"""The sm_90a mega kernel built by the DSL compiler (marked ``compile``): three
glm5 mega variants (both ends of the buckets, both logits dtypes, UE8M0 on
and off) and one without a shared expert compiled in a fresh sm_90a process,
their records checked against the mega ABI (with and without the shared
expert's routes) and their SASS read back: FP8 wgmma (QGMMA), TMA loads, no
local memory, registers and shared memory that fit the CTAs per SM the
variant was tuned for.

What the kernel computes is checked on the H200 (``test_mega_sm90_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from sass_tools import (
    compile_specs,
    count,
    cuobjdump,
    loads_before_pdl_wait,
    resources,
    sass_counts,
)

from kernels import abi
from kernels.spec import PARAMETER_NAMES, KernelSpec

ENTRY = "moe_mega_sm90_0"
MEGA_PARAMS, ROUTED_PARAMS = abi.MEGA_PARAMS, abi.MEGA_ROUTED_PARAMS
THREADS = 160  # MMA warpgroup + producer warp
CLUSTER = 8  # 2 * inter / 128 CTAs per route
# H200 (sm_90) per-SM resources the tuned CTAs-per-SM must fit in.
REGISTERS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024


def spec(tokens, dtype="float32", ue8m0=False, shared=1) -> KernelSpec:
    return KernelSpec("mega", "sm_90a", 4096, 512, 288, 8, 2.5, 10.0, ue8m0, tokens, dtype,
                      False, 132, shared_experts=shared)  # fmt: skip


SPECS = [spec(1), spec(2, "bfloat16", ue8m0=True), spec(4, "float32", ue8m0=True),
         spec(4, shared=0)]  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Compiles SPECS in a fresh process started for sm_90a (CUTE_DSL_ARCH is
    read when cutlass is first imported; cwd a temporary directory so that
    nothing the DSL dumps lands in the repository)."""
    out = tmp_path_factory.mktemp("mega90")
    records = compile_specs("sm_90a", [(str(i), s) for i, s in enumerate(SPECS)], out)
    return out, records


@pytest.mark.compile
def test_variants_build_into_wgmma_tma_and_no_local_memory(built):
    tool = cuobjdump()
    out, records = built
    for i, (s, r) in enumerate(zip(SPECS, records, strict=True)):
        cubin = out / f"{i}.cubin"
        ops, res = sass_counts(tool, cubin), resources(tool, cubin)
        notes = r["notes"]
        print(f"m{s.tokens} {s.logits_dtype} ue8m0={s.ue8m0}: {r['seconds']} s, REG "
              f"{res['REG']}, smem {r['smem']}, stages {notes['stages']} at "
              f"{notes['ctas_per_sm']} CTA/SM, QGMMA {count(ops, 'QGMMA')}")  # fmt: skip
        # Every CTA streams its GEMM1 row tile over all K blocks, then its
        # GEMM2 rows: one TMA box per stage, fully unrolled.
        loads = s.hidden // 128 + (s.hidden // CLUSTER // 128) * (s.inter // 128)
        assert ops.get("UTMALDG.3D", 0) == loads, ops
        # Per stage: two m64 row halves x four k32 steps of m64n8k32 FP8 wgmma.
        assert ops.get("QGMMA.64x8x32.F32.E4M3.E4M3", 0) == loads * 2 * 4, ops
        assert count(ops, "QGMMA") == loads * 2 * 4, ops
        assert count(ops, "WARPGROUP.DEPBAR") == loads, ops  # one wait_group per stage
        assert count(ops, "REDUX") >= 2, ops  # warp routing (redux.sync)
        assert count(ops, "STAS") >= 1, ops  # st.async into peer CTAs
        # The producer polls (mbarrier.test_wait, no TRYWAIT) for each free
        # stage after the first ring's worth: racecheck hangs on try_wait
        # there (kernels/mega_moe_sm90.py, "Cluster waits").
        free_waits = loads - notes["stages"]
        assert ops.get("SYNCS.PHASECHK.TRANS64", 0) == free_waits, ops
        assert "LDL" not in ops and "STL" not in ops, ops
        assert res["LOCAL"] == 0 and res["STACK"] == 0, res
        # x, logits and bias may come from the previous grid: no global load
        # on any path before its PDL wait (a shared route's producer, which
        # streams before the wait, issues TMA only).
        assert loads_before_pdl_wait(tool, cubin) == [], s
        # The CTAs per SM the ring depth was chosen for fit.
        per_sm = notes["ctas_per_sm"]
        assert res["REG"] * THREADS * per_sm <= REGISTERS_PER_SM, res
        assert (r["smem"] + res["SHARED"]) * per_sm <= SMEM_PER_SM, (r["smem"], res)


@pytest.mark.compile
def test_launch_records_match_the_mega_abi(built):
    out, records = built
    for i, (s, r) in enumerate(zip(SPECS, records, strict=True)):
        names = MEGA_PARAMS if s.shared_experts else ROUTED_PARAMS
        maps = ["w13", "w2", "s13", "s2"] if s.shared_experts else ["w13", "w2"]
        assert r["entry"] == ENTRY
        assert [p for p, _ in r["params"]] == list(names)
        assert all(kind == "pointer" and p in PARAMETER_NAMES for p, kind in r["params"])
        # One cluster per route, plus one per token for the shared expert.
        assert r["grid"] == [CLUSTER * s.tokens * (s.top_k + s.shared_experts), 1, 1]
        assert r["notes"]["shared_routes"] == s.tokens * s.shared_experts
        assert r["block"] == [THREADS, 1, 1] and r["cluster"] == [CLUSTER, 1, 1]
        assert r["pdl"] is True and r["maps"] == maps
        # The finalize's arrival counts: one word per (token, CTA rank).
        assert r["workspace"] == [["arrivals", 4 * s.tokens * CLUSTER, True]]
        assert r["smem"] >= r["notes"]["stages"] * 128 * 128
        # Every parameter is one 8-byte pointer in the PTX entry, and the
        # kernel waits on the previous grid (PDL) before reading inputs (the
        # first global load and the first TMA follow a wait in the text; a
        # shared route's producer, which reads no input, streams before its
        # wait; the SASS walk checks every path).
        ptx = (out / f"{i}.ptx").read_text()
        entry = ptx[ptx.index(f".entry {ENTRY}(") :]
        body = entry
        entry = entry[: entry.index(")")]
        params = re.findall(rf"\.param ([^\n]*?){ENTRY}_param_\d+(\[\d+\])?", entry)
        assert len(params) == len(names)
        assert all(size == "[8]" or ".u64" in decl for decl, size in params), params
        wait = body.index("griddepcontrol.wait")
        first_load = re.search(r"\bld\.global\.", body).start()
        assert first_load > wait and body.index("cp.async.bulk.tensor") > wait
        # No early launch of the next grid (docs/notes/mega-sm90.md).
        assert "griddepcontrol.launch_dependents" not in body
        # The producer warp hands its pick, then its routing weights, to the
        # MMA warps: one arrive (32 threads) and one sync (128) of all 160
        # threads on each of named barriers 2 and 3.
        for barrier in (2, 3):
            arrive, sync = f"bar.arrive {barrier}, {THREADS};", f"bar.sync {barrier}, {THREADS};"
            assert body.count(arrive) == 1 and body.count(sync) == 1, barrier


#: Other models' shards (docs/models.md): an uneven GEMM2 split over a
#: 6-CTA cluster (GLM-4.5), a 12-CTA cluster without a shared expert and
#: softmax routing (Qwen3-30B), DeepSeek-V3's group-limited routing over 56 K
#: blocks, an odd K block count, and a TP8 shard's M = 1 on the H200's 132 SMs,
#: whose GEMM1 K runs in 2 parts (``mega_plan.mega_split``).
OTHER_SHAPES = [
    dict(hidden=5120, inter=384, experts=160, tokens=1, shared_experts=1),
    dict(
        hidden=2048, inter=768, experts=128, tokens=4, shared_experts=0, score="softmax", bias=False
    ),  # fmt: skip
    dict(
        hidden=7168, inter=256, experts=256, tokens=2, shared_experts=1, groups=8, groups_kept=4
    ),  # fmt: skip
    dict(hidden=1152, inter=384, experts=64, tokens=3, shared_experts=1),
    dict(hidden=7168, inter=256, experts=256, tokens=1, shared_experts=1),
]


@pytest.mark.compile
def test_other_model_shapes_build(tmp_path):
    """Each shape compiles into the mega ABI with its own cluster (one CTA per
    GEMM1 row tile and K part), streams ``mega_plan.MegaPlan.loads`` TMA stages a CTA
    (an uneven split's CTAs all stream as many), eight m64n8k32 wgmma a
    stage, and declares no local-memory arrays. Register spills (STACK) are
    printed, not refused: hidden 6144 and 7168 spill a few words
    (docs/notes/mega-sm90.md), GLM-5's variants none (checked above)."""
    from kernels import mega_plan as mp

    specs = [
        dataclasses.replace(spec(1), limit=None, **{k: v for k, v in shape.items()})
        for shape in OTHER_SHAPES
    ]
    records = compile_specs("sm_90a", [(f"o{i}", s) for i, s in enumerate(specs)], tmp_path)
    tool = cuobjdump()
    for i, (s, r) in enumerate(zip(specs, records, strict=True)):
        p = mp.plan_of(s)
        cubin = tmp_path / f"o{i}.cubin"
        ops, res = sass_counts(tool, cubin), resources(tool, cubin)
        print(f"{s.hidden}x{s.inter} m{s.tokens}: REG {res['REG']}, STACK {res['STACK']}, "
              f"cluster {p.cluster}, tiles2 {p.tiles2} (even {p.even2}), loads {p.loads}")  # fmt: skip
        assert p.cluster == 2 * s.inter // 128 * p.split and r["cluster"] == [p.cluster, 1, 1]
        # The inter-256 shapes split in 2 where the split grid is one wave
        # (``mega_plan.one_wave``: 9..36 eight-CTA clusters of M = 1..4 on 132 SMs).
        clusters = s.tokens * (s.top_k + s.shared_experts)
        wave = mp.one_wave("sm_90a", clusters, 2 * s.inter // 128 * 2, s.sms)
        assert p.split == (2 if s.inter == 256 and wave else 1)
        assert r["grid"] == [p.cluster * s.tokens * (s.top_k + s.shared_experts), 1, 1]
        names = MEGA_PARAMS if s.shared_experts else ROUTED_PARAMS
        assert [n for n, _ in r["params"]] == list(names)
        assert ops.get("UTMALDG.3D", 0) == p.loads == p.nk1 // p.split + p.tiles2 * p.nk2, ops
        assert count(ops, "QGMMA") == p.loads * 2 * 4, ops
        assert res["LOCAL"] == 0, res
        assert loads_before_pdl_wait(tool, cubin) == [], s
