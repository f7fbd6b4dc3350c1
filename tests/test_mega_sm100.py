"""The sm_100a mega kernel: host formulas (no compiler) and, marked
``compile``, every glm5 mega bucket built for sm_100a and its SASS read back.

There is no Blackwell GPU here: these tests show the kernel builds into the
instructions the seed's design needs (tcgen05 FP8 UMMA, TMA, TMEM loads,
DSMEM stores), within the launch's resources; they cannot show it computes
the right numbers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sass_tools import compile_specs, count, cuobjdump, glm5_specs, resources, sass_counts

pytest.importorskip("cutlass")  # the kernel module is device code

from kernels import mega_moe_sm100 as mega  # noqa: E402
from kernels.grouped_plan import SMEM_LIMIT, SMEM_OPTIN  # noqa: E402
from kernels.ptx import tcgen05 as tc  # noqa: E402
from kernels.spec import PARAMETER_NAMES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GLM5 = {"hidden": 4096, "inter": 512, "experts": 288, "top_k": 8}
#: Shared memory of one SM on B200 (228 KiB) and the 1 KiB the system reserves
#: per CTA; two mega CTAs must fit (``min_blocks_per_mp=2``).
SMEM_PER_SM, SMEM_PER_CTA_RESERVED = 233472, 1024
REGISTERS_PER_SM = 65536


def layout(tokens: int = 1, **shape) -> mega.MegaLayout:
    return mega.MegaLayout(**{**GLM5, **shape}, tokens=tokens)


# -- host formulas ---------------------------------------------------------------------------


def test_layout_closed_forms():
    lay = layout()
    assert (lay.nk1, lay.nk2, lay.tiles1, lay.blocks1) == (32, 4, 8, 16)
    assert (lay.rows2, lay.tiles2) == (256, 2)
    # Stages: one K half of GEMM1 (H / 256 boxes), then 2 row tiles x I/128.
    assert lay.loads == 4096 // 256 + (4096 // 16 // 128) * (512 // 128) == 24
    assert lay.off_b1 == mega.STAGES * 128 * 128
    assert lay.off_b2 == lay.off_b1 + 16 * 16 * 128
    assert lay.off_partial == lay.off_b2 + 4 * 16 * 128
    assert lay.bars == 2 * mega.STAGES + 2 + 2 + 4
    assert lay.smem == (
        mega.STAGES * 16384 + 20 * 2048 + 128 * 4 * 2 + 128 + 16 + 16 + 16 * 4 + lay.bars * 8 + 16
    )
    assert lay.routes == 8 and layout(tokens=4).routes == 32


def test_cluster_streams_each_weight_box_of_the_expert_once():
    lay, expert = layout(), 5
    boxes = [lay.stage_box(rank, n, expert) for rank in range(mega.CLUSTER)
             for n in range(lay.loads)]  # fmt: skip
    assert len(boxes) == len(set(boxes))
    w13 = {(row, block) for m, row, block in boxes if m == 0}
    w2 = {(row, block) for m, row, block in boxes if m == 1}
    # w13 [E, H/128, 2I, 128]: every row tile of every K block of the expert.
    assert w13 == {(t * 128, expert * lay.nk1 + kb) for t in range(lay.tiles1)
                   for kb in range(lay.nk1)}  # fmt: skip
    # w2 [E, I/128, H, 128]: every 128-row tile of H of every hidden block.
    assert w2 == {(t * 128, expert * lay.nk2 + kb) for t in range(4096 // 128)
                  for kb in range(lay.nk2)}  # fmt: skip
    # A CTA's GEMM1 stages are its row tile's K half, in K order (stage n is
    # B tile n, accumulator column n).
    for rank in range(mega.CLUSTER):
        first = [lay.stage_box(rank, n, expert) for n in range(lay.blocks1)]
        assert first == [(0, rank // 2 * 128, expert * 32 + rank % 2 * 16 + n)
                         for n in range(16)]  # fmt: skip


def test_dsmem_bytes_match_the_expected_transactions():
    lay = layout()
    epilogue_threads = mega.THREADS - 32 * mega.EPILOGUE
    # One epilogue thread per TMEM lane (weight row): K half 1 sends its 128
    # row sums to half 0 (``pair``, TILE * 4 bytes); each gate tile its 128
    # gate values to its up tile (``gate_recv``, TILE * 4 bytes).
    assert epilogue_threads == 128
    # Every up tile sends each CTA its FP8 hidden block (one 16-byte chunk per
    # thread: 128 threads = 16 CTAs x 8 chunks) and one scale: ``hrecv``
    # expects nk2 * (TILE + 4) bytes.
    assert epilogue_threads == mega.CLUSTER * 8
    assert lay.nk2 * (epilogue_threads // mega.CLUSTER * 16 + 4) == lay.nk2 * (128 + 4)
    # The hidden blocks fill row kb of GEMM2 B tile kb: tiles of up CTAs
    # 0, 2, 4, 6 (tile = rank // 2 < nk2, half 0).
    ups = [rank // 2 for rank in range(mega.CLUSTER) if rank % 2 == 0 and rank // 2 < lay.nk2]
    assert ups == list(range(lay.nk2))
    gates = [rank // 2 for rank in range(mega.CLUSTER) if rank % 2 == 0 and rank // 2 >= lay.nk2]
    assert [2 * (t - lay.nk2) for t in gates] == [2 * u for u in ups]


def test_layout_alignment_and_disjoint_regions():
    lay = layout()
    regions = lay.regions()
    assert regions[0] == ("stages", 0, mega.STAGES * mega.STAGE_BYTES)
    for (_, start, size), (_, nxt, _) in zip(regions, regions[1:], strict=False):
        assert size > 0 and start + size == nxt
    assert regions[-1][1] + regions[-1][2] == lay.smem
    offsets = dict((name, start) for name, start, _ in regions)
    # UMMA operands: 128B-swizzle atoms are 1024-byte aligned (every stage,
    # every B tile: B_BYTES is a multiple of 1024).
    for name in ("stages", "b1", "b2"):
        assert offsets[name] % 1024 == 0
    assert mega.STAGE_BYTES % 1024 == 0 and mega.B_BYTES % 1024 == 0
    assert offsets["stage"] % 16 == 0  # 16-byte st.async sources
    assert offsets["bar"] % 8 == 0
    assert offsets["hscale"] % 4 == 0 and offsets["tmem"] % 4 == 0


def test_layout_fits_two_ctas_per_sm():
    lay = layout()
    assert lay.smem <= SMEM_LIMIT["sm_100a"] <= SMEM_OPTIN["sm_100a"]
    assert 2 * (lay.smem + SMEM_PER_CTA_RESERVED) <= SMEM_PER_SM
    assert layout(tokens=4).smem == lay.smem  # independent of the bucket


def test_tmem_columns_cover_every_accumulator():
    lay = layout()
    # GEMM1: COLUMNS columns; GEMM2: one COLUMNS group per row tile.
    assert mega.COLUMNS * (1 + lay.tiles2) <= mega.TMEM_COLUMNS
    assert mega.TMEM_COLUMNS & (mega.TMEM_COLUMNS - 1) == 0
    assert tc.TMEM_MIN_COLUMNS <= mega.TMEM_COLUMNS <= tc.TMEM_MAX_COLUMNS
    # Four epilogue warps cover the 128 TMEM lanes once each.
    quadrants = sorted(w % 4 for w in range(mega.EPILOGUE, mega.THREADS // 32))
    assert quadrants == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ({"inter": 1024}, "2 * inter"),
        ({"hidden": 2048}, "hidden / 128 / 2"),
        ({"experts": 100}, "multiple of 32"),
        ({"top_k": 33}, "top_k"),
    ],
)
def test_layout_refuses_shapes_the_cluster_split_cannot_serve(shape, words):
    problems = layout(**shape).problems()
    assert problems and any(words in p for p in problems), problems
    assert layout().problems() == []


def test_instruction_descriptor():
    # The value the DSL's own builder gives for M=128, N=32 (cute-dsl-notes 6).
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
        mega.layout_of(KernelSpec("mega", "sm_100a", 4096, 1024, 288, 8, 2.5, 10.0, False, 1,
                                  "float32", False, 148))  # fmt: skip


def test_params_follow_the_contract():
    assert set(mega.PARAMS) <= set(PARAMETER_NAMES)
    assert mega.PARAMS == (
        "maps", "w13_scale", "w2_scale", "x", "logits", "bias", "rows1", "rows2", "out",
        "ids", "weights",
    )  # fmt: skip
    assert mega.TENSOR_MAPS == ("w13", "w2")


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
        assert res["REG"] * mega.THREADS * mega.MIN_BLOCKS <= REGISTERS_PER_SM, res
        assert r["smem"] + res["SHARED"] <= SMEM_OPTIN["sm_100a"]
        assert 2 * (r["smem"] + res["SHARED"]) <= SMEM_PER_SM
        assert r["smem"] <= SMEM_LIMIT["sm_100a"]
        # Launch shape and ABI.
        routes = r["tokens"] * r["top_k"]
        assert r["entry"] == "moe_mega_sm100_0"
        assert r["grid"] == [16 * routes, 1, 1] and r["cluster"] == [16, 1, 1]
        assert r["block"] == [192, 1, 1] and r["pdl"] is True
        assert r["params"] == [[name, "pointer"] for name in mega.PARAMS]
        assert r["maps"] == ["w13", "w2"] and r["workspace"] == []
        assert r["smem"] == layout(r["tokens"]).smem
        assert r["notes"]["smem_limit"] == SMEM_LIMIT["sm_100a"]
