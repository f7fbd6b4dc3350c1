"""Every model's artifact on the GPU, through the runtime, against the float64
``runtime.reference`` of that model's routing family (docs/models.md).

Artifacts under test: ``$MOE_MODEL_ARTIFACTS`` (paths joined by
``os.pathsep``; each an artifact directory or ``.tar.zst``, or a directory of
them, one per config, as ``make build-all`` leaves artifacts/), else
``$MOE_BUILD_ARTIFACT`` (tests/gpu_artifacts.py: ``model_artifacts``).
tests/gpu/models.sh runs this file over a directory of artifacts. Skips
without a GPU, without an artifact, or for an artifact without a variant for
this device's arch.

Per artifact, random weights of its model's shape (with the shared expert
where the model has one); per logits dtype the artifact serves, routing
"random" and "skewed" (the benchmark's inputs, ``benchmarks.bench.
routing_inputs``: the bias skewed, or the logits for a model without a bias,
whose calls pass bias None) and each M of ``TOKENS``, ``calls(M)`` calls on
fresh inputs (tests/seeding.py), outputs NaN-poisoned before every launch:

* each kernel entry that serves M (``layer.mega`` up to its largest bucket,
  ``layer.grouped`` padded to its bucket): ids exactly the reference's
  except on near-tie tokens (``tie_margins`` below ``TIE``: a kernel's score
  function is a few ulp off torch's; BF16 logits of a model without a bias
  tie exactly often), which are counted apart; weights relative 1e-5
  against the reference's weights of the kernel's ids; routed rows (and the
  shared expert's rows, for a model with one) against the reference on the
  kernel's ids;
* the layer, ``layer(x, logits, bias)``, against the reference's final
  output on the expert choice of the kernel the layer dispatches M to (its
  entry routes the same inputs with the same code), so every token is
  compared; where that entry is not compiled, on the reference's own
  choice with near-tie tokens left out.

Tolerance, as the kernels' GPU tests (tests/test_mega_sm90_gpu.py,
tests/test_grouped_sm90_gpu.py) and ``moe-build bench`` hold the layer:
relative L2 error at most ``TOL`` pooled over a case's calls (the rows of
all calls concatenated) and ``CALL_TOL`` for any single call (one call at
M = 1 has one row, and one hidden FP8 code flipped by accumulation order
moves a whole row). One line per case is printed (run with ``-s`` to log
it): model, dtype, routing, M, calls, the layer's pooled and worst-call
relative L2, max-abs error, near ties, and each kernel entry's figures.
"""

from __future__ import annotations

import os

import pytest
import seeding
from gpu_artifacts import CALL_TOL, TIE, artifact_name, final_bound, model_artifacts

from benchmarks.bench import (
    TOLERANCE,
    check_calls,
    error_sums,
    pool_errors,
    routing_inputs,
    tie_margins,
)

pytestmark = pytest.mark.gpu

#: M of the cases: every mega bucket (1..4, and the grouped kernel padded to
#: 8), M between buckets (5, 13, 33, 100, 129, 200, 300: padded) and grouped
#: buckets (8, 16, 64, 128, 256, 448, 512: Kimi-K2 TP8 runs 512 as chunks of
#: 448 and 64). ``$MOE_MODEL_TOKENS`` (comma-separated) runs other M instead, to
#: split a long run; an M above an artifact's largest bucket runs the layer
#: in chunks (no kernel entry serves it).
TOKENS = tuple(
    int(m)
    for m in os.environ.get(
        "MOE_MODEL_TOKENS", "1,2,3,4,5,8,13,16,33,64,100,128,129,200,256,300,448,512"
    ).split(",")
)
ROUTINGS = ("random", "skewed")
DTYPES = ("float32", "bfloat16")
#: Relative L2 error against the float64 reference, pooled over a case's calls.
TOL = TOLERANCE["layer"]
#: Routing weights: relative error against the reference's (absolute floor).
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-7


def calls(m: int) -> int:
    """Calls of one case: enough for ``benchmarks.bench.CHECK_ROWS`` tokens
    of the layer (the bench's rule, whose comment gives the measurements), at
    least 2."""
    return check_calls(m, least=2)


@pytest.fixture(scope="module", params=model_artifacts() or [None], ids=artifact_name)
def bound(request):
    """(name, artifact, poisoned layer, (prepared, routed, shared) weights) of
    one artifact, loaded for this device; skips where it cannot run."""
    torch = pytest.importorskip("torch")
    path = request.param
    if path is None:
        pytest.skip("set MOE_MODEL_ARTIFACTS (or MOE_BUILD_ARTIFACT)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not path.exists():
        pytest.skip(f"{path} does not exist")
    import runtime
    from runtime.artifact import read
    from runtime.layout import random_moe_weights
    from runtime.loader import arch_of

    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_of(torch.cuda.get_device_capability(device))
    if not read(path).for_arch(arch):
        pytest.skip(f"{path} holds no variant for {arch} (this device)")
    artifact = runtime.load(path, device)
    gen = seeding.generator(f"weights of {artifact_name(path)}", device=device)
    weights = random_moe_weights(artifact.shape, gen)
    layer = artifact.bind(weights[0], poison=True)
    yield artifact.manifest["config"]["name"], artifact, layer, weights
    del layer, weights
    torch.cuda.empty_cache()


def _entries(artifact, dtype: str, m: int) -> list[tuple[str, int]]:
    """(kernel, bucket) of each kernel entry serving M tokens of ``dtype``
    logits without finalize: the smallest bucket >= M of each kernel."""
    out = []
    for kernel in ("mega", "grouped"):
        buckets = [v.tokens for v in artifact.variants if v.kernel == kernel
                   and v.logits_dtype == dtype and not v.finalize and v.tokens >= m]  # fmt: skip
        if buckets:
            out.append((kernel, min(buckets)))
    return out


class _Pool:
    """``error_sums`` of one output part over a case's calls."""

    def __init__(self):
        self.sums = []

    def add(self, got, want) -> None:
        if got.shape[0]:
            self.sums.append(error_sums(got, want))

    def errors(self) -> tuple[float, float, float, float] | None:
        """(pooled rel L2, worst call's rel L2, max abs error, max abs
        reference), None without rows."""
        if not self.sums:
            return None
        import torch

        return pool_errors(torch.stack(self.sums)[:, None, :])


def _verdict(label: str, errors, failures: list[str]) -> str:
    """``errors`` of a part in words; a failure recorded past the bars."""
    if errors is None:
        return f"{label} - (every token a near tie)"
    pooled, worst, max_abs, ref_max = errors
    if not (pooled <= TOL and worst <= CALL_TOL):  # NaN fails too
        failures.append(f"{label}: rel L2 {pooled:.3e} pooled (bar {TOL}), "
                        f"{worst:.3e} worst call (bar {CALL_TOL})")  # fmt: skip
    return f"{label} {pooled:.2e} (worst call {worst:.2e}, max abs {max_abs:.2e} of {ref_max:.2e})"


def _check_entry(layer, kernel, shape, x, logits, bias, ref, close, weights, pools) -> tuple:
    """One call of ``kernel``'s entry: output shapes, no unwritten values,
    ids against the reference's (near ties apart), weights; its rows go to
    ``pools``. Returns (tokens routed otherwise, failures in words, the
    float64 reference on the kernel's ids)."""
    import torch

    from runtime.reference import moe_reference

    if kernel == "mega":
        out, ids, w, shared = layer.mega(x, logits, bias, shared=True)
    else:
        out, ids, w, shared = layer.grouped(x, logits, bias)
    torch.cuda.synchronize()
    m = x.shape[0]
    assert out.shape == (m * shape.top_k, shape.hidden) and ids.shape == w.shape == ref.ids.shape
    assert not out.isnan().any() and not w.isnan().any(), f"{kernel}: unwritten outputs"
    assert bool(((ids >= 0) & (ids < shape.experts)).all()), f"{kernel}: ids {ids.tolist()}"
    failures = []
    same = (ids == ref.ids).all(dim=1)
    wrong = ~same & ~close
    if bool(wrong.any()):
        t = int(wrong.nonzero()[0, 0])
        failures.append(f"ids differ on {int(wrong.sum())} token(s) that are no near tie, e.g. "
                        f"token {t}: {ids[t].tolist()} vs {ref.ids[t].tolist()}")  # fmt: skip
    mine = ref
    if not bool(same.all()):  # compare rows and weights on the kernel's own choice
        mine = moe_reference(x, logits, bias, weights[1], weights[2], shape, torch.float64,
                             ids=ids)  # fmt: skip
    if not torch.allclose(w, mine.weights, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL):
        worst = ((w.double() - mine.weights.double()).abs() / mine.weights.double().abs()).max()
        failures.append(f"weights up to {worst.item():.2e} relative off the reference's")
    pools["out"].add(out, mine.out)
    if shape.shared_experts:  # a routed-only kernel writes no shared rows
        assert shared is not None and not shared.isnan().any(), f"{kernel}: unwritten shared rows"
        pools["shared"].add(shared, mine.shared)
    return int((~same).sum()), failures, mine


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_model_matches_reference(bound, dtype, routing):
    """Every M of ``TOKENS``: the layer and each kernel entry serving M
    against the float64 reference of the model's routing (module docstring);
    every case is printed, then every failure is reported together."""
    import torch

    from runtime.reference import moe_reference

    name, artifact, layer, weights = bound
    if dtype not in layer.dtypes:
        pytest.skip(f"{name} has no {dtype}-logits variant")
    shape = artifact.shape
    gen = seeding.generator(device=layer.device)
    failures = []
    for m in TOKENS:
        where = f"{name} {dtype:8s} {routing:6s} M={m:3d}"
        n = calls(m)
        xs, logits_pool, bias = routing_inputs(routing, m, shape, n, gen, layer.device)
        entries = _entries(artifact, dtype, m)
        final_pool, ties = _Pool(), 0
        pools = {e: {"out": _Pool(), "shared": _Pool()} for e in entries}
        moved = dict.fromkeys(entries, 0)
        case = []  # this case's failures
        for c in range(n):
            x, logits = xs[c], logits_pool[c].to(getattr(torch, dtype))
            ref = moe_reference(x, logits, bias, weights[1], weights[2], shape, torch.float64)
            close = tie_margins(logits, bias, shape) < TIE
            ties += int(close.sum())
            on_ids = {}  # kernel -> the reference on its entry's ids
            for entry in entries:
                kernel = entry[0]
                routed_otherwise, errs, on_ids[kernel] = _check_entry(
                    layer, kernel, shape, x, logits, bias, ref, close, weights, pools[entry]
                )
                moved[entry] += routed_otherwise
                case += [f"{kernel} call {c}: {e}" for e in errs]
            final = layer(x, logits, bias)
            torch.cuda.synchronize()
            assert final.shape == (m, shape.hidden) and final.dtype == torch.bfloat16
            assert not final.isnan().any(), f"{where}: unwritten layer output"
            step = layer.tables[dtype].get(m)  # None: chunks
            want = None if step is None else on_ids.get(step.kernel)
            if want is not None:
                final_pool.add(final, want.final)
            else:
                final_pool.add(final[~close], ref.final[~close])
        line = [f"{where} calls {n:2d}: " + _verdict("layer", final_pool.errors(), case),
                f"near ties {ties}"]  # fmt: skip
        for (kernel, bucket), parts in pools.items():
            label = kernel + (f"(padded to {bucket})" if bucket != m else "")
            text = [_verdict(f"{label} out", parts["out"].errors(), case)]
            if shape.shared_experts:
                text.append(_verdict(f"{label} shared", parts["shared"].errors(), case))
            line.append(", ".join(text) + f", {moved[(kernel, bucket)]} token(s) routed otherwise")
        print(" | ".join(line))
        failures += [f"{where}: {f}" for f in case]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES)
def test_final_is_the_weighted_sum_of_its_own_rows(bound, dtype):
    """Every variant that writes ``final`` (each mega variant, each grouped
    finalize variant), one call at its bucket on random routing, every output
    kept and NaN-poisoned before the launch: ``final`` is the weighted sum of
    the same launch's BF16 route rows with its own weights, plus its shared
    row (``runtime.reference.finalize``), within ``final_bound``; and a
    grouped finalize variant's rows, ids and weights are bit for bit those of
    the plain variant of its bucket on the same inputs (the same code; the
    kernels add no floats atomically). Much tighter than the layer's 1e-2
    against the reference, whose FP8 rounding flips spread wide at small M
    (``benchmarks.bench.CHECK_ROWS``): a route dropped, a weight or a row
    misplaced, or a row read before it is written fails here."""
    import torch

    name, artifact, layer, weights = bound
    if dtype not in layer.dtypes:
        pytest.skip(f"{name} has no {dtype}-logits variant")
    shape = artifact.shape
    mine = [v for v in artifact.variants if v.logits_dtype == dtype]
    writers = sorted((v for v in mine if v.name in layer.final_writers),
                     key=lambda v: (v.kernel, v.tokens))  # fmt: skip
    plain = {v.tokens: v for v in mine if v.kernel == "grouped" and not v.finalize}
    gen = seeding.generator(device=layer.device)
    failures = []
    for v in writers:
        m = v.tokens
        xs, logits_pool, bias = routing_inputs("random", m, shape, 1, gen, layer.device)
        x, logits = xs[0], logits_pool[0].to(getattr(torch, dtype))
        block, layout = layer._run(v, x, logits, bias, m)
        out, ids, w = layer._crop(layout, block, m)
        final = layout.view(block, "final", m)
        shared = layout.view(block, "shared_out", m) if shape.shared_experts else None
        torch.cuda.synchronize()
        for part, t in (("final", final), ("out", out), ("weights", w), ("shared", shared)):
            assert t is None or not t.isnan().any(), f"{v.name}: unwritten {part}"
        assert bool(((ids >= 0) & (ids < shape.experts)).all()), f"{v.name}: ids {ids.tolist()}"
        want, bound = final_bound(out, w, shared)
        diff = (final.double() - want).abs()
        # An exact zero sum has a zero bound (top_k = 1 without a shared
        # expert: a route's BF16 zero); being exact there is within it.
        off = torch.where(diff == 0, 0.0, diff / bound)
        bad = ~(off <= 1)  # NaN (a NaN or Inf in final) counts as past the bound
        line = f"{name} {v.name}: final off its rows' sum by at most {off.max().item():.3f} of the bound"
        if bool(bad.any()):
            failures.append(f"{v.name}: {int(bad.sum())} of {off.numel()} values of final "
                            f"past the bound (worst {off.max().item():.2f}x)")  # fmt: skip
        twin = plain.get(m) if v.kernel == "grouped" else None
        if twin is not None:
            block2, layout2 = layer._run(twin, x, logits, bias, m)
            out2, ids2, w2 = layer._crop(layout2, block2, m)
            same = [torch.equal(out.view(torch.int16), out2.view(torch.int16)),
                    torch.equal(ids, ids2), torch.equal(w.view(torch.int32), w2.view(torch.int32))]  # fmt: skip
            if shared is not None:
                got = layout2.view(block2, "shared_out", m).view(torch.int16)
                same.append(torch.equal(shared.view(torch.int16), got))
            line += f"; rows, ids, weights as {twin.name}'s: {all(same)}"
            if not all(same):
                failures.append(f"{v.name}: rows, ids, weights, shared rows bit-equal to "
                                f"{twin.name}'s: {same}")  # fmt: skip
        print(line)
    assert writers, f"{name}: no {dtype} variant writes final"
    assert not failures, "\n".join(failures)
