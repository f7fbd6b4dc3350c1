"""The stub kernel (tests/pipeline_stub_kernel.py) that also says which
process compiles: with ``MOE_BUILD_PID_DIR=dir`` each compile first creates
``dir/<pid>`` (the worker's pid), then compiles as the stub does (so
``MOE_BUILD_STUB_SLEEP`` makes it slow)."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline_stub_kernel import compile_kernel as _stub_compile

from kernels.spec import CompiledKernel, KernelSpec


def compile_kernel(spec: KernelSpec) -> CompiledKernel:
    pids = os.environ.get("MOE_BUILD_PID_DIR")
    if pids:
        Path(pids, str(os.getpid())).touch()
    return _stub_compile(spec)
