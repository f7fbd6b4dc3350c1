"""``load(path)``: a verified artifact's cubins for this device's arch, loaded
into the driver; ``Artifact.bind(weights)``: a layer on one device.

Order of checks, all before any launch: the artifact's integrity (schema,
config hash, every cubin's hashes: runtime.artifact), the device's arch
(sm_90a for compute capability 9.0, sm_100a for 10.0) and the artifact's
variants for it, the driver version against ``min_driver``; then at bind, per
device: each function's shared memory, block size and residency
(runtime.launch), every parameter being one the runtime can fill, and the
weights' dtypes, shapes, device, layout and alignment.
"""

from __future__ import annotations

import os
import threading

import torch

from runtime import driver, graphs, tensormap
from runtime.artifact import ArtifactData, Variant, read
from runtime.constants import ARCH_OF
from runtime.errors import ArtifactError, DeviceRefused
from runtime.inputs import check_weights
from runtime.launch import Launcher
from runtime.model import MoEShape
from runtime.moe import MoELayer, fillable
from runtime.workspace import Workspaces

#: Kernels whose CTAs wait on each other: their whole grid must be resident.
PERSISTENT = ("grouped",)


def arch_of(capability: tuple[int, int]) -> str:
    try:
        return ARCH_OF[tuple(capability)]
    except KeyError:
        known = ", ".join(f"{a} (compute capability {c[0]}.{c[1]})" for c, a in ARCH_OF.items())
        raise DeviceRefused(
            f"compute capability {capability[0]}.{capability[1]}: no arch of this runtime "
            f"runs there (known: {known})"
        ) from None


def select(data: ArtifactData, arch: str) -> tuple[Variant, ...]:
    """The artifact's variants for ``arch``; refuses an artifact without any."""
    chosen = data.for_arch(arch)
    if not chosen:
        present = sorted({v.arch for v in data.variants}) or ["none"]
        raise DeviceRefused(
            f"artifact {data.source}: no variant for {arch} (this device); "
            f"it holds {', '.join(present)}"
        )
    return chosen


def check_driver(data: ArtifactData, found: int) -> None:
    if found < data.min_driver:
        raise DeviceRefused(
            f"artifact {data.source}: needs CUDA driver API version >= {data.min_driver} "
            f"(manifest min_driver); this driver is {found}"
        )


def model_shape(data: ArtifactData) -> MoEShape:
    try:
        return MoEShape(**data.config["model"])
    except (KeyError, TypeError) as e:
        raise ArtifactError(
            f"artifact {data.source}: config.model is not an MoE shape ({e})"
        ) from e


def load(path: str | os.PathLike, device=None) -> Artifact:
    """Verifies and loads the artifact at ``path`` (directory or .tar.zst) for
    the arch of ``device`` (default: torch's current CUDA device)."""
    data = read(path)
    ordinal = _ordinal(device)
    arch = arch_of(driver.capability(ordinal))
    variants = select(data, arch)
    check_driver(data, driver.driver_version())
    return Artifact(data, arch, variants)


class Artifact:
    """Loaded cubins of one arch (``cuLibraryLoadData``: context-independent,
    shared by every device and layer); per device, their checked functions
    and the workspaces every layer bound there shares per stream."""

    def __init__(self, data: ArtifactData, arch: str, variants: tuple[Variant, ...]):
        self.data, self.arch, self.variants = data, arch, variants
        self.shape = model_shape(data)
        self.libraries = {}
        try:
            for v in variants:
                self.libraries[v.name] = driver.load_library(v.cubin)
        except BaseException:
            for library in self.libraries.values():
                driver.unload_library(library)
            raise
        self._launchers: dict[tuple[str, int], Launcher] = {}
        self._workspaces: dict[int, Workspaces] = {}
        self._lock = threading.Lock()

    @property
    def manifest(self) -> dict:
        return self.data.manifest

    def bind(self, weights, device=None, table=None, poison: bool = False) -> MoELayer:
        """A layer over ``weights`` (``runtime.layout.MoEWeights``) on ``device``
        (default: where the weights are). See ``runtime.moe.MoELayer``."""
        if device is None:
            device = getattr(getattr(weights, "routed", None), "w13", torch.empty(0)).device
        device = torch.device(device)
        if device.type != "cuda":
            raise DeviceRefused(f"bind: expected a CUDA device, found {device}")
        device = torch.device("cuda", _ordinal(device))
        found = arch_of(driver.capability(device.index))
        if found != self.arch:
            raise DeviceRefused(
                f"bind: this artifact was loaded for {self.arch}; device {device} is {found}"
            )
        tensors = check_weights(weights, self.shape, device)
        for v in self.variants:
            missing = fillable(v, tensors)
            if missing:
                raise ArtifactError(
                    f"variant {v.name}: parameters the runtime cannot fill: {', '.join(missing)}"
                )
        return MoELayer(self, tensors, self.shape, device, table=table, poison=poison)

    def launcher(self, variant: Variant, ordinal: int) -> Launcher:
        key = (variant.name, ordinal)
        with self._lock:
            if key not in self._launchers:
                self._launchers[key] = Launcher(
                    variant, self.libraries[variant.name], ordinal, variant.kernel in PERSISTENT
                )
            return self._launchers[key]

    def workspaces(self, ordinal: int) -> Workspaces:
        found = self._workspaces.get(ordinal)
        if found is None:
            with self._lock:
                found = self._workspaces.setdefault(ordinal, Workspaces(ordinal))
        return found

    def tensor_maps(self, tensors: dict, names: tuple[str, ...], device: torch.device):
        return tensormap.build(tensors, names, device)

    def close(self) -> None:
        """Frees the workspaces and unloads the libraries; layers bound from
        this artifact must not be called afterwards. Refused (ArtifactError)
        while a CUDA graph that captured one of its layers still exists:
        destroy those graphs first (runtime.graphs)."""
        graphs.release()
        live = graphs.holding(lambda owner: getattr(owner, "artifact", None) is self)
        if live:
            raise ArtifactError(
                f"artifact {self.data.source}: {live} captured CUDA graph launch(es) still use "
                "its kernels and workspaces; destroy those graphs before close()"
            )
        with self._lock:
            for spaces in self._workspaces.values():
                spaces.close()
            self._workspaces.clear()
            self._launchers.clear()
            for library in self.libraries.values():
                driver.unload_library(library)
            self.libraries = {}


def _ordinal(device) -> int:
    """The CUDA ordinal of ``device`` (None or an unindexed "cuda": torch's
    current device); refuses a device the driver does not see."""
    if device is None:
        if not torch.cuda.is_available():
            raise DeviceRefused("no CUDA device is visible to torch")
        return torch.cuda.current_device()
    device = torch.device(device)
    if device.type != "cuda":
        raise DeviceRefused(f"expected a CUDA device, found {device}")
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    count = driver.device_count()
    if ordinal >= count:
        raise DeviceRefused(f"{device}: no such device; the driver sees {count} CUDA devices")
    return ordinal
