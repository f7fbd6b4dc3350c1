"""Builds the launcher's first-light cubins (sm_90a) for tests/gpu/test_first_light.py.

Two tiny kernels with static-shape pointer parameters, compiled offline like
the MoE kernels:

* ``rt_affine``: ``y[i] = x[i] * alpha + %cluster_ctarank`` over 64 CTAs in
  clusters of 16 (a non-portable size) with PDL on: checks the launch
  attributes, an i32 parameter and the parameter order.
* ``rt_tma``: each CTA loads one 128 x 128 box of a BlockMajorK weight through
  a runtime-built tensor map read from global memory, and copies its (128-byte
  swizzled) shared memory out: checks runtime.tensormap against FORMAT.md.

Usage (no GPU needed): ``python tests/gpu/first_light_build.py OUT_DIR``
writes ``OUT_DIR/{rt_affine,rt_tma}.cubin`` and ``OUT_DIR/meta.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["CUTE_DSL_ARCH"] = "sm_90a"
os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="first-light-"))
os.environ.setdefault("CUTE_DSL_KEEP", "ptx,cubin")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Int64, Uint8  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream  # noqa: E402

from kernels import ptx  # noqa: E402

N = 64 * 128  # rt_affine elements
CLUSTER = 16
# rt_tma's weight: [E, K/128, N, 128] FP8 bytes, one CTA per 128 x 128 box.
TMA_SHAPE = (2, 3, 256, 128)
BOXES = TMA_SHAPE[0] * TMA_SHAPE[1] * TMA_SHAPE[2] // 128
BOX = 128 * 128
TMA_SMEM = BOX + 1024  # box (1024-aligned), then the barrier


class Affine:
    @cute.jit
    def __call__(self, y: cute.Tensor, x: cute.Tensor, alpha: Int32, stream):
        self.kernel.set_name_prefix("rt_affine", remove_cutlass_symbol=True,
                                    keep_mangled_name=False)  # fmt: skip
        self.kernel(y, x, alpha).launch(
            grid=(N // 128, 1, 1), block=(128, 1, 1), cluster=(CLUSTER, 1, 1), stream=stream,
            use_pdl=True, preferred_smem_carveout=100,
        )  # fmt: skip

    @cute.kernel
    def kernel(self, y: cute.Tensor, x: cute.Tensor, alpha: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        ptx.griddepcontrol_wait()
        i = cta * 128 + tid
        v = ptx.ld_global_f32(x.iterator.toint() + Int64(i) * 4)
        rank = ptx.cluster_ctarank()
        ptx.st_global_f32(y.iterator.toint() + Int64(i) * 4,
                          v * Float32(alpha) + Float32(rank))  # fmt: skip


class Tma:
    @cute.jit
    def __call__(self, maps: cute.Tensor, out: cute.Tensor, stream):
        self.kernel.set_name_prefix("rt_tma", remove_cutlass_symbol=True, keep_mangled_name=False)
        self.kernel(maps, out).launch(
            grid=(BOXES, 1, 1), block=(128, 1, 1), smem=TMA_SMEM, stream=stream,
            preferred_smem_carveout=100,
        )  # fmt: skip

    @cute.kernel
    def kernel(self, maps: cute.Tensor, out: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        base = cute.arch.get_dyn_smem(Uint8, alignment=1024).toint()
        bar = base + BOX
        tmap = maps.iterator.toint()
        tiles = TMA_SHAPE[2] // 128
        if tid == 0:
            ptx.mbarrier_init(bar, 1)
            ptx.fence_mbarrier_init()
            ptx.tensormap_fence_acquire(tmap)
            ptx.mbarrier_arrive_expect_tx(bar, BOX)
            ptx.tma_load_3d(base, tmap, bar, 0, (cta % tiles) * 128, cta // tiles)
        cute.arch.sync_threads()
        ptx.mbarrier_wait(bar, 0)
        dst = out.iterator.toint() + Int64(cta) * BOX
        for j in cutlass.range_constexpr(BOX // 16 // 128):
            offset = (j * 128 + tid) * 16
            v0, v1, v2, v3 = ptx.ld_shared_v4_u32(base + offset)
            ptx.st_global_v4_u32(dst + offset, v0, v1, v2, v3)


def build(out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)

    def fake(dtype, n, align=16):
        return make_fake_compact_tensor(dtype, (n,), assumed_align=align)

    affine = cute.compile(Affine(), fake(Float32, N), fake(Float32, N), Int32(3),
                          make_fake_stream())  # fmt: skip
    tma = cute.compile(Tma(), fake(Uint8, 128, 64), fake(Uint8, BOXES * BOX),
                       make_fake_stream())  # fmt: skip
    (out_dir / "rt_affine.cubin").write_bytes(bytes(affine.artifacts.CUBIN))
    (out_dir / "rt_tma.cubin").write_bytes(bytes(tma.artifacts.CUBIN))
    meta = {
        "rt_affine": {
            "entry": "rt_affine_0", "n": N,
            "params": [["y", "pointer"], ["x", "pointer"], ["alpha", "i32"]],
            "launch": {"grid": [N // 128, 1, 1], "block": [128, 1, 1],
                       "cluster": [CLUSTER, 1, 1], "smem": 0, "pdl": True},
        },
        "rt_tma": {
            "entry": "rt_tma_0", "shape": list(TMA_SHAPE), "boxes": BOXES,
            "params": [["maps", "pointer"], ["out", "pointer"]],
            "launch": {"grid": [BOXES, 1, 1], "block": [128, 1, 1], "cluster": None,
                       "smem": TMA_SMEM, "pdl": False},
        },
    }  # fmt: skip
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


if __name__ == "__main__":
    print(json.dumps(build(Path(sys.argv[1])), indent=1))
