"""A tiny CuTe DSL kernel standing in for the real MoE kernels in pipeline
tests (registered through ``$MOE_BUILD_KERNEL_MODULES``).

It compiles in about a second yet goes through the real DSL and ptxas, and
its generated code depends on the spec fields the pipeline must key on
(scale, limit, top_k, tokens, logits dtype, finalize, sms), so cache and
determinism tests see real cubins change when a spec field changes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from kernels.spec import CompiledKernel, KernelSpec, LaunchShape, Param, Workspace

THREADS = 128


def compile_kernel(spec: KernelSpec) -> CompiledKernel:
    dtype = cutlass.Float32 if spec.logits_dtype == "float32" else cutlass.BFloat16
    n = spec.tokens * THREADS
    grid = (spec.sms if spec.kernel == "grouped" else spec.tokens, 1, 1)
    prefix = f"fake_{spec.kernel}_{spec.arch}"

    @cute.kernel
    def kernel(x: cute.Tensor, out: cute.Tensor, count: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        i = bid * THREADS + tid
        if i < count:
            v = x[i].to(cutlass.Float32) * spec.scale + float(spec.top_k)
            v = cute.arch.fmin(v, spec.limit)
            if cutlass.const_expr(spec.finalize):
                v = v * 0.5
            out[i] = v

    @cute.jit
    def host(x: cute.Tensor, out: cute.Tensor, count: cutlass.Int32, stream):
        kernel.set_name_prefix(prefix, remove_cutlass_symbol=True, keep_mangled_name=False)
        kernel(x, out, count).launch(grid=grid, block=(THREADS, 1, 1), stream=stream, use_pdl=True)

    x = make_fake_compact_tensor(dtype, (n,), assumed_align=16)
    out = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    compiled = cute.compile(host, x, out, cutlass.Int32(n), make_fake_stream())
    return CompiledKernel(
        cubin=compiled.artifacts.CUBIN,
        entry=f"{prefix}_0",
        params=(Param("x", "pointer"), Param("out", "pointer"), Param("count", "i32")),
        launch=LaunchShape(grid=grid, block=(THREADS, 1, 1), cluster=None, smem=0, pdl=True),
        tensor_maps=(),
        workspace=(Workspace("partial", 4 * n, zero=True),) if spec.kernel == "grouped" else (),
        ptx=compiled.artifacts.PTX,
        notes={"fake": True},
    )
