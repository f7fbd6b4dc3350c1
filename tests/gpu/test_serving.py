"""Serving paths of a built artifact on this GPU: the ``moe_build::moe_layer``
op under torch.compile and in CUDA graphs, chunked M above the largest
bucket, and examples/serve.py.

$MOE_BUILD_ARTIFACT names the artifact (directory or .tar.zst) built for this
device's arch; the layer is bound to fresh random weights with its outputs
NaN-poisoned before every launch (and the chunked output before its chunks
are written), inputs are fresh each run (tests/seeding.py prints the seeds).
Logits whose best top_k + 1 routing keys lie within 1e-6 are redrawn, so the
reference routes every token as the kernels do.

Tolerances: compiled vs eager calls run the same kernels on the same inputs,
so they agree to 1e-3 relative L2 (bit-equal where the kernels' sums are
deterministic); chunked and captured outputs meet docs/semantics.md's 1e-2
bar against the float64 reference, as every layer call does
(tests/gpu/test_moe_artifact.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import seeding
import torch
from gpu_artifacts import TIE

import runtime
from runtime.chunks import chunk_plan, run_chunked
from runtime.layout import random_moe_weights
from runtime.ops import MoEModule
from runtime.reference import moe_reference, rel_l2, tie_margin

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-2
SAME = 1e-3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def artifact(artifact_path, device):
    return runtime.load(artifact_path, device)


@pytest.fixture(scope="module")
def weights(artifact, device):
    gen = seeding.generator(f"{__name__}.weights", device=device)
    return random_moe_weights(artifact.shape, gen)


@pytest.fixture(scope="module")
def layer(artifact, weights):
    return artifact.bind(weights[0], poison=True)


@pytest.fixture(scope="module")
def module(layer):
    made = MoEModule(layer)
    yield made
    made.close()


@pytest.fixture(autouse=True)
def _seeded():
    seeding.seed_torch()


def _inputs(shape, m, dtype, device):
    """Fresh x BF16 [m, H], logits [m, E] without near-tied routing keys, bias."""
    x = torch.randn(m, shape.hidden, device=device).to(torch.bfloat16)
    logits = torch.randn(m, shape.experts, device=device).to(DTYPES[dtype])
    bias = torch.randn(shape.experts, device=device) * 0.1
    for _ in range(100):
        close = tie_margin(logits, bias, shape.top_k) < TIE
        if not bool(close.any()):
            return x, logits, bias
        fresh = torch.randn(int(close.sum()), shape.experts, device=device)
        logits[close] = fresh.to(logits.dtype)
    raise RuntimeError("could not draw logits without near-ties")


def _exact(artifact, weights, x, logits, bias):
    _, routed, shared = weights
    return moe_reference(x, logits, bias, routed, shared, artifact.shape, dtype=torch.float64)


def test_compiled_module_matches_eager(artifact, layer, module, device):
    """torch.compile(fullgraph=True) of the module (inductor) gives the eager
    layer's output, for M in one call and in chunks (1100 with the configs'
    512-token largest bucket: two direct chunks of 512 and a partial one of
    76), both logits dtypes."""
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    results = {}
    for dtype in layer.dtypes:
        for m in (1, 4, 8, 64, 100, 200, 600, 1100):
            x, logits, bias = _inputs(artifact.shape, m, dtype, device)
            want = (
                layer(x, logits, bias)
                if m <= layer.largest
                else run_chunked(layer, x, logits, bias)
            )
            got = compiled(x, logits, bias)
            torch.cuda.synchronize(device)
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            assert not got.isnan().any(), (dtype, m)
            err = rel_l2(got, want)
            results[f"{dtype} M={m}"] = "equal" if torch.equal(got, want) else round(err, 6)
            assert err < SAME, (dtype, m, err)
    print(json.dumps(results))


@pytest.mark.parametrize("m", [65, 100, 128, 129, 256, 300, 512, 513, 1100])
def test_chunked_m_matches_float64_reference(artifact, layer, module, weights, device, m):
    """M around and above the largest bucket (one launch up to it; above it
    full chunks launched into their rows and, at 513 and 1100 with 512-token
    buckets, a partial last chunk), through the op: every row written (the output is
    NaN-filled first), rel L2 below 1e-2 of the float64 reference."""
    for dtype in layer.dtypes:
        x, logits, bias = _inputs(artifact.shape, m, dtype, device)
        got = module(x, logits, bias)
        assert got.shape == (m, artifact.shape.hidden) and got.dtype == torch.bfloat16
        assert not got.isnan().any(), (dtype, m)
        out = torch.full_like(got, float("nan"))
        assert run_chunked(layer, x, logits, bias, out=out) is out and not out.isnan().any()
        err = rel_l2(got, _exact(artifact, weights, x, logits, bias).final)
        pieces = len(chunk_plan(m, layer.tables[dtype]))
        print(f"{dtype} M={m}: {pieces} chunks, rel_l2 vs float64 {err:.5f}")
        assert err < TOL, (dtype, m, err)


@pytest.mark.parametrize("m", [3, 100, 300])
def test_op_in_a_cuda_graph_replays_right(artifact, layer, module, weights, device, m):
    """The op captured in a CUDA graph (static buffers, as servers do) and
    replayed with fresh inputs each time: each replay's output meets the bar
    against its own inputs' float64 reference."""
    dtype = layer.dtypes[0]
    pool = [_inputs(artifact.shape, m, dtype, device) for _ in range(4)]
    wants = [_exact(artifact, weights, *p).final for p in pool]
    x, logits, bias = (t.clone() for t in pool[0])
    module(x, logits, bias)  # workspaces before capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(x, logits, bias)
    worst = 0.0
    for i in range(20):
        px, pl, pb = pool[i % len(pool)]
        x.copy_(px)
        logits.copy_(pl)
        bias.copy_(pb)
        graph.replay()
        torch.cuda.synchronize(device)
        assert not out.isnan().any(), (m, i)
        worst = max(worst, rel_l2(out, wants[i % len(pool)]))
    print(f"graph M={m} {dtype}: 20 replays, worst rel_l2 vs float64 {worst:.5f}")
    assert worst < TOL
    del graph


def test_compiled_with_cuda_graphs(artifact, layer, module, weights, device):
    """torch.compile(mode="reduce-overhead"): inductor's own CUDA graphs
    around the op replay right."""
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, mode="reduce-overhead")
    dtype = layer.dtypes[0]
    for _ in range(4):
        x, logits, bias = _inputs(artifact.shape, 8, dtype, device)
        got = compiled(x, logits, bias).clone()
        torch.cuda.synchronize(device)
        assert rel_l2(got, _exact(artifact, weights, x, logits, bias).final) < TOL
    torch._dynamo.reset()


def test_serve_example_runs(artifact_path):
    """examples/serve.py: a short decode loop with three sizes (the largest
    chunked where the artifact's buckets end below 300) and its final float64
    check, in a fresh process."""
    seed = seeding.seed_for()
    cmd = [sys.executable, str(ROOT / "examples" / "serve.py"), str(artifact_path), "--random",
           "--sizes", "1,8,300", "--steps", "60", "--seed", str(seed)]  # fmt: skip
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "captured 3 graphs" in done.stdout
    assert "check M=300" in done.stdout and ": ok" in done.stdout
