"""examples/tensor_parallel.py on the CPU, with a small layer and shard layers
replaced by the float32 reference of each shard (rounded to BF16, as the
kernels store it): arguments, where shards run, the FP32 sum, the comparison
with the float64 unsharded reference (which must pass, and fail for a broken
shard), and the torch.distributed path with two gloo processes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import seeding
import torch
import torch.distributed as dist
import yaml

from runtime.constants import MAX_TOKENS
from runtime.model import MoEShape
from runtime.reference import moe_reference, route, tie_margin
from runtime.sharding import shard_shape

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tensor_parallel.py"


def _load():
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return sys.modules[spec.name]


tp = _load()

#: The glm5 pattern at CPU size: inter 512 = 4 shards of 128.
SMALL = MoEShape(
    hidden=256, inter=512, experts=32, top_k=4, routed_scale=2.5, swiglu_limit=10.0,
    ue8m0=False, shared_experts=1,
)  # fmt: skip
CPU = torch.device("cpu")


class ReferenceShard:
    """A stand-in bound layer: one shard's float32 reference, BF16 out."""

    def __init__(self, weights, device, full=SMALL, broken=False):
        self.weights, self.device, self.broken = weights, device, broken
        self.shape = shard_shape(full, tp.SHARDS)

    def __call__(self, x, logits, bias):
        assert x.device == logits.device == bias.device == self.device
        w = self.weights
        y = moe_reference(x, logits, bias, w.routed, w.shared, self.shape).final
        return torch.zeros_like(y, dtype=torch.bfloat16) if self.broken else y.bfloat16()


def _bind(broken_shards=()):
    bound = []

    def bind(weights, device):
        bound.append(device)
        return ReferenceShard(weights, device, broken=len(bound) - 1 in broken_shards)

    bind.bound = bound
    return bind


# Arguments ----------------------------------------------------------------------


def test_help_and_multicast_defaults():
    """--help works without a GPU; importing the example sets NVLink multicast
    off where the environment does not say otherwise."""
    env = {k: v for k, v in os.environ.items() if k not in tp.MULTICAST_OFF}
    code = (
        "import importlib.util, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('tp', {str(EXAMPLE)!r})\n"
        "m = sys.modules['tp'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "print({k: os.environ[k] for k in m.MULTICAST_OFF})\n"
        "m.main(['--help'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    first, _, help_text = result.stdout.partition("\n")
    assert eval(first) == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                           "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip
    for text in ("--single-process", "--devices", "--tokens", "--routing", "torchrun"):
        assert text in help_text


def test_arguments():
    args = tp.parse_args(["art"])
    assert args.tokens == list(range(1, MAX_TOKENS + 1)) and args.routings == ["random", "skewed"]
    assert not args.single_process and args.logits_dtype == "float32"
    args = tp.parse_args(["art", "--single-process", "--devices", "cuda:0,cuda:1",
                          "--tokens", "5-7,1,64,6", "--routing", "skewed"])  # fmt: skip
    assert args.devices == (torch.device("cuda", 0), torch.device("cuda", 1))
    assert args.tokens == [1, 5, 6, 7, 64] and args.routings == ["skewed"]
    assert tp.parse_tokens("3") == [3]
    for bad in ("0-4", f"1-{MAX_TOKENS + 1}", "a", "", "2-", "5-3", "1,,2"):
        with pytest.raises(Exception, match="tokens"):
            tp.parse_tokens(bad)
    for argv in (["art", "--devices", "cuda:0"],  # torchrun: one GPU per process
                 ["art", "--single-process", "--devices", "cuda:0,cuda:1,cuda:2"],
                 ["art", "--single-process", "--devices", "cuda:0,cuda:0"],
                 ["art", "--single-process", "--devices", "cpu"]):  # fmt: skip
        with pytest.raises(SystemExit):
            tp.parse_args(argv)


def test_not_under_torchrun(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert tp.main(["art"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_glm5_config_makes_the_full_layer():
    model = yaml.safe_load((ROOT / "configs" / "glm5.yaml").read_text())["model"]
    full = tp.full_shape(MoEShape(**model))
    assert full == tp.GLM5 and full.inter == 2048 and tp.SHARDS * model["inter"] == 2048
    assert shard_shape(full, tp.SHARDS) == MoEShape(**model)
    tp.check_glm5(full)
    with pytest.raises(ValueError, match=r"'inter': 1024.*'inter': 2048.*configs/glm5.yaml"):
        tp.check_glm5(tp.full_shape(MoEShape(**model), 2))


# Where shards run --------------------------------------------------------------


def test_shard_placement():
    d = [torch.device("cuda", i) for i in range(4)]
    assert tp.shard_plan(4, 1, 0) == [0, 1, 2, 3]
    assert [tp.shard_plan(4, 2, r) for r in (0, 1)] == [[0, 1], [2, 3]]
    assert [tp.shard_plan(4, 4, r) for r in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="do not split evenly over 3"):
        tp.shard_plan(4, 3, 0)
    # torchrun, 2 GPUs: rank 1 serves shards 2 and 3 on its one device.
    topo = tp.Topology(rank=1, world=2, devices=(d[1],))
    assert topo.placement(4) == {2: d[1], 3: d[1]}
    assert [topo.owner(s, 4) for s in range(4)] == [0, 0, 1, 1]
    # One process, all on one GPU; or spread over two.
    assert tp.Topology(0, 1, (d[0],)).placement(4) == dict.fromkeys(range(4), d[0])
    assert tp.Topology(0, 1, (d[0], d[1])).placement(4) == {0: d[0], 1: d[0], 2: d[1], 3: d[1]}
    assert tp.Topology(0, 1, tuple(d)).placement(4) == {i: d[i] for i in range(4)}


# The sum and the comparison -------------------------------------------------------


def test_shard_outputs_are_summed_in_fp32_and_rounded_once():
    """BF16 outputs 1 and three of 2^-9: a BF16 running sum stays at 1 (each
    addition rounds back to even); the FP32 sum rounds once, to 1 + 2^-7."""
    values = [1.0, 2.0**-9, 2.0**-9, 2.0**-9]
    layers = {s: (lambda *a, v=v: torch.full((2, 8), v, dtype=torch.bfloat16))
              for s, v in enumerate(values)}  # fmt: skip
    placement = dict.fromkeys(layers, CPU)
    inputs = [torch.zeros(2, 8)] * 3
    total = tp.local_sum(layers, placement, inputs, CPU)
    assert total.dtype == torch.float32 and torch.all(total == 1 + 3 * 2.0**-9)
    out = tp.tensor_parallel(layers, placement, inputs, tp.Topology(0, 1, (CPU,)))
    assert out.dtype == torch.bfloat16 and torch.all(out.float() == 1 + 2.0**-7)
    chain = torch.zeros(2, 8, dtype=torch.bfloat16)
    for v in values:
        chain = chain + torch.full((2, 8), v, dtype=torch.bfloat16)
    assert torch.all(chain.float() == 1.0)


def test_compare_and_tolerances():
    want = torch.randn(64, 4096, dtype=torch.float64, generator=seeding.generator())
    case = tp.compare("random", want.bfloat16(), want)
    assert case.ok and case.rel_l2 < 2.0**-9 and case.m == 64
    rms = want.norm().item() / 512
    assert case.abs_tol == pytest.approx(tp.ABS_SIGMAS * tp.REL_TOL * rms)
    assert tp.REL_TOL == pytest.approx(1e-2 + 2.0**-8)
    spike = want.clone()
    spike[2, 7] += 0.5 * want.abs().max()  # one wrong element: L2 small, max-abs not
    case = tp.compare("random", spike.bfloat16(), want)
    assert case.rel_l2 < tp.REL_TOL and not case.ok
    assert not tp.compare("random", (want * 1.05).bfloat16(), want).ok
    nan = want.bfloat16()
    nan[0, 0] = float("nan")
    assert not tp.compare("random", nan, want).ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_have_no_near_ties(dtype):
    g = seeding.generator()
    for std in tp.ROUTINGS.values():
        x, logits, bias = tp.draw_inputs(tp.GLM5, 64, std, dtype, g)
        assert x.dtype == torch.bfloat16 and logits.dtype == dtype and bias.dtype == torch.float32
        assert x.shape == (64, 4096) and logits.shape == (64, 288) and bias.shape == (288,)
        assert bool((tie_margin(logits, bias, 8) >= tp.TIE).all())


def test_near_ties_are_redrawn():
    """BF16 logits with no bias tie exactly and often: find a seed whose first
    draw has tied tokens; those, and only those, get new logits."""
    shape = MoEShape(**{**SMALL.__dict__, "experts": 8})
    for seed in range(100):
        g = torch.Generator().manual_seed(seed)
        torch.randn(4, shape.hidden, generator=g)
        first = torch.randn(4, shape.experts, generator=g).bfloat16()
        tied = tie_margin(first, torch.zeros(shape.experts), shape.top_k) < tp.TIE
        if tied.any() and not tied.all():
            break
    else:
        pytest.fail("no seed gives a partly tied first draw")
    _, logits, bias = tp.draw_inputs(shape, 4, 0.0, torch.bfloat16, g.manual_seed(seed))
    assert bool((tie_margin(logits, bias, shape.top_k) >= tp.TIE).all())
    assert torch.equal(logits[~tied], first[~tied]) and not torch.equal(logits[tied], first[tied])


def test_skewed_routing_crowds_the_experts():
    g = seeding.generator()
    used = {}
    for name, std in tp.ROUTINGS.items():
        _, logits, bias = tp.draw_inputs(tp.GLM5, 64, std, torch.float32, g)
        ids = route(logits, bias, 8, 2.5)[0]
        used[name] = len(torch.unique(ids))
    assert used["skewed"] < used["random"], used


# Whole runs ---------------------------------------------------------------------


def test_single_process_run_matches_the_unsharded_layer():
    lines = []
    bind = _bind()
    report = tp.run(SMALL, tp.Topology(0, 1, (CPU,)), bind, [1, 3, 8], seed=seeding.seed(),
                    say=lines.append)  # fmt: skip
    assert not report.failed and len(report.cases) == 6 and len(bind.bound) == tp.SHARDS
    # Only BF16 roundings separate the reference shards' sum from float64.
    assert all(c.ok and c.rel_l2 < 3 * 2.0**-9 for c in report.cases), report.cases
    assert sum(line.endswith(" ok") for line in lines) == 6
    assert lines[-1].startswith("6 of 6 cases within tolerance")


def test_a_broken_shard_fails_the_run():
    lines = []
    report = tp.run(SMALL, tp.Topology(0, 1, (CPU,)), _bind(broken_shards=(2,)), [2, 9],
                    routings=["skewed"], seed=5, say=lines.append)  # fmt: skip
    assert report.failed and not any(c.ok for c in report.cases)
    assert all(line.endswith("FAIL") for line in lines if line.startswith("skewed"))


def _worker(rank: int, store: str, results: str, seed: int):
    """One of two gloo processes: a good run (weights and inputs from
    ``seed``), then one whose rank-1 shards are broken."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        topo = tp.Topology(rank=rank, world=2, devices=(CPU,))
        bind = _bind()
        good = tp.run(SMALL, topo, bind, [1, 5], routings=["random"], seed=seed,
                      say=lambda s: None)  # fmt: skip
        broken = tp.run(SMALL, topo, _bind(broken_shards=(0,) if rank == 1 else ()), [4],
                        routings=["random"], seed=3, say=lambda s: None)  # fmt: skip
        Path(f"{results}.{rank}").write_text(repr({
            "shards": len(bind.bound), "good_failed": good.failed, "broken_failed": broken.failed,
            "errors": [c.rel_l2 for c in good.cases],
        }))  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_two_processes_all_reduce_the_shards(tmp_path):
    import torch.multiprocessing as mp

    seed = seeding.seed()
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path / "out"), seed), nprocs=2)
    root = eval((tmp_path / "out.0").read_text())
    other = eval((tmp_path / "out.1").read_text())
    assert root["shards"] == other["shards"] == 2  # 4 shards, 2 per process
    assert not root["good_failed"] and not other["good_failed"]
    assert len(root["errors"]) == 2 and all(e < 3 * 2.0**-9 for e in root["errors"])
    assert other["errors"] == []  # only the root compares
    assert root["broken_failed"] and other["broken_failed"]  # every rank agrees
