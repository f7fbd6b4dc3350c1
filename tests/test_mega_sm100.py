"""The sm_100a mega kernel: host formulas (no compiler) and, marked
``compile``, every glm5 mega bucket built for sm_100a and its SASS read back.

There is no Blackwell GPU here: these tests show the kernel builds into the
instructions the kernel's design needs (tcgen05 FP8 UMMA, TMA, TMEM loads,
DSMEM stores), within the launch's resources; they cannot show it computes
the right numbers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from sass_tools import (
    compile_specs,
    count,
    cuobjdump,
    glm5_specs,
    loads_before_pdl_wait,
    resources,
    sass_counts,
)

pytest.importorskip("cutlass")  # the kernel module is device code

from kernels import mega_common as mgc  # noqa: E402
from kernels import mega_moe_sm100 as mega  # noqa: E402
from kernels import mega_plan as mp  # noqa: E402
from kernels.grouped_plan import SMEM_LIMIT, SMEM_OPTIN  # noqa: E402
from kernels.ptx import tcgen05 as tc  # noqa: E402
from kernels.spec import PARAMETER_NAMES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GLM5 = {"hidden": 4096, "inter": 512, "experts": 288, "top_k": 8}
#: Shared memory of one SM on B200 (228 KiB) and the 1 KiB the system reserves
#: per CTA; two mega CTAs must fit (``min_blocks_per_mp=2``), but for a
#: variant that runs alone on its SM (``MegaPlan.alone``).
SMEM_PER_SM, SMEM_PER_CTA_RESERVED = 233472, 1024
REGISTERS_PER_SM = 65536


def plan(tokens: int = 1, shared: int = 1, **shape) -> mp.MegaPlan:
    return mp.plan_for("sm_100a", **{**GLM5, **shape}, tokens=tokens, shared_experts=shared)


# -- host formulas (the shared ones: tests/test_mega_plan.py) ---------------------------------


def test_layout_fits_two_ctas_per_sm():
    p = plan()
    assert p.ctas_per_sm == 2
    assert p.smem <= SMEM_LIMIT["sm_100a"] <= SMEM_OPTIN["sm_100a"]
    assert 2 * (p.smem + SMEM_PER_CTA_RESERVED) <= SMEM_PER_SM
    assert plan(tokens=4).smem == p.smem  # independent of the bucket


@pytest.mark.parametrize(
    "shape,split,sets1,alloc",
    [({}, 2, 1, 64), ({"hidden": 5120, "inter": 384}, 2, 2, 128),
     ({"hidden": 7168, "inter": 256}, 4, 1, 128), ({"hidden": 2048, "inter": 768}, 1, 1, 64),
     ({"hidden": 8192, "inter": 128}, 8, 1, 128)],
)  # fmt: skip
def test_tmem_columns_cover_every_accumulator(shape, split, sets1, alloc):
    p = plan(**shape)
    assert (p.split, p.sets1, p.tmem_alloc) == (split, sets1, alloc)
    assert p.cluster == 2 * p.inter // 128 * split <= 16 and p.nk1 % split == 0
    # GEMM1: sets1 accumulators of COLUMNS columns (one per K block of the
    # part); GEMM2: one COLUMNS group per row tile; the two CTAs of an SM
    # share TMEM's columns.
    assert mega.COLUMNS * (p.sets1 + p.tiles2) <= p.tmem_alloc
    assert p.sets1 * mega.COLUMNS >= p.blocks1 > (p.sets1 - 1) * mega.COLUMNS
    assert p.tmem_alloc & (p.tmem_alloc - 1) == 0
    assert tc.TMEM_MIN_COLUMNS <= p.tmem_alloc <= tc.TMEM_MAX_COLUMNS // p.ctas_per_sm
    # Four epilogue warps cover the 128 TMEM lanes once each.
    quadrants = sorted(w % 4 for w in range(mega.EPILOGUE, mega.THREADS // 32))
    assert quadrants == [0, 1, 2, 3]
    assert (mega.THREADS - 32 * mega.EPILOGUE) == mgc.GROUP_THREADS >= 8 * p.cluster


#: A shard whose hidden/128 (29, odd) K cannot split: its cluster is the 2
#: CTAs of inter 128, each with 15 GEMM2 row tiles' accumulators.
ALONE = {"hidden": 3712, "inter": 128, "experts": 256, "top_k": 8}


@pytest.mark.parametrize("tokens", [1, 4])
def test_accumulators_past_half_the_tmem_run_alone_on_their_sm(tokens):
    """2 GEMM1 and 15 GEMM2 accumulators of 16 columns (272) exceed the 256
    columns of one of 2 CTAs per SM: the variant takes 1 CTA per SM, all 512
    columns, and a ring deep enough that a second CTA cannot fit the SM's
    shared memory (it would wait on the first's columns); any shape the two
    CTAs' halves hold keeps 2 CTAs per SM."""
    for sms in (0, 148):
        p = plan(tokens=tokens, **ALONE, sms=sms) if sms else plan(tokens=tokens, **ALONE)
        assert (p.split, p.cluster, p.sets1, p.tiles2) == (1, 2, 2, 15)
        assert p.alone and p.ctas_per_sm == 1 and p.tmem_alloc == 512
        assert mp.MIN_STAGES < p.stages <= mp.ARCH["sm_100a"].alone_ring
        assert 2 * (p.smem + SMEM_PER_CTA_RESERVED) > SMEM_PER_SM
        assert p.smem <= SMEM_LIMIT["sm_100a"]
    even = plan(**{**ALONE, "hidden": 3456})  # 27 K blocks: 2 + 14 sets, 256 columns
    assert not even.alone and even.ctas_per_sm == 2 and even.tmem_alloc == 256
    # Past even one SM's columns the shape is refused, saying why.
    why = mp.problems("sm_100a", **{**ALONE, "hidden": 7296})  # 57 K blocks: 4 + 29 sets
    assert why == ["4 GEMM1 and 29 GEMM2 accumulators of 16 TMEM columns exceed the 512 "
                   "columns of one of 1 CTAs per SM"]  # fmt: skip
    assert not mp.problems("sm_90a", **{**ALONE, "hidden": 7296})


def test_only_four_sm100a_mega_shapes_of_the_stated_range_are_refused():
    """configs/README.md states hidden any multiple of 128 in 1024..8192 and
    inter any up to 1024; sm_100a's mega kernel refuses only hidden/128 of
    57, 59, 61 and 63 at inter 128 (TMEM), at any M and top_k."""
    refused = {
        (h // 128, i)
        for h in range(1024, 8193, 128)
        for i in range(128, 1025, 128)
        for tokens in (1, 4)
        for experts, top_k in ((256, 8), (64, 1))
        if mp.problems("sm_100a", h, i, experts, top_k, tokens)
    }
    assert refused == {(57, 128), (59, 128), (61, 128), (63, 128)}


def test_the_shapes_that_run_alone_are_the_ones_configs_readme_lists():
    """Accumulators past 256 columns (1 CTA per SM): at inter 128 hidden/128
    odd in 29..55 (no K split) and 58, 62 (2 parts: 15 and 16 GEMM2 tiles),
    at inter 256 odd in 49..63; every other accepted shape runs 2 CTAs per SM."""
    alone = {
        (h // 128, i)
        for h in range(1024, 8193, 128)
        for i in range(128, 1025, 128)
        if not mp.problems("sm_100a", h, i, 256, 8, 1) and plan(hidden=h, inter=i).alone
    }
    assert alone == ({(n, 128) for n in range(29, 56, 2)} | {(58, 128), (62, 128)}
                     | {(n, 256) for n in range(49, 64, 2)})  # fmt: skip


def test_instruction_descriptor():
    # The value the DSL's own builder gives for M=128, N=32: prims.Tcgen05InstrDesc.build(
    # c_dtype=Float32, a_dtype=F8E4M3FN, b_dtype=F8E4M3FN, n_dim=32, m_dim=128), i.e.
    # (1 << 4) | ((N >> 3) << 17) | ((M >> 4) << 24).
    assert tc.instruction_desc_e4m3(128, 32) == 0x08080010
    d = mega.IDESC
    assert (d >> 4) & 3 == 1  # F32 accumulator
    assert (d >> 7) & 7 == 0 and (d >> 10) & 7 == 0  # E4M3 x E4M3
    assert (d >> 15) & 3 == 0  # both K-major
    assert ((d >> 17) & 0x3F) << 3 == mega.COLUMNS
    assert ((d >> 24) & 0x1F) << 4 == 128
    with pytest.raises(ValueError):
        tc.instruction_desc_e4m3(128, 8)  # M=128 needs N % 16 == 0
    with pytest.raises(ValueError):
        tc.instruction_desc_e4m3(256, 16)  # cta_group::2 only


def test_smem_descriptor_constant_bits():
    bits = tc.SW128_K_DESC_BITS
    assert (bits >> 16) & 0x3FFF == 1  # leading byte offset 16 B
    assert (bits >> 32) & 0x3FFF == 1024 >> 4  # stride byte offset: 8 rows x 128 B
    assert (bits >> 46) & 7 == 1  # sm_100 descriptor version
    assert bits >> 61 == 2  # 128-byte swizzle
    assert bits & 0x3FFF == 0  # the start address field is left free


def test_spec_mismatch_is_refused():
    from kernels.spec import KernelSpec

    spec = KernelSpec("grouped", "sm_100a", 4096, 512, 288, 8, 2.5, 10.0, False, 8,
                      "float32", False, 148)  # fmt: skip
    with pytest.raises(ValueError, match="builds mega/sm_100a"):
        mega.compile_kernel(spec)
    with pytest.raises(ValueError, match="cannot serve"):
        mega.compile_kernel(KernelSpec("mega", "sm_100a", 4096, 1152, 288, 8, 2.5, 10.0, False, 1,
                                       "float32", False, 148))  # fmt: skip


def test_params_follow_the_contract():
    assert set(mgc.PARAMS) <= set(PARAMETER_NAMES)
    assert set(mgc.ROUTED_PARAMS) <= set(mgc.PARAMS)
    assert mgc.MAPS == ("w13", "w2", "s13", "s2") and mgc.ROUTED_MAPS == ("w13", "w2")
    assert mgc.abi(plan()) == (mgc.PARAMS, mgc.MAPS)
    assert mgc.abi(plan(shared=0)) == (mgc.ROUTED_PARAMS, mgc.ROUTED_MAPS)


# -- compiled for sm_100a ----------------------------------------------------------------


@pytest.mark.compile
def test_every_glm5_mega_bucket_builds_for_sm100a(tmp_path):
    tool = cuobjdump()
    records = compile_specs("sm_100a", glm5_specs("sm_100a", "mega"), tmp_path)
    assert sorted((r["tokens"], r["name"].split("-")[-1]) for r in records) == [
        (m, dtype) for m in (1, 2, 3, 4) for dtype in ("bfloat16", "float32")
    ]
    for r in records:
        cubin = tmp_path / (r["name"] + ".cubin")
        ops, res = sass_counts(tool, cubin), resources(tool, cubin)
        # No global load on any path before the PDL wait (inputs may come
        # from the previous grid).
        assert loads_before_pdl_wait(tool, cubin) == [], r["name"]
        print(f"{r['name']}: {r['seconds']} s, REG {res['REG']}, smem {r['smem']}, "
              f"UTCQMMA {count(ops, 'UTCQMMA')}, UTMALDG {count(ops, 'UTMALDG')}, "
              f"LDTM {count(ops, 'LDTM')}, STAS {count(ops, 'STAS')}")  # fmt: skip
        # Two UMMA sites (GEMM1, GEMM2) of four K32 FP8 UMMAs each, four
        # commits (two stage releases, acc1, acc2), two TMA sites, three TMEM
        # loads (GEMM1 16 columns, GEMM2 4 columns twice unrolled: the x4 load
        # sits in a 2-trip constexpr loop), the DSMEM sends.
        assert count(ops, "UTCQMMA") == 8, ops
        assert count(ops, "UTCBAR") == 4, ops
        assert count(ops, "UTMALDG") == 2 and "UTMALDG.3D" in ops, ops
        assert ops.get("LDTM.x16", 0) == 1 and ops.get("LDTM.x4", 0) == 2, ops
        assert count(ops, "STAS") >= 3 and "STAS.128" in ops, ops
        assert "UTCATOMSWS.FIND_AND_SET.ALIGN" in ops and "UTCATOMSWS.AND" in ops, ops
        assert "LDL" not in ops and "STL" not in ops, ops
        assert res["LOCAL"] == 0 and res["STACK"] == 0, res
        # Two CTAs per SM: registers and shared memory for both.
        assert res["REG"] * mega.THREADS * plan().ctas_per_sm <= REGISTERS_PER_SM, res
        assert r["smem"] + res["SHARED"] <= SMEM_OPTIN["sm_100a"]
        assert 2 * (r["smem"] + res["SHARED"]) <= SMEM_PER_SM
        assert r["smem"] <= SMEM_LIMIT["sm_100a"]
        # Launch shape and ABI: a cluster per route and per token's shared
        # expert, with the shared expert's maps and scales.
        clusters = r["tokens"] * (r["top_k"] + 1)
        assert r["entry"] == "moe_mega_sm100_0"
        assert r["grid"] == [16 * clusters, 1, 1] and r["cluster"] == [16, 1, 1]
        assert r["block"] == [192, 1, 1] and r["pdl"] is True
        assert r["params"] == [[name, "pointer"] for name in mgc.PARAMS]
        assert "shared_out" in mgc.PARAMS and "s13_scale" in mgc.PARAMS
        assert r["maps"] == ["w13", "w2", "s13", "s2"]
        # The finalize's arrival counts: one word per (token, CTA rank).
        assert r["workspace"] == [["arrivals", 4 * r["tokens"] * 16, True]]
        assert r["smem"] == plan(r["tokens"]).smem
        assert r["notes"]["shared_routes"] == r["tokens"]
        assert r["notes"]["smem_limit"] == SMEM_LIMIT["sm_100a"]


@pytest.mark.compile
def test_a_variant_alone_on_its_sm_builds_for_sm100a(tmp_path):
    """``ALONE`` at M = 1: 1 CTA per SM (the launch bound), all 512 TMEM
    columns, a ring that keeps a second CTA off the SM; the same instruction
    shape as the two-CTA variants, no local memory."""
    from kernels.spec import KernelSpec

    tool = cuobjdump()
    spec = dataclasses.replace(glm5_specs("sm_100a", "mega", ["mega-sm_100a-m1-float32"])[0][1],
                               **ALONE)  # fmt: skip
    (r,) = compile_specs("sm_100a", [("alone", spec)], tmp_path)
    assert isinstance(spec, KernelSpec) and r["notes"]["tmem_columns"] == 512
    assert r["notes"]["ctas_per_sm"] == 1 and r["cluster"] == [2, 1, 1]
    cubin = tmp_path / "alone.cubin"
    ops, res = sass_counts(tool, cubin), resources(tool, cubin)
    assert loads_before_pdl_wait(tool, cubin) == []
    assert count(ops, "UTCQMMA") == 8 and count(ops, "UTMALDG") == 2, ops
    assert "LDL" not in ops and "STL" not in ops and res["LOCAL"] == 0, (ops, res)
    assert r["smem"] == plan(**ALONE).smem
    assert 2 * (r["smem"] + res["SHARED"]) > SMEM_PER_SM
    assert r["smem"] + res["SHARED"] <= SMEM_OPTIN["sm_100a"]
