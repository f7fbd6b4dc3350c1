"""The kernels' parameter ABI as data: every parameter name -> (dtype,
shape), one table for the fake compile arguments of every kernel and for the
tests that check a variant's recorded parameters.

``shapes`` is plain Python (the runtime's meaning of each name is
``kernels.spec.PARAMETER_NAMES``); ``fake_arguments`` turns a list of names
into the DSL's static-shaped stand-ins (it imports cutlass when called).
Dtype names: ``uint8``, ``int32``, ``float32``, ``bfloat16``; ``logits`` takes
the variant's logits dtype. Byte alignment 16, the maps buffer 64. The
names in ``SCALAR_PARAMS`` are 32-bit integers, not tensors (kind ``i32``).
"""

from __future__ import annotations

from runtime.constants import TILE, VALID

#: The mega kernel's parameters (ABI order) and tensor maps, with the shared
#: expert (``shared_experts == 1``) and routed only.
MEGA_PARAMS = ("maps", "w13_scale", "w2_scale", "s13_scale", "s2_scale", "x", "logits", "bias",
               "rows1", "rows2", "out", "shared_out", "final", "ids", "weights",
               "arrivals")  # fmt: skip
MEGA_MAPS = ("w13", "w2", "s13", "s2")
MEGA_ROUTED_PARAMS = tuple(p for p in MEGA_PARAMS if p not in ("s13_scale", "s2_scale",
                                                                "shared_out"))  # fmt: skip
MEGA_ROUTED_MAPS = ("w13", "w2")
#: The grouped kernel's (both archs; every one a pointer but ``valid``), with
#: the shared expert and routed only.
GROUPED_PARAMS = (
    "maps", "w13_scale", "w2_scale", "s13_scale", "s2_scale", "s13", "s2", "x", "logits",
    "bias", "rows", "out", "shared_out", "final", "ids", "weights", "plan_x", "plan_s",
    "hidden", "hscale", "partial", "counters", VALID,
)  # fmt: skip
GROUPED_MAPS = ("w13", "w2", "s13", "s2")
GROUPED_ROUTED_PARAMS = tuple(p for p in GROUPED_PARAMS if p not in ("s13_scale", "s2_scale",
                                                                      "s13", "s2", "shared_out"))  # fmt: skip
GROUPED_ROUTED_MAPS = ("w13", "w2")
#: Parameters that are 32-bit integers (kind ``i32``): ``valid``, the rows of
#: x and logits a call holds (1..M; the runtime writes it at every call).
SCALAR_PARAMS = (VALID,)


def param_kind(name: str) -> str:
    """``i32`` for a name of ``SCALAR_PARAMS``, else ``pointer``."""
    return "i32" if name in SCALAR_PARAMS else "pointer"


def shapes(hidden: int, inter: int, experts: int, top_k: int, tokens: int, maps: int,
           logits_dtype: str, workspace: dict[str, int] | None = None) -> dict:  # fmt: skip
    """name -> (dtype name, shape, byte alignment) of every parameter a
    kernel of this shape may take; ``maps`` tensor maps; ``workspace``: name
    -> bytes of the variant's workspaces (``counters`` is int32, the rest
    bytes)."""
    e, h, i, m, k = experts, hidden, inter, tokens, top_k
    table = {
        "maps": ("uint8", (maps * 128,), 64),
        "w13_scale": ("float32", (e, 2 * i // TILE, h // TILE), 16),
        "w2_scale": ("float32", (e, h // TILE, i // TILE), 16),
        "s13_scale": ("float32", (1, 2 * i // TILE, h // TILE), 16),
        "s2_scale": ("float32", (1, h // TILE, i // TILE), 16),
        "s13": ("uint8", (h * 2 * i,), 16),
        "s2": ("uint8", (i * h,), 16),
        "x": ("bfloat16", (m, h), 16),
        "logits": (logits_dtype, (m, e), 16),
        "bias": ("float32", (e,), 16),
        "rows": ("int32", (TILE,), 16),
        "rows1": ("int32", (2 * i,), 16),
        "rows2": ("int32", (h,), 16),
        "out": ("bfloat16", (m * k, h), 16),
        "shared_out": ("bfloat16", (m, h), 16),
        "final": ("bfloat16", (m, h), 16),
        "ids": ("int32", (m * k,), 16),
        "weights": ("float32", (m * k,), 16),
    }
    for name, size in (workspace or {}).items():
        table[name] = ("int32", (size // 4,), 16) if name == "counters" else ("uint8", (size,), 16)
    return table


def fake_arguments(names, hidden: int, inter: int, experts: int, top_k: int, tokens: int,
                   maps: int, logits_dtype: str, workspace: dict[str, int] | None = None) -> list:  # fmt: skip
    """The DSL's fake tensors of ``names`` (ABI order), from ``shapes``."""
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    dtypes = {"uint8": cutlass.Uint8, "int32": cutlass.Int32, "float32": cutlass.Float32,
              "bfloat16": cutlass.BFloat16}  # fmt: skip
    table = shapes(hidden, inter, experts, top_k, tokens, maps, logits_dtype, workspace)
    out = []
    for name in names:
        if name in SCALAR_PARAMS:
            out.append(cutlass.Int32(tokens))  # a dynamic i32: any value compiles alike
            continue
        dtype, shape, align = table[name]
        out.append(make_fake_compact_tensor(dtypes[dtype], shape, assumed_align=align))
    return out
