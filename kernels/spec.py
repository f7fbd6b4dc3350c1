"""What a kernel build takes and what it gives back.

This module is the contract between the kernels (CuTe DSL, compiled on a CPU
machine) and everything downstream of them: the pipeline writes these values
into the manifest, and the runtime launches cubins from the manifest alone. It
imports neither cutlass nor torch.

Parameter ABI: every kernel parameter is either a bare 8-byte device pointer
(``kind="pointer"``: static-shaped tensors compile to a pointer only) or a
32-bit integer (``kind="i32"``). The runtime fills pointers by parameter name;
the names are listed in ``PARAMETER_NAMES``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from runtime.constants import MAX_TOKENS

#: What each parameter name means to the runtime (shapes per variant; M is the
#: variant's token bucket, E experts, H hidden, I inter).
PARAMETER_NAMES = {
    "maps": "uint8 [n * 128]: CUtensorMaps of the variant's `tensor_maps`, in order",
    "w13_scale": "fp32 [E, 2I/128, H/128] GEMM1 weight block scales (W31 order)",
    "w2_scale": "fp32 [E, H/128, I/128] GEMM2 weight block scales",
    "s13_scale": "fp32 [1, 2I/128, H/128] shared expert GEMM1 scales",
    "s2_scale": "fp32 [1, H/128, I/128] shared expert GEMM2 scales",
    "s13": "fp8 [1, H/128, 2I, 128] shared expert GEMM1 weights (raw bytes)",
    "s2": "fp8 [1, I/128, H, 128] shared expert GEMM2 weights (raw bytes)",
    "x": "bf16 [M, H] tokens",
    "logits": "fp32 or bf16 [M, E] router logits",
    "bias": "fp32 [E] score-correction bias",
    "rows1": "int32 [2I] physical -> logical row of GEMM1",
    "rows2": "int32 [H] physical -> logical row of GEMM2",
    "rows": "int32 [128] in-tile physical -> logical row (every row tile)",
    "out": "bf16 [M * top_k, H] unweighted route outputs",
    "shared_out": "bf16 [M, H] shared expert output",
    "final": "bf16 [M, H] finalized MoE output (aliases shared_out without finalize)",
    "ids": "int32 [M * top_k] selected experts",
    "weights": "fp32 [M * top_k] routing weights",
    "plan_x": f"workspace: fp8 [{MAX_TOKENS}, H] quantized tokens",
    "plan_s": f"workspace: fp32 [{MAX_TOKENS}, H/128] activation scales",
    "hidden": "workspace: fp8 hidden blocks of every unit",
    "hscale": "workspace: fp32 hidden scales of every unit",
    "partial": "workspace: fp32 FC1 partials",
    "counters": "workspace: int32 parity counters (zeroed once at allocation)",
    "valid": "i32: rows of x and logits the call holds, 1..M (the grouped kernel: a token t "
    ">= valid reads row valid - 1, as inputs padded by repeating their last row)",
    "arrivals": "workspace: int32 [M, cluster] arrival counts of the mega kernel's finalize "
    "(zeroed once at allocation; the last arriver of each call zeroes its word again)",
}

#: Tensor maps the runtime can build, by name: 3-D view of a BlockMajorK
#: weight [E, K/128, N, 128] as (128 bytes, N rows, E*K/128 blocks), box
#: (128, 128, 1), 128-byte swizzle.
TENSOR_MAPS = ("w13", "w2", "s13", "s2")


@dataclass(frozen=True, kw_only=True)
class Routing:
    """The routing family a kernel is compiled for, a compile-time value of
    the device routing (``kernels/moe_common``); ``runtime.model.MoEShape``'s
    fields of the same names, the defaults GLM-5's: the score function
    (``sigmoid``, or ``softmax`` over all experts), whether a
    score-correction bias is added for selection, ``groups`` equal expert
    groups of which the ``groups_kept`` best are kept, and whether the
    weights are divided by their sum. A ``KernelSpec`` carries these fields
    (keyword-only) and gives them back as ``spec.routing``."""

    score: str = "sigmoid"
    bias: bool = True
    groups: int = 1
    groups_kept: int = 1
    renormalize: bool = True

    @property
    def limits_groups(self) -> bool:
        """Whether a token drops expert groups (``groups_kept < groups``)."""
        return self.groups_kept < self.groups


@dataclass(frozen=True)
class KernelSpec(Routing):
    """Every input that changes one variant's generated code.

    Units: ``hidden``/``inter`` in elements, ``tokens`` = M (the bucket),
    ``sms`` = the SM count the variant is compiled for (grid of persistent
    kernels). The routing family's fields are ``Routing``'s (keyword-only)."""

    kernel: str
    arch: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    scale: float
    #: SwiGLU clamp (gate above, up both sides); None: no clamp.
    limit: float | None
    ue8m0: bool
    tokens: int
    logits_dtype: str
    finalize: bool
    sms: int
    #: Shared experts the layer adds (0 or 1): the mega kernels compute it in
    #: extra routes when 1.
    shared_experts: int = 1

    @property
    def routing(self) -> Routing:
        """The spec's routing fields as a ``Routing``."""
        return Routing(**{f.name: getattr(self, f.name) for f in fields(Routing)})


@dataclass(frozen=True)
class Param:
    """One kernel parameter, in ABI order."""

    name: str
    kind: str  # "pointer" | "i32"


@dataclass(frozen=True)
class LaunchShape:
    """Launch configuration fixed at compile time: the runtime reproduces it.

    ``smem`` is the dynamic shared memory in bytes; ``cluster`` is None for
    a launch without clusters; ``pdl`` turns on programmatic stream
    serialization."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    cluster: tuple[int, int, int] | None
    smem: int
    pdl: bool


@dataclass(frozen=True)
class Workspace:
    """A scratch buffer the runtime owns per (device, stream); ``zero``: it
    must be zero-filled once at allocation (never again)."""

    name: str
    bytes: int
    zero: bool = False


@dataclass(frozen=True)
class CompiledKernel:
    """What ``compile_kernel(spec)`` of a kernel module returns."""

    cubin: bytes
    entry: str
    params: tuple[Param, ...]
    launch: LaunchShape
    tensor_maps: tuple[str, ...]
    workspace: tuple[Workspace, ...] = ()
    ptx: str | None = None
    #: Free-form facts worth recording (stage count, smem layout, ...).
    notes: dict = field(default_factory=dict)


def entry_from_ptx(ptx_text: str, prefix: str) -> str:
    """The one kernel entry a compile produced, read from its PTX; refuses PTX
    with no entry, several, or one not named ``prefix``* (names are part of
    the ABI the runtime resolves)."""
    names = re.findall(r"\.visible \.entry (\w+)\(", ptx_text)
    if len(names) != 1 or not names[0].startswith(prefix):
        raise RuntimeError(f"expected one {prefix}* entry in the PTX, found {names}")
    return names[0]
