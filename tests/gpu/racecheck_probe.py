"""What compute-sanitizer's racecheck sees in our synchronization idioms.

Three 64-thread kernels hand one shared-memory word from warp 0 to warp 1:
``rc_mbarrier`` through an mbarrier arrive / try_wait.parity (the idiom every
MoE kernel uses between its warp roles), ``rc_barrier`` through bar.sync, and
``rc_none`` with no synchronization at all (a real race). Racecheck flagging
``rc_none`` shows it is watching; whether it flags ``rc_mbarrier`` tells
whether its reports on the MoE kernels' mbarrier handoffs can be taken at face
value.

    python tests/gpu/racecheck_probe.py build DIR   # here, with the DSL (no GPU)
    compute-sanitizer --tool racecheck python3 tests/gpu/racecheck_probe.py run DIR NAME
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

KINDS = ("rc_mbarrier", "rc_barrier", "rc_none")


def build(out_dir: Path) -> None:
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="racecheck-"))
    os.environ.setdefault("CUTE_DSL_KEEP", "ptx,cubin")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import racecheck_kernels

    out_dir.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        (out_dir / f"{kind}.cubin").write_bytes(racecheck_kernels.compile_handoff(kind))
    (out_dir / "meta.json").write_text(json.dumps({k: f"{k}_0" for k in KINDS}))


def run(out_dir: Path, kind: str) -> int:
    import torch

    from runtime import driver
    from runtime.artifact import Launch, Variant
    from runtime.launch import Launcher

    entry = json.loads((out_dir / "meta.json").read_text())[kind]
    cubin = (out_dir / f"{kind}.cubin").read_bytes()
    variant = Variant(
        name=kind, kernel="probe", arch="sm_90a", tokens=1, logits_dtype="float32",
        finalize=False, sms=1, entry=entry, params=(("out", "pointer"),), tensor_maps=(),
        workspace=(), launch=Launch((1, 1, 1), (64, 1, 1), None, 1024, False), sha256="",
        cubin=cubin,
    )  # fmt: skip
    device = torch.device("cuda", 0)
    out = torch.zeros(32, dtype=torch.int32, device=device)
    Launcher(variant, driver.load_library(cubin), 0, False)(
        torch.cuda.current_stream(device).cuda_stream, [out.data_ptr()]
    )
    torch.cuda.synchronize()
    print(f"{kind}: warp 1 read {sorted(set(out.tolist()))}")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(Path(sys.argv[2]))
    else:
        sys.exit(run(Path(sys.argv[2]), sys.argv[3]))
