"""One MoE layer from a Hugging Face style safetensors checkpoint of an FP8
block-scale model (DeepSeek-V3 / GLM naming), as this rank's prepared weights.

What a layer holds in such a checkpoint (``Names`` gives the names):

- per routed expert e and projection p in gate, up, down:
  ``model.layers.{L}.mlp.experts.{e}.{p}_proj.weight``, float8_e4m3fn
  ``[N, K]`` (gate/up: ``[I, H]``; down: ``[H, I]``), and ``...weight_scale_inv``,
  FP32 ``[N/128, K/128]``: one scale per 128 x 128 block, which multiplies
  the block's FP8 values to dequantize them (despite the name), exactly as
  the kernels' ``w13_scale``/``w2_scale`` do;
- the shared expert, the same three projections under
  ``model.layers.{L}.mlp.shared_experts.{p}_proj`` (one expert of width I:
  the runtime serves ``n_shared_experts = 1``);
- the router's score-correction bias ``model.layers.{L}.mlp.gate.e_score_correction_bias``,
  ``[E]`` (FP32, or BF16 widened exactly); a family without one (Qwen3-MoE,
  ``QWEN3_MOE``: no shared expert either) gives bias None and its expert
  count from the router weight ``model.layers.{L}.mlp.gate.weight`` ``[E, H]``.

Tensor parallelism: rank r of world w takes the intermediate slice
``[r*I/w, (r+1)*I/w)``: those rows of gate and up, those columns of down, and
the matching 128-blocks of their scales (``runtime.sharding``'s split, done
while reading, so a rank reads only its slice's bytes). I/w must be a
multiple of 128 (a scale block never straddles two ranks).

Reading: ``safetensors.safe_open(..., framework="pt")`` memory-maps each file
and only the tensors (and, through ``get_slice``, the rows and columns) a rank
needs are read. The checkpoint is a directory with ``model.safetensors.index.json``
(its ``weight_map`` names each tensor's shard file) or with a single
``model.safetensors``, or the path of either file.

``load_layer`` prepares one expert at a time (``runtime.layout.prepare``: W31
order, 16-row shuffle, block-major K) into preallocated kernel-layout tensors
on the target device, so neither host nor device ever holds the layer twice;
``read_layer`` returns the checkpoint-layout slice instead (tests, tools).
Every refusal names the tensor, the file and what was expected.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.constants import TILE
from runtime.errors import RuntimeRefusal
from runtime.inputs import expert_shapes
from runtime.layout import CheckpointWeights, ExpertWeights, MoEWeights, prepare
from runtime.model import MoEShape

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FP8 = torch.float8_e4m3fn
#: torch dtype -> the safetensors dtype tag of a file's header.
TAGS = {FP8: "F8_E4M3", torch.float32: "F32", torch.bfloat16: "BF16"}


class CheckpointError(RuntimeRefusal, ValueError):
    """A checkpoint lacks a tensor, holds one of the wrong dtype or shape, or
    does not split into the requested tensor-parallel slices."""


@dataclass(frozen=True)
class Names:
    """One model family's tensor names for MoE layer ``{layer}``: format
    strings of the module prefixes (``{expert}``: routed expert index,
    ``{proj}``: one of ``gate``/``up``/``down`` below) and the parameters'
    suffixes. ``shared`` is None for a family without a shared expert, ``bias``
    for one whose router has no score-correction bias (the expert count is
    then read from the router weight ``router`` [E, H])."""

    expert: str
    shared: str | None
    bias: str | None
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    weight: str = "weight"
    scale: str = "weight_scale_inv"
    router: str = "model.layers.{layer}.mlp.gate.weight"

    def routed(self, layer: int, expert: int, proj: str, param: str) -> str:
        return f"{self.expert.format(layer=layer, expert=expert, proj=proj)}.{param}"

    def shared_name(self, layer: int, proj: str, param: str) -> str:
        return f"{self.shared.format(layer=layer, proj=proj)}.{param}"

    def bias_name(self, layer: int) -> str | None:
        return None if self.bias is None else self.bias.format(layer=layer)

    def router_name(self, layer: int) -> str:
        return self.router.format(layer=layer)


#: DeepSeek-V3 / R1 (and models of its architecture) and GLM-4.5-style MoE.
DEEPSEEK_V3 = Names(
    expert="model.layers.{layer}.mlp.experts.{expert}.{proj}",
    shared="model.layers.{layer}.mlp.shared_experts.{proj}",
    bias="model.layers.{layer}.mlp.gate.e_score_correction_bias",
)
#: Qwen3-MoE: the same expert names, no shared expert, a router without bias.
QWEN3_MOE = Names(expert="model.layers.{layer}.mlp.experts.{expert}.{proj}", shared=None,
                  bias=None)  # fmt: skip
#: Family name -> its names; add a family by adding a row.
FAMILIES = {"deepseek_v3": DEEPSEEK_V3, "glm4_moe": DEEPSEEK_V3, "qwen3_moe": QWEN3_MOE}


# Reading files ----------------------------------------------------------------------


class Checkpoint:
    """The safetensors files of a checkpoint (module docstring), opened
    lazily and memory-mapped; a context manager that closes them."""

    def __init__(self, path):
        from safetensors import safe_open

        self._safe_open = safe_open
        path = Path(path)
        self.source = str(path)
        self._files: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()
        if path.is_dir():
            index = path / INDEX if (path / INDEX).exists() else None
            single = path / SINGLE
            if index is None and not single.exists():
                raise CheckpointError(f"checkpoint {path}: neither {INDEX} nor {SINGLE} is there")
        elif path.suffix in (".json", ".safetensors"):
            if not path.is_file():
                raise CheckpointError(f"checkpoint {path}: no such file")
            index, single = (path, None) if path.suffix == ".json" else (None, path)
        else:
            raise CheckpointError(
                f"checkpoint {path}: expected a directory, an index .json or a .safetensors file"
            )
        #: The index file (None for a single file) and tensor name -> file.
        self.index = index
        if index is not None:
            try:
                names = _weight_map(index)
            except (OSError, ValueError, TypeError) as e:
                raise CheckpointError(f"checkpoint {index}: not a safetensors index ({e})") from e
            self.weight_map = {k: index.parent / v for k, v in names.items()}
        else:
            self.weight_map = dict.fromkeys(self._open(single).keys(), single)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._files.clear()
        self._stack.close()

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name``; refuses one the checkpoint lacks."""
        found = self.weight_map.get(name)
        if found is None:
            where = f"{self.index.name}'s weight_map" if self.index else self.source
            raise CheckpointError(f"checkpoint {self.source}: tensor {name!r} is not in {where}")
        return found

    def _open(self, file: Path):
        handle = self._files.get(file)
        if handle is None:
            if not file.exists():
                raise CheckpointError(
                    f"checkpoint {self.source}: shard {file.name} (named by {INDEX}) does not exist"
                )
            handle = self._stack.enter_context(self._safe_open(str(file), framework="pt"))
            self._files[file] = handle
        return handle

    def meta(self, name: str):
        """(file, safetensors slice) of tensor ``name``; nothing read yet."""
        file = self.file_of(name)
        try:
            return file, self._open(file).get_slice(name)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(
                f"checkpoint {self.source}: {file.name} does not hold tensor {name!r} "
                f"though the index says so ({e})"
            ) from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta(name)[1].get_shape())

    def read(self, name: str, dtypes, shape, rows=None, cols=None) -> torch.Tensor:
        """Tensor ``name`` (its ``rows``/``cols`` slices only, when given) as
        a contiguous CPU tensor, after checking its dtype (one of ``dtypes``)
        and full ``shape`` in the file's header."""
        file, sl = self.meta(name)
        dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
        tag, found = sl.get_dtype(), tuple(sl.get_shape())
        if tag not in {TAGS[d] for d in dtypes} or found != tuple(shape):
            want = " or ".join(TAGS[d] for d in dtypes)
            raise CheckpointError(
                f"checkpoint {self.source}: tensor {name!r} in {file.name}: expected {want} "
                f"{list(shape)}, found {tag} {list(found)}"
            )
        index = tuple(s if s is not None else slice(None) for s in (rows, cols)[: len(shape)])
        return (sl[index] if index else sl[:]).contiguous()


def _weight_map(index: Path) -> dict[str, str]:
    data = json.loads(index.read_text())
    weight_map = data["weight_map"] if isinstance(data, dict) and "weight_map" in data else None
    if not isinstance(weight_map, dict):
        raise ValueError("no weight_map object")
    return {str(k): str(v) for k, v in weight_map.items()}


# The layer ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointLayer:
    """This rank's slice of one layer in checkpoint layout (CPU tensors):
    ``routed`` [E] experts, ``shared`` (E = 1, or None) and the FP32 [E] bias
    (None for a family without one)."""

    routed: CheckpointWeights
    shared: CheckpointWeights | None
    bias: torch.Tensor | None


@dataclass(frozen=True)
class LayerWeights:
    """This rank's slice of one layer, prepared for the kernels: ``weights``
    (``runtime.layout.MoEWeights`` on the target device, ready for
    ``Artifact.bind``) and the FP32 [E] router ``bias`` on the same device
    (None for a family without one: pass it as the layer's bias);
    ``hidden``, ``inter`` (this rank's width) and ``experts`` as read."""

    weights: MoEWeights
    bias: torch.Tensor | None
    hidden: int
    inter: int
    experts: int


@dataclass(frozen=True)
class _Plan:
    """What to read: dims of the full layer and this rank's inter slice."""

    hidden: int
    inter: int
    experts: int
    shared: bool
    start: int
    width: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.width)

    @property
    def blocks(self) -> slice:
        return slice(self.start // TILE, (self.start + self.width) // TILE)


def _names(names: Names | str) -> Names:
    if isinstance(names, Names):
        return names
    if names not in FAMILIES:
        raise CheckpointError(f"names: unknown family {names!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[names]


def _plan(ckpt: Checkpoint, names: Names, layer: int, rank: int, world: int,
          shape: MoEShape | None) -> _Plan:  # fmt: skip
    if world < 1 or not 0 <= rank < world:
        raise CheckpointError(f"rank {rank} of world {world}: expected 0 <= rank < world")
    if shape is not None and shape.bias != (names.bias is not None):
        has = "has" if shape.bias else "has no"
        raise CheckpointError(f"the artifact's model {has} a score-correction bias; the names' "
                              f"family {'has none' if shape.bias else 'reads one'}")  # fmt: skip
    # The expert count: the bias [E], or without one the router weight [E, H].
    counted = names.bias_name(layer) if names.bias is not None else names.router_name(layer)
    if not ckpt.has(counted):
        # Dense layers (DeepSeek-V3's first_k_dense_replace) have no router.
        pattern = names.bias if names.bias is not None else names.router
        raise CheckpointError(
            f"checkpoint {ckpt.source}: tensor {counted!r} is not there: is layer {layer} "
            f"an MoE layer, named as {pattern!r}?"
        )
    dims = ckpt.shape(counted)
    if len(dims) != (1 if names.bias is not None else 2):
        want = "[E]" if names.bias is not None else "[E, H]"
        raise CheckpointError(f"checkpoint {ckpt.source}: tensor {counted!r}: expected "
                              f"{want}, found {list(dims)}")  # fmt: skip
    experts = dims[0]
    gate0 = names.routed(layer, 0, names.gate, names.weight)
    dims = ckpt.shape(gate0)
    if len(dims) != 2 or dims[0] % TILE or dims[1] % TILE:
        raise CheckpointError(
            f"checkpoint {ckpt.source}: tensor {gate0!r}: expected [I, H], both multiples of "
            f"{TILE}, found {list(dims)}"
        )
    inter, hidden = dims
    if inter % (world * TILE):
        raise CheckpointError(
            f"inter {inter} does not split into {world} tensor-parallel slices of whole "
            f"{TILE}-column blocks (inter / world = {inter / world:g})"
        )
    shared_gate = (
        None if names.shared is None else names.shared_name(layer, names.gate, names.weight)
    )
    shared = shared_gate is not None and ckpt.has(shared_gate)
    if shape is not None:
        want = {"hidden": shape.hidden, "inter": shape.inter, "experts": shape.experts,
                "shared_experts": shape.shared_experts}  # fmt: skip
        found = {"hidden": hidden, "inter": inter // world, "experts": experts,
                 "shared_experts": int(shared)}  # fmt: skip
        if shape.shared_experts and not shared and shared_gate is not None:
            ckpt.file_of(shared_gate)  # names the missing tensor
        if found != want:
            raise CheckpointError(
                f"checkpoint {ckpt.source} layer {layer} (rank {rank} of {world}): "
                f"{found}; the artifact's shape has {want}"
            )
    return _Plan(hidden, inter, experts, shared, rank * (inter // world), inter // world)


def _expert(ckpt: Checkpoint, plan: _Plan, name) -> CheckpointWeights:
    """One expert's slice (E = 1); ``name(proj, param)`` -> tensor name, with
    ``proj`` one of gate/up/down and ``param`` weight/scale."""
    h, i, rows, blocks = plan.hidden, plan.inter, plan.rows, plan.blocks
    halves, scales = [], []
    for proj in ("gate", "up"):
        halves.append(ckpt.read(name(proj, "weight"), FP8, (i, h), rows=rows))
        scales.append(ckpt.read(name(proj, "scale"), torch.float32, (i // TILE, h // TILE),
                                rows=blocks))  # fmt: skip
    w2 = ckpt.read(name("down", "weight"), FP8, (h, i), cols=rows)
    s2 = ckpt.read(name("down", "scale"), torch.float32, (h // TILE, i // TILE), cols=blocks)
    w13 = torch.cat([t.view(torch.uint8) for t in halves], dim=0).view(FP8)
    return CheckpointWeights(
        w13=w13[None], w13_scale=torch.cat(scales, dim=0)[None], w2=w2[None], w2_scale=s2[None]
    )


def _experts(ckpt: Checkpoint, names: Names, layer: int, plan: _Plan
             ) -> Iterator[tuple[int | None, CheckpointWeights]]:  # fmt: skip
    """(expert index, slice) of every routed expert in order, then (None,
    the shared expert's slice) when the layer has one."""
    for e in range(plan.experts):

        def routed(proj, param, e=e):
            return names.routed(layer, e, getattr(names, proj), getattr(names, param))

        yield e, _expert(ckpt, plan, routed)
    if plan.shared:

        def shared(proj, param):
            return names.shared_name(layer, getattr(names, proj), getattr(names, param))

        yield None, _expert(ckpt, plan, shared)


def _bias(ckpt: Checkpoint, names: Names, layer: int, experts: int) -> torch.Tensor | None:
    if names.bias is None:
        return None
    bias = ckpt.read(names.bias_name(layer), (torch.float32, torch.bfloat16), (experts,))
    return bias.float().contiguous()


def read_layer(path, layer: int, rank: int = 0, world: int = 1,
               names: Names | str = DEEPSEEK_V3, shape: MoEShape | None = None
               ) -> CheckpointLayer:  # fmt: skip
    """Layer ``layer``'s slice for ``rank`` of ``world`` in checkpoint layout
    (w13 rows [gate; up] of this rank's width), on the CPU. ``shape``: the
    artifact's (shard) shape to check the layer against."""
    names = _names(names)
    with Checkpoint(path) as ckpt:
        plan = _plan(ckpt, names, layer, rank, world, shape)
        parts = dict(_experts(ckpt, names, layer, plan))
        bias = _bias(ckpt, names, layer, plan.experts)
    routed = [parts[e] for e in range(plan.experts)]
    stacked = CheckpointWeights(*(_stack([getattr(p, f) for p in routed]) for f in _FIELDS))
    return CheckpointLayer(routed=stacked, shared=parts.get(None), bias=bias)


def load_layer(path, layer: int, rank: int = 0, world: int = 1,
               names: Names | str = DEEPSEEK_V3, shape: MoEShape | None = None,
               device="cpu") -> LayerWeights:  # fmt: skip
    """Layer ``layer``'s slice for ``rank`` of ``world``, prepared for the
    kernels on ``device`` (module docstring); ``shape``: the artifact's
    (shard) shape to check against (``artifact.shape``), refused when the
    layer does not match it."""
    names = _names(names)
    device = torch.device(device)
    with Checkpoint(path) as ckpt:
        plan = _plan(ckpt, names, layer, rank, world, shape)
        routed = _empty(plan.experts, plan.hidden, plan.width, device)
        shared = _empty(1, plan.hidden, plan.width, device) if plan.shared else None
        for e, part in _experts(ckpt, names, layer, plan):
            moved = CheckpointWeights(*(getattr(part, f).to(device) for f in _FIELDS))
            ready = prepare(moved)
            into, at = (routed, e) if e is not None else (shared, 0)
            for f in _FIELDS:
                _bytes(getattr(into, f)[at]).copy_(_bytes(getattr(ready, f)[0]))
        bias = _bias(ckpt, names, layer, plan.experts)
        bias = None if bias is None else bias.to(device)
    return LayerWeights(MoEWeights(routed, shared), bias, plan.hidden, plan.width, plan.experts)


_FIELDS = ("w13", "w13_scale", "w2", "w2_scale")


def _empty(experts: int, hidden: int, inter: int, device) -> ExpertWeights:
    made = {name: torch.empty(dims, dtype=dtype, device=device)
            for name, (dtype, dims) in expert_shapes(experts, hidden, inter).items()}  # fmt: skip
    return ExpertWeights(**made)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    joined = torch.cat([_bytes(p) for p in parts], dim=0)
    return joined.view(FP8) if parts[0].dtype == FP8 else joined


__all__ = [
    "DEEPSEEK_V3",
    "FAMILIES",
    "QWEN3_MOE",
    "Checkpoint",
    "CheckpointError",
    "CheckpointLayer",
    "LayerWeights",
    "Names",
    "load_layer",
    "read_layer",
]
