"""The probe kernels of racecheck_probe.py (imported only where the DSL is)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from kernels import ptx


class Handoff:
    """Thread 0 writes a shared word; warp 1 reads it after ``kind``'s sync."""

    def __init__(self, kind: str):
        self.kind = kind

    @cute.jit
    def __call__(self, out: cute.Tensor, stream):
        self.kernel.set_name_prefix(self.kind, remove_cutlass_symbol=True,
                                    keep_mangled_name=False)  # fmt: skip
        self.kernel(out).launch(grid=(1, 1, 1), block=(64, 1, 1), smem=1024, stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        base = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=1024).toint()
        bar = Int32(base)
        word = Int32(base) + 16
        if tid == 0:
            ptx.mbarrier_init(bar, 1)
            ptx.fence_mbarrier_init()
        cute.arch.sync_threads()
        if tid == 0:
            ptx.st_shared_u32(word, Uint32(42))
            if cutlass.const_expr(self.kind == "rc_mbarrier"):
                ptx.mbarrier_arrive(bar)
        if cutlass.const_expr(self.kind == "rc_barrier"):
            cute.arch.sync_threads()
        if tid >= 32:
            if cutlass.const_expr(self.kind == "rc_mbarrier"):
                ptx.mbarrier_wait(bar, 0)
            value = ptx.ld_shared_u32(word)
            ptx.st_global_u32(out.iterator.toint() + Int64(tid - 32) * 4, value)


def compile_handoff(kind: str) -> bytes:
    fake = make_fake_compact_tensor(cutlass.Uint32, (32,), assumed_align=16)
    return bytes(cute.compile(Handoff(kind), fake, make_fake_stream()).artifacts.CUBIN)
