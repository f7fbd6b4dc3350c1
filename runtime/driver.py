"""Thin wrappers over the CUDA driver API (cuda.bindings), each checking its
result: a failure raises DriverError naming the call and the CUresult.

Only what the runtime needs: device facts, primary contexts, libraries and
functions, function attributes, occupancy, raw allocations (workspaces)
and their zeroing and reading back (the diagnostics reader
``benchmarks/grouped_timeline.py``),
``cuLaunchKernelEx``, and the stream-capture queries and user objects that
tie a captured launch's resources to its graph (runtime.graphs). Devices are CUDA ordinals (torch's ``device.index``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading

from cuda.bindings import driver as cu

from runtime.errors import DriverError

#: Serializes allocation and freeing; re-entrant, because a garbage collection
#: inside ``alloc`` can run a finalizer that frees.
_lock = threading.RLock()


def check(result, call: str):
    """Unwraps a cuda.bindings ``(CUresult, *values)`` tuple."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)
        text = name[1].decode() if name[0] == cu.CUresult.CUDA_SUCCESS else str(err)
        raise DriverError(f"{call} failed: {text} ({int(err)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def init() -> None:
    check(cu.cuInit(0), "cuInit")


def driver_version() -> int:
    """``cuDriverGetVersion`` form, e.g. 13000 for CUDA 13.0."""
    init()
    return check(cu.cuDriverGetVersion(), "cuDriverGetVersion")


def device_count() -> int:
    init()
    return check(cu.cuDeviceGetCount(), "cuDeviceGetCount")


@functools.cache
def device(ordinal: int):
    init()
    return check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")


def attribute(ordinal: int, attr: str) -> int:
    """A ``CU_DEVICE_ATTRIBUTE_<attr>`` of a device."""
    which = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{attr}")
    return check(cu.cuDeviceGetAttribute(which, device(ordinal)), f"cuDeviceGetAttribute({attr})")


def capability(ordinal: int) -> tuple[int, int]:
    return (attribute(ordinal, "COMPUTE_CAPABILITY_MAJOR"),
            attribute(ordinal, "COMPUTE_CAPABILITY_MINOR"))  # fmt: skip


def sm_count(ordinal: int) -> int:
    return attribute(ordinal, "MULTIPROCESSOR_COUNT")


def max_smem_optin(ordinal: int) -> int:
    """Largest dynamic + static shared memory a block may opt in to, bytes."""
    return attribute(ordinal, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")


@functools.cache
def primary_context(ordinal: int):
    """The device's primary context (the one torch uses), retained for the
    life of the process."""
    return check(cu.cuDevicePrimaryCtxRetain(device(ordinal)), "cuDevicePrimaryCtxRetain")


@functools.cache
def _primary_handle(ordinal: int) -> int:
    return int(primary_context(ordinal))


def context_is_current(ordinal: int) -> bool:
    """Whether the device's primary context is this thread's current context
    (one ``cuCtxGetCurrent``; ``context`` costs a push and a pop)."""
    current = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    return int(current) == _primary_handle(ordinal)


@contextlib.contextmanager
def context(ordinal: int):
    """The device's primary context pushed for the duration of the block."""
    check(cu.cuCtxPushCurrent(primary_context(ordinal)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")


def load_library(cubin: bytes):
    """``cuLibraryLoadData``: context-independent, no JIT options (a cubin,
    never PTX)."""
    init()
    return check(cu.cuLibraryLoadData(cubin, None, None, 0, None, None, 0), "cuLibraryLoadData")


def unload_library(library) -> None:
    check(cu.cuLibraryUnload(library), "cuLibraryUnload")


def library_kernel(library, entry: str):
    return check(cu.cuLibraryGetKernel(library, entry.encode()), f"cuLibraryGetKernel({entry})")


def kernel_function(kernel, ordinal: int):
    """The kernel's function in the device's primary context."""
    with context(ordinal):
        return check(cu.cuKernelGetFunction(kernel), "cuKernelGetFunction")


def function_attribute(function, attr: str) -> int:
    which = getattr(cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attr}")
    return check(cu.cuFuncGetAttribute(which, function), f"cuFuncGetAttribute({attr})")


def set_function_attribute(function, attr: str, value: int) -> None:
    which = getattr(cu.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attr}")
    check(cu.cuFuncSetAttribute(function, which, value), f"cuFuncSetAttribute({attr}={value})")


def launch_config(grid, block, smem: int, cluster=None, pdl: bool = False,
                  cooperative: bool = False):  # fmt: skip
    """A ``CUlaunchConfig`` (stream left 0) with programmatic stream
    serialization = ``pdl``, for clustered launches the cluster shape, and
    with ``cooperative`` the cooperative attribute (the driver starts the
    grid only with all its CTAs resident at once, or fails the launch)."""
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    attrs = []
    serialize = cu.CUlaunchAttribute()
    serialize.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    serialize.value.programmaticStreamSerializationAllowed = int(pdl)
    attrs.append(serialize)
    if cooperative:
        together = cu.CUlaunchAttribute()
        together.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        together.value.cooperative = 1
        attrs.append(together)
    if cluster is not None:
        shape = cu.CUlaunchAttribute()
        shape.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        shape.value.clusterDim.x, shape.value.clusterDim.y, shape.value.clusterDim.z = cluster
        attrs.append(shape)
    config.attrs = attrs
    config.numAttrs = len(attrs)
    return config


def max_active_blocks(function, threads: int, smem: int, ordinal: int) -> int:
    """Resident blocks per SM of a non-clustered launch."""
    with context(ordinal):
        return check(
            cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, smem),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )


def max_active_clusters(function, config, ordinal: int) -> int:
    """Clusters of ``config``'s shape that can be resident on the whole device."""
    with context(ordinal):
        return check(cu.cuOccupancyMaxActiveClusters(function, config),
                     "cuOccupancyMaxActiveClusters")  # fmt: skip


def launch(function, config, stream: int, params_address: int) -> None:
    """``cuLaunchKernelEx`` on ``stream`` (a raw CUstream handle);
    ``params_address``: a ``void*[]`` with one pointer per kernel parameter."""
    config.hStream = cu.CUstream(stream)
    check(cu.cuLaunchKernelEx(config, function, params_address, 0), "cuLaunchKernelEx")


@contextlib.contextmanager
def relaxed_capture():
    """Lets this thread allocate while some stream is being captured (the
    allocation is not part of any graph)."""
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    previous = check(
        cu.cuThreadExchangeStreamCaptureMode(mode), "cuThreadExchangeStreamCaptureMode"
    )
    try:
        yield
    finally:
        check(cu.cuThreadExchangeStreamCaptureMode(previous), "cuThreadExchangeStreamCaptureMode")


def alloc(ordinal: int, nbytes: int, zero: bool) -> int:
    """Device memory outside any capture and outside torch's allocator;
    zero-filled (and finished) before returning when ``zero``. Nothing leaks
    when a step fails: the memory is freed before the error propagates."""
    with _lock, relaxed_capture(), context(ordinal):
        pointer = check(cu.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})")
        try:
            if zero:
                _memset_zero(pointer, nbytes)
        except BaseException:
            cu.cuMemFree(pointer)
            raise
        return int(pointer)


def zero(ordinal: int, pointer: int, nbytes: int) -> None:
    """Zero-fills ``nbytes`` of device memory at ``pointer`` and waits for it
    (on a private stream, outside any capture in flight)."""
    with relaxed_capture(), context(ordinal):
        _memset_zero(cu.CUdeviceptr(pointer), nbytes)


def copy_to_host(ordinal: int, pointer: int, nbytes: int) -> bytes:
    """``nbytes`` of device memory at ``pointer``, copied to the host
    (``cuMemcpyDtoH``: synchronous)."""
    out = (ctypes.c_char * nbytes)()
    with context(ordinal):
        check(cu.cuMemcpyDtoH(ctypes.addressof(out), cu.CUdeviceptr(pointer), nbytes),
              "cuMemcpyDtoH")  # fmt: skip
    return out.raw


def _memset_zero(pointer, nbytes: int) -> None:
    # A private stream: the legacy stream would join a capture in flight.
    flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
    stream = check(cu.cuStreamCreate(flags), "cuStreamCreate")
    try:
        check(cu.cuMemsetD8Async(pointer, 0, nbytes, stream), "cuMemsetD8Async")
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    finally:
        check(cu.cuStreamDestroy(stream), "cuStreamDestroy")


def free(ordinal: int, pointer: int) -> None:
    """``cuMemFree`` in relaxed capture mode: a free that runs while another
    thread captures a graph (a garbage collection, say) neither fails nor
    invalidates that capture."""
    with _lock, relaxed_capture(), context(ordinal):
        check(cu.cuMemFree(cu.CUdeviceptr(pointer)), "cuMemFree")


def capturing_graph(stream: int):
    """The ``CUgraph`` that ``stream`` (a raw CUstream handle) is being
    captured into, or None when it is not capturing."""
    result = cu.cuStreamGetCaptureInfo(cu.CUstream(stream))
    check(result[:2], "cuStreamGetCaptureInfo")
    if result[1] != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return None
    return result[3]


def retain_in_graph(graph, key: int, destroy) -> None:
    """Creates a user object whose destructor is ``destroy(key)`` (a ``CUhostFn``
    address; it runs on a driver thread and may not call CUDA) and moves its
    one reference into ``graph``: the destructor runs once the graph and
    every executable graph instantiated from it are destroyed."""
    flags = cu.CUuserObject_flags.CU_USER_OBJECT_NO_DESTRUCTOR_SYNC
    obj = check(cu.cuUserObjectCreate(key, cu.CUhostFn(destroy), 1, flags), "cuUserObjectCreate")
    move = cu.CUuserObjectRetain_flags.CU_GRAPH_USER_OBJECT_MOVE
    check(cu.cuGraphRetainUserObject(graph, obj, 1, move), "cuGraphRetainUserObject")
