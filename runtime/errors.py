"""Why the runtime refuses: every refusal happens before any launch and names
what was checked, what was expected and what was found."""

from __future__ import annotations


class RuntimeRefusal(Exception):
    """Base of every refusal the runtime raises on purpose."""


class ArtifactError(RuntimeRefusal):
    """The artifact is malformed, corrupted, incomplete or unsafe to unpack."""


class DeviceRefused(RuntimeRefusal):
    """The device or driver cannot run a variant (arch, driver version,
    residency of a persistent grid, shared memory)."""


class InputError(RuntimeRefusal, ValueError):
    """A call's tensors do not match what the bound variants take."""


class DriverError(RuntimeRefusal):
    """A CUDA driver call failed; the message names the call and the result."""
