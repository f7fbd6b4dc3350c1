"""The runtime's guarantees that only a GPU can show.

- Persistent (grouped) launches beside other work neither hang nor err: two
  streams of different priority calling the layer in turn while a third
  stream runs a plain kernel, and two grouped launches on two streams at
  once (tests/gpu/stress_streams.py, in a subprocess with a time limit, since
  a hung process cannot report).
- A grouped launch whose CTAs wait on one that never runs fails with an
  error within the kernel's wait bound instead of hanging
  (tests/gpu/stuck_wait.py; the failure loses that process's context).
- A CUDA graph replayed after its layer and artifact were deleted still
  gives the right output (runtime.graphs keeps them alive), and
  ``Artifact.close`` is refused while such a graph exists.

$MOE_BUILD_ARTIFACT names an sm_90a artifact with grouped variants;
$MOE_STRESS_PAIRS overrides the 10,000 pairs of the stream test.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

import runtime
from runtime import graphs
from runtime.errors import ArtifactError
from runtime.layout import random_moe_weights
from runtime.reference import moe_reference, rel_l2

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
#: Seconds a watched process may take before it counts as hung: far above
#: the work itself (10,000 pairs take seconds) and the kernel's wait bound.
LIMIT = 240


def _watch(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        done = subprocess.run([sys.executable, str(HERE / script), *args], env=env,
                              capture_output=True, text=True, timeout=LIMIT)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} {' '.join(args)}: no answer in {LIMIT} s (hung): {e.stdout}")
    print(done.stdout.strip())
    return done


@pytest.mark.parametrize("m,m2", [(64, 64), (64, 16), (8, 64)])
def test_persistent_launches_beside_other_streams_never_hang(artifact_path, device, m, m2):
    pairs = os.environ.get("MOE_STRESS_PAIRS", "10000")
    done = _watch("stress_streams.py", str(artifact_path), "--pairs", pairs, "--m", str(m),
                  "--m2", str(m2))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_wait_that_cannot_end_fails_the_launch(artifact_path, device):
    done = _watch("stuck_wait.py", str(artifact_path))
    assert done.returncode == 0 and "launch failed" in done.stdout, done.stdout + done.stderr


def _captured(path, device, seed):
    """Graphs of one layer call each, with their output, expected output and
    inputs; the layer, its weights and the artifact go out of scope on
    return, so only the graphs can keep them."""
    artifact = runtime.load(path, device)
    gen = torch.Generator(device).manual_seed(seed)
    prepared, routed, shared = random_moe_weights(artifact.shape, gen)
    layer = artifact.bind(prepared, poison=True)
    s = artifact.shape
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[layer.dtypes[0]]
    calls = []
    for m in (1, max(layer.tables[layer.dtypes[0]])):
        x = torch.randn(m, s.hidden, device=device, generator=gen).bfloat16()
        logits = torch.randn(m, s.experts, device=device, generator=gen).to(dtype)
        bias = torch.randn(s.experts, device=device, generator=gen) * 0.1
        want = moe_reference(x, logits, bias, routed, shared, s).final
        layer(x, logits, bias)  # workspaces before capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, logits, bias)
        # The inputs are the caller's to keep, as for any captured graph.
        calls.append((graph, out, want, m, (x, logits, bias)))
    with pytest.raises(ArtifactError, match="captured CUDA graph"):
        artifact.close()
    return calls, weakref.ref(artifact)


def test_graph_replayed_after_its_layer_is_deleted(artifact_path, device):
    seed = int.from_bytes(os.urandom(4), "little") >> 1
    print("seed", seed)
    calls, artifact = _captured(artifact_path, device, seed)
    gc.collect()
    assert artifact() is not None, "the graphs no longer hold their artifact"
    # Reuse freed memory if any was freed: allocate and fill a lot of it.
    junk = [torch.full((1 << 26,), float("nan"), device=device) for _ in range(8)]
    for graph, out, want, m, _ in calls:
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(device)
        err = rel_l2(out, want)
        print(f"M={m}: replay after deletion, rel_l2 {err:.5f}")
        assert not out.isnan().any() and err < 1e-2
    del junk
    for graph, *_ in calls:
        graph.reset()
    del calls, graph
    # The driver runs the graphs' destructors on its own thread, soon after.
    for _ in range(200):
        gc.collect()
        graphs.release()
        gc.collect()
        if artifact() is None:
            break
        time.sleep(0.01)
    assert artifact() is None, "destroying the graphs did not release their artifact"
