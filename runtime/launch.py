"""One variant's function on one device, checked and ready to launch.

Binding resolves the function (``cuLibraryGetKernel`` + ``cuKernelGetFunction``
in the device's primary context), sets its dynamic shared memory limit (and
the non-portable cluster size above 8 CTAs), and refuses a device that cannot
run it: shared memory beyond the opt-in limit, a block larger than the
function allows, no block or cluster that fits on an SM, or, for a persistent
kernel (its CTAs wait on each other), a grid that cannot be fully resident or
a device without cooperative launches.

A persistent kernel is launched cooperatively: the driver starts its grid
only when every CTA can be resident at once, whatever else the GPU runs
(kernels on other streams, another persistent launch, MPS clients), so its
CTAs never wait on a CTA that is not running. Without it, two persistent
launches on two streams, or one beside another stream's kernel, can each
hold part of the SMs and wait forever for the rest.

A launch is ``cuLaunchKernelEx`` with the recorded grid, block, cluster and
dynamic shared memory, programmatic stream serialization = the record's
``pdl``, and ``kernelParams`` = an array of pointers to each parameter's value
(``Parameters``; the driver copies each parameter's declared size, 8 bytes for
pointers and 4 for i32, when the call is made). Nothing is allocated per
launch, so a launch is safe under CUDA graph capture (the graph node keeps
copies of the values), and a parameter block may be rewritten as soon as the
launch returns: a caller may keep one block per (variant, stream) filled with
what does not change between calls and rewrite only the rest
(``runtime.moe.CallPlan``).
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading

from runtime import driver
from runtime.artifact import Variant
from runtime.errors import DeviceRefused

#: Portable cluster size limit; larger clusters need NON_PORTABLE_CLUSTER_SIZE_ALLOWED.
PORTABLE_CLUSTER = 8


class Parameters:
    """One launch's parameter block: ``values`` holds one 8-byte slot per
    kernel parameter in ABI order (a pointer's device address; an i32 in the
    slot's low 4 bytes, little-endian), ``address`` is the ``void*[]`` of the
    slots' addresses that ``cuLaunchKernelEx`` reads. Both live as long as
    this object; ``slot(i, value)`` and ``fill`` write values."""

    def __init__(self, kinds):
        if sys.byteorder != "little":
            raise DeviceRefused("the launcher stores i32 parameters little-endian")
        self.kinds = tuple(kinds)
        n = len(self.kinds)
        self.values = (ctypes.c_uint64 * max(n, 1))()
        base = ctypes.addressof(self.values)
        self._pointers = (ctypes.c_void_p * max(n, 1))(*(base + 8 * i for i in range(n)))
        self.address = ctypes.addressof(self._pointers)

    def slot(self, i: int, value: int) -> None:
        """Parameter ``i`` = ``value`` (an i32 keeps its low 32 bits)."""
        self.values[i] = value & 0xFFFFFFFF if self.kinds[i] == "i32" else value

    def fill(self, values) -> None:
        """Parameters 0, 1, ... = ``values`` (ints, ABI order)."""
        for i, value in enumerate(values):
            self.slot(i, value)


class Launcher:
    """``launcher(stream, values)`` launches the variant; ``values``: one int per
    parameter in ABI order (device addresses for pointers, i32 scalars).
    ``launcher.launch(stream, parameters)`` launches with a block the caller
    filled. One launch at a time per launcher (a lock): the launch
    configuration's stream field is shared by all its callers."""

    def __init__(self, variant: Variant, library, ordinal: int, persistent: bool):
        self.variant, self.ordinal = variant, ordinal
        self.names = tuple(name for name, _ in variant.params)
        self.kinds = tuple(kind for _, kind in variant.params)
        self._parameters = Parameters(self.kinds)  # refuses a big-endian host first
        launch = variant.launch
        kernel = driver.library_kernel(library, variant.entry)
        self.function = driver.kernel_function(kernel, ordinal)
        self._configure(launch)
        if persistent and not driver.attribute(ordinal, "COOPERATIVE_LAUNCH"):
            raise DeviceRefused(
                f"variant {variant.name}: a persistent kernel needs cooperative launches; "
                f"device {ordinal} does not support them"
            )
        self.config = driver.launch_config(
            launch.grid, launch.block, launch.smem, launch.cluster, launch.pdl,
            cooperative=persistent,
        )  # fmt: skip
        self.residency = self._check_residency(launch, persistent)
        self._lock = threading.Lock()

    def _configure(self, launch) -> None:
        v, ordinal = self.variant, self.ordinal
        static = driver.function_attribute(self.function, "SHARED_SIZE_BYTES")
        optin = driver.max_smem_optin(ordinal)
        if launch.smem + static > optin:
            raise DeviceRefused(
                f"variant {v.name}: needs {launch.smem} B dynamic + {static} B static shared "
                f"memory per block; device {ordinal} allows {optin} B"
            )
        threads = math.prod(launch.block)
        most = driver.function_attribute(self.function, "MAX_THREADS_PER_BLOCK")
        if threads > most:
            raise DeviceRefused(
                f"variant {v.name}: block of {threads} threads; the function allows {most} "
                f"on device {ordinal}"
            )
        driver.set_function_attribute(self.function, "MAX_DYNAMIC_SHARED_SIZE_BYTES", launch.smem)
        if launch.cluster is not None and math.prod(launch.cluster) > PORTABLE_CLUSTER:
            driver.set_function_attribute(self.function, "NON_PORTABLE_CLUSTER_SIZE_ALLOWED", 1)

    def _check_residency(self, launch, persistent: bool) -> int:
        """How many CTAs can be resident at once; refuses a launch that cannot
        start, or a persistent grid that cannot be resident all at once."""
        v, ordinal = self.variant, self.ordinal
        ctas = math.prod(launch.grid)
        threads = math.prod(launch.block)
        if launch.cluster is not None:
            size = math.prod(launch.cluster)
            clusters = driver.max_active_clusters(self.function, self.config, ordinal)
            resident = clusters * size
            what = f"{clusters} clusters of {size} CTAs"
        else:
            per_sm = driver.max_active_blocks(self.function, threads, launch.smem, ordinal)
            sms = driver.sm_count(ordinal)
            resident = per_sm * sms
            what = f"{per_sm} CTAs per SM x {sms} SMs"
        if resident < 1:
            raise DeviceRefused(
                f"variant {v.name}: not one CTA (block {list(launch.block)}, {launch.smem} B "
                f"dynamic smem, cluster {launch.cluster}) fits on device {ordinal}"
            )
        if persistent and resident < ctas:
            raise DeviceRefused(
                f"variant {v.name}: persistent grid of {ctas} CTAs (compiled for {v.sms} SMs) "
                f"must be fully resident; device {ordinal} holds {resident} ({what})"
            )
        return resident

    def __call__(self, stream: int, values) -> None:
        with self._lock:
            self._parameters.fill(values)
            driver.launch(self.function, self.config, stream, self._parameters.address)

    def launch(self, stream: int, parameters: Parameters) -> None:
        """Launches on ``stream`` (a raw CUstream handle) with ``parameters``
        (this variant's kinds, every slot filled), which the caller leaves
        unchanged until this returns."""
        with self._lock:
            driver.launch(self.function, self.config, stream, parameters.address)
