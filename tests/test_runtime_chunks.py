"""runtime.chunks on the CPU: the chunk plan for every M up to 8192 against
an independent enumeration, and ``run_chunked`` through the real
``runtime.moe.MoELayer`` (its dispatch, padding and combine) with the kernel
launch replaced by a stand-in writing exact per-token functions of its
inputs, so every row of a chunked output can be predicted from the caller's
rows (the GPU tests run the real cubins: tests/gpu/test_serving.py)."""

from __future__ import annotations

import math

import pytest
import runtime_fixtures as fx
import seeding
import torch
from layer_fakes import FakeArtifact, TaggedLayer, tags, variant

import runtime.chunks as chunks
from runtime.chunks import chunk_plan, run_chunked
from runtime.errors import InputError
from runtime.inputs import check_weights
from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.plan import Step, bucket_for

SHAPE = MoEShape(**fx.SMALL_MODEL)
CPU = torch.device("cpu")
#: glm5.yaml's buckets up to 64 (its 96 and 128 left out, so that M above 64 chunks).
GLM5_BUCKETS = (1, 2, 3, 4, 8, 16, 32, 48, 64)


# The plan -----------------------------------------------------------------------------


def _greedy(m: int, largest: int) -> list[tuple[int, int]]:
    """The plan's definition, enumerated another way: take the largest
    bucket's rows while they fit, then whatever is left."""
    pieces, start = [], 0
    while start < m:
        rows = largest if m - start >= largest else m - start
        pieces.append((start, rows))
        start += rows
    return pieces


@pytest.mark.parametrize(
    "buckets, top",
    [(GLM5_BUCKETS, 8192), ((8, 16, 32, 48, 64), 8192), ((48,), 8192), ((64, 1, 3, 64, 2), 2048),
     ((1, 2, 3, 4), 1200), ((5, 7), 600), ((1,), 300)],
)  # fmt: skip
def test_plan_covers_every_row_once_in_order(buckets, top):
    """For every M in 1..top: one piece up to the largest bucket B; above it
    ceil(M / B) pieces, contiguous from row 0 to M in order, each of B rows
    but possibly the last (at most one partial piece), each served by a
    bucket; equal to the greedy enumeration."""
    largest = max(buckets)
    for m in range(1, top + 1):
        plan = chunk_plan(m, buckets)
        assert plan == _greedy(m, largest), m
        if m <= largest:
            assert plan == [(0, m)]
            continue
        assert len(plan) == math.ceil(m / largest)
        assert plan[0][0] == 0 and plan[-1][0] + plan[-1][1] == m
        assert all(s + r == t for (s, r), (t, _) in zip(plan, plan[1:], strict=False))
        partial = [i for i, (_, r) in enumerate(plan) if r != largest]
        assert partial in ([], [len(plan) - 1]), m
        assert all(1 <= r <= largest and bucket_for(r, buckets) is not None for _, r in plan)


def test_plan_is_pure_and_refuses_nonsense():
    assert chunk_plan(130, GLM5_BUCKETS) == [(0, 64), (64, 64), (128, 2)]
    assert chunk_plan(130, reversed(GLM5_BUCKETS)) == chunk_plan(130, list(GLM5_BUCKETS))
    assert chunk_plan(64, GLM5_BUCKETS) == [(0, 64)] and chunk_plan(65, GLM5_BUCKETS)[-1] == (64, 1)
    for m in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match="m: expected a token count >= 1"):
            chunk_plan(m, GLM5_BUCKETS)
    for buckets in ((), (0, 8), (-1,), (8.0,)):
        with pytest.raises(ValueError, match="buckets: expected positive token counts"):
            chunk_plan(5, buckets)


# run_chunked through MoELayer ------------------------------------------------------------


def _variants(final: bool = True) -> list:
    """The glm5 artifact's variants up to 64 tokens (its 96 and 128 buckets
    left out, so that M = 65..300 chunks here): mega 1..4 (with the shared expert;
    writing ``final`` unless ``final`` is False), grouped 8..64 with and
    without in-kernel finalize, both logits dtypes."""
    mega = [variant("mega", m, d, final=final) for m in (1, 2, 3, 4) for d in DTYPES]
    grouped = [variant("grouped", m, d, f) for m in (8, 16, 32, 48, 64) for d in DTYPES
               for f in (False, True)]  # fmt: skip
    return mega + grouped


DTYPES = ("float32", "bfloat16")
VARIANTS = _variants()


@pytest.fixture(scope="module")
def weights():
    return random_moe_weights(SHAPE, seeding.generator(f"{__name__}.weights"))[0]


def _layer(weights, variants=VARIANTS, **kwargs):
    tensors = check_weights(weights, SHAPE, CPU)
    return TaggedLayer(FakeArtifact(variants), tensors, SHAPE, CPU, **kwargs)


def _inputs(m, dtype=torch.float32):
    g = seeding.generator(f"{seeding.current_test()}:{m}")
    x = torch.randn(m, SHAPE.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(m, SHAPE.experts, generator=g).to(dtype)
    return x, logits, torch.randn(SHAPE.experts, generator=g) * 0.1


@pytest.mark.parametrize("m", [1, 4, 5, 63, 64, 65, 100, 128, 129, 200, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("final", [True, False], ids=["mega-final", "mega-combine"])
def test_run_chunked_equals_the_per_token_outputs(weights, m, dtype, final):
    """Every row of the chunked output is its token's own output; the layer
    launches once per piece of the plan, on that piece's rows: the full
    pieces by ``launch_rows`` into their rows of the output, the partial
    last one so too where a variant that writes ``final`` serves its rows
    directly (grouped with finalize, which takes ``valid``, at any rows; mega
    writing it at its own bucket), else a layer call (padded to its bucket
    with copies of the piece's last row). Mega variants writing ``final``
    and ones whose rows the layer combines."""
    layer = _layer(weights, variants=_variants(final), poison=True)
    x, logits, bias = _inputs(m, dtype)
    got = run_chunked(layer, x, logits, bias)
    assert got.shape == (m, SHAPE.hidden) and got.dtype == torch.bfloat16
    assert torch.equal(got, tags(x, logits, SHAPE.top_k)["final"]), seeding.rerun_hint()
    plan = chunk_plan(m, GLM5_BUCKETS)
    name = dtype_name(dtype)
    # The full pieces (above 64 rows) go straight into their rows, one host path.
    full = [start for start, rows in plan if rows == 64 and m > 64]
    want = [(f"grouped-sm_90a-m64-{name}-final", full)] if full else []
    rest = [(start, rows) for start, rows in plan if not (rows == 64 and m > 64)]
    if m > 64 and rest and (rest[0][1] > 4 or final):
        ((start, rows),) = rest
        kernel = "mega" if rows <= 4 else "grouped"
        suffix = "" if kernel == "mega" else "-final"
        bucket = bucket_for(rows, GLM5_BUCKETS)
        want.append((f"{kernel}-sm_90a-m{bucket}-{name}{suffix}", [start]))
    assert layer.direct == want
    assert len(layer.calls) == len(plan)  # every launch, direct or not
    for (name, padded, _), (start, rows) in zip(layer.calls, plan, strict=True):
        bucket = bucket_for(rows, GLM5_BUCKETS)
        assert padded.shape[0] == bucket and f"-m{bucket}-" in name
        assert torch.equal(padded[:rows], x[start : start + rows])
        assert torch.equal(
            padded[rows:], x[start + rows - 1 : start + rows].expand(bucket - rows, -1)
        )


def test_full_pieces_without_a_final_writer_take_the_layer_call(weights):
    """With no grouped variant that finalizes, a 64-row piece cannot go
    straight into ``out``: every piece is a layer call (the layer sums the
    routes), and the rows are still each token's own."""
    plain = [v for v in VARIANTS if not (v.kernel == "grouped" and v.finalize)]
    layer = _layer(weights, variants=plain)
    x, logits, bias = _inputs(150)
    got = run_chunked(layer, x, logits, bias)
    assert torch.equal(got, tags(x, logits, SHAPE.top_k)["final"])
    assert layer.direct == [] and len(layer.calls) == 3


def dtype_name(dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]


def test_out_buffer_and_poison(weights, monkeypatch):
    """``out`` receives the result (and is returned); with a poisoned layer
    it is NaN-filled first, so rows no chunk wrote show as NaN."""
    layer = _layer(weights, poison=True)
    x, logits, bias = _inputs(150)
    out = torch.zeros(150, SHAPE.hidden, dtype=torch.bfloat16)
    assert run_chunked(layer, x, logits, bias, out=out) is out
    assert torch.equal(out, tags(x, logits, SHAPE.top_k)["final"])
    small = torch.zeros(3, SHAPE.hidden, dtype=torch.bfloat16)
    assert run_chunked(layer, x[:3], logits[:3], bias, out=small) is small
    assert torch.equal(small, tags(x[:3], logits[:3], SHAPE.top_k)["final"])
    for bad in (torch.zeros(150, SHAPE.hidden), torch.zeros(149, SHAPE.hidden).bfloat16(),
                torch.zeros(SHAPE.hidden, 150).bfloat16().t()):  # fmt: skip
        with pytest.raises(
            InputError, match=r"out: expected a contiguous torch.bfloat16 \[150, 256\]"
        ):
            run_chunked(layer, x, logits, bias, out=bad)
    monkeypatch.setattr(chunks, "_pieces", lambda m, largest: [(0, 64), (64, 64)])  # drops 128..149
    got = run_chunked(layer, x, logits, bias)
    assert got[128:].isnan().all() and not got[:128].isnan().any()


def test_table_with_holes_is_padded_to_a_served_m(weights):
    """A custom table serving only M = 1, 2, 8: a remainder of 5 runs as 8
    rows (copies of its last token) and only its 5 rows come back."""
    steps = {m: Step("grouped", 8, True) for m in (1, 2, 8)}
    layer = _layer(weights, table={"float32": steps, "bfloat16": {}})
    x, logits, bias = _inputs(13)
    got = run_chunked(layer, x, logits, bias)
    assert torch.equal(got, tags(x, logits, SHAPE.top_k)["final"])
    assert [c[1].shape[0] for c in layer.calls] == [8, 8]
    assert torch.equal(layer.calls[1][1][5:], x[12:].expand(3, -1))


def test_bad_inputs_are_refused_for_any_m(weights):
    layer = _layer(weights)
    x, logits, bias = _inputs(100)
    empty = run_chunked(layer, x[:0], logits[:0], bias)  # an empty batch: no call
    assert empty.shape == (0, 256) and empty.dtype == torch.bfloat16 and layer.calls == []
    out = torch.empty(0, 256, dtype=torch.bfloat16)
    assert run_chunked(layer, x[:0], logits[:0], bias, out=out) is out
    with pytest.raises(InputError, match=r"logits: expected shape \[0, 32\], found \[1, 32\]"):
        run_chunked(layer, x[:0], logits[:1], bias)
    with pytest.raises(InputError, match=r"x: expected a \[M, 256\] tensor, found \[25600\]"):
        run_chunked(layer, x.view(-1), logits, bias)
    with pytest.raises(InputError, match=r"logits: expected shape \[100, 32\], found \[99, 32\]"):
        run_chunked(layer, x, logits[:99], bias)
    with pytest.raises(InputError, match="bias: expected dtype torch.float32"):
        run_chunked(layer, x, logits, bias.double())
    with pytest.raises(InputError, match="x: expected a contiguous tensor"):
        run_chunked(layer, x.t().contiguous().t(), logits, bias)
    only_f32 = _layer(weights, variants=[v for v in VARIANTS if v.logits_dtype == "float32"])
    with pytest.raises(
        InputError, match="logits: expected dtype torch.float32, found torch.bfloat16"
    ):
        run_chunked(only_f32, x, logits.bfloat16(), bias)


def test_chunks_whose_logits_rows_are_not_16_byte_aligned_still_run():
    """Odd E with BF16 logits makes a row of logits 2E bytes, so a chunk of a
    largest bucket that is not a multiple of 8 starts off the 16-byte
    alignment the layer's checks ask for (here E = 33, chunks of 3 rows:
    offsets of 198 bytes). Such a piece is a layer call on aligned copies of
    its rows; every row is still its token's own output."""
    shape = MoEShape(**{**fx.SMALL_MODEL, "experts": 33})
    w = random_moe_weights(shape, seeding.generator(f"{__name__}.odd"))[0]
    steps = {m: Step("grouped", 8, False) for m in (1, 2, 3)}
    plain = [v for v in VARIANTS if not (v.kernel == "grouped" and v.finalize)]
    layer = TaggedLayer(FakeArtifact(plain), check_weights(w, shape, CPU), shape, CPU,
                        table={"float32": {}, "bfloat16": steps})  # fmt: skip
    g = seeding.generator(seeding.current_test())
    x = torch.randn(7, shape.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(7, shape.experts, generator=g).to(torch.bfloat16)
    bias = torch.randn(shape.experts, generator=g) * 0.1
    assert logits[3:].data_ptr() % 16 != 0  # the case: an unaligned chunk start
    got = run_chunked(layer, x, logits, bias)
    assert torch.equal(got, tags(x, logits, shape.top_k)["final"]), seeding.rerun_hint()
    assert len(layer.calls) == 3
