"""Seeds of the random tests: fresh each session, printed, and reproducible.

One base seed per test session: ``$MOE_TEST_SEED`` when set, else drawn from
``os.urandom`` (fresh random inputs every run). Each random draw gets its own
seed from the base and a stable name (by default the running test's node id),
so a test's seed does not depend on which other tests ran or in which order.
Every seed handed out is printed (pytest shows it with a failing test's
output) with the command line that reruns it::

    MOE_TEST_SEED=<base> pytest '<node id>'

Imports torch only when a generator is asked for (tests/gpu/one_call.py and
the kernels' GPU tests use it too).
"""

from __future__ import annotations

import hashlib
import os

ENV = "MOE_TEST_SEED"
_MASK = 2**31 - 1  # torch.Generator.manual_seed and random.Random take any int; keep it short


def _base() -> int:
    value = os.environ.get(ENV, "").strip()
    if value:
        return int(value, 0) & _MASK
    return int.from_bytes(os.urandom(4), "little") & _MASK


#: The session's base seed (``$MOE_TEST_SEED`` or fresh).
BASE = _base()


def current_test() -> str | None:
    """The running test's node id (``$PYTEST_CURRENT_TEST`` less its phase),
    None outside pytest."""
    running = os.environ.get("PYTEST_CURRENT_TEST")
    return running.rsplit(" (", 1)[0] if running else None


def seed_for(name: str | None = None, base: int | None = None) -> int:
    """The seed of draw ``name`` (default: the running test's node id) under
    ``base`` (default: the session's), a pure function of the two."""
    name = name or current_test()
    if name is None:
        raise RuntimeError("no test is running: name the draw")
    base = BASE if base is None else base
    digest = hashlib.sha256(f"{base}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK


def rerun_hint() -> str:
    """The command that reruns the running test with this session's seeds
    (for assertion messages)."""
    test = current_test()
    return f"{ENV}={BASE} pytest '{test}'" if test else f"{ENV}={BASE}"


def seed(name: str | None = None) -> int:
    """``seed_for(name)``, printed with the command that reruns it."""
    value = seed_for(name)
    print(f"random seed {value} for {name or current_test()}; rerun: {rerun_hint()}")
    return value


def generator(name: str | None = None, device="cpu"):
    """A torch.Generator on ``device`` seeded with ``seed(name)``."""
    import torch

    return torch.Generator(device).manual_seed(seed(name))


def seed_torch(name: str | None = None) -> int:
    """Seeds torch's default generators (CPU and every CUDA device) with
    ``seed(name)``, for code that draws without a generator; returns it."""
    import torch

    value = seed(name)
    torch.manual_seed(value)
    return value
