"""examples/tensor_parallel.py on GPUs with the artifact $MOE_BUILD_ARTIFACT
(built from configs/glm5.yaml for this GPU's arch): GLM-5.3-Flash's full
layer as 4 shards, summed, against the float64 unsharded reference.

One GPU: the single-process path (all 4 shards on one device), FP32 and BF16
logits, M across every bucket and padded sizes. Two or more GPUs: one
process serving two devices (which must leave torch's current device
alone), and torchrun with one process per GPU and an NCCL all-reduce.
Tolerances are the example's (its docstring says why)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tensor_parallel.py"


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable torch/CUDA means skip
        return 0


@pytest.fixture(scope="module")
def artifact_path() -> Path:
    if not _gpus():
        pytest.skip("no CUDA device")
    path = os.environ.get("MOE_BUILD_ARTIFACT")
    if not path:
        pytest.skip("MOE_BUILD_ARTIFACT is not set")
    if not Path(path).exists():
        pytest.skip(f"MOE_BUILD_ARTIFACT={path} does not exist")
    return Path(path)


@pytest.fixture(scope="module")
def tp():
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return sys.modules[spec.name]


def _check(report, expected: int):
    assert len(report.cases) == expected
    bad = [c for c in report.cases if not c.ok]
    assert not bad and not report.failed, bad


def test_single_process_one_gpu(tp, artifact_path):
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    topo = tp.Topology(rank=0, world=1, devices=(device,))
    args = tp.parse_args([str(artifact_path), "--single-process", "--tokens", "1,3,4,5,8,17,64"])
    _check(tp.serve(args, topo), 14)
    args = tp.parse_args([str(artifact_path), "--single-process", "--tokens", "2,48",
                          "--logits-dtype", "bfloat16"])  # fmt: skip
    _check(tp.serve(args, topo), 4)


def test_one_process_two_gpus(tp, artifact_path):
    import torch

    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    torch.cuda.set_device(0)
    devices = (torch.device("cuda", 0), torch.device("cuda", 1))
    args = tp.parse_args([str(artifact_path), "--single-process", "--devices", "cuda:0,cuda:1",
                          "--tokens", "1,5,64"])  # fmt: skip
    _check(tp.serve(args, tp.Topology(rank=0, world=1, devices=devices)), 6)
    assert torch.cuda.current_device() == 0, "a layer on cuda:1 moved torch's current device"


def test_torchrun_one_process_per_gpu(artifact_path):
    gpus = _gpus()
    if gpus < 2:
        pytest.skip("needs 2 GPUs")
    n = 4 if gpus >= 4 else 2
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", str(EXAMPLE), str(artifact_path),
               "--tokens", "1,4,5,64"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    print(result.stdout[-6000:], result.stderr[-3000:])
    assert result.returncode == 0
    assert "8 of 8 cases within tolerance" in result.stdout
