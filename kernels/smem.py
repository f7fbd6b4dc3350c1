"""One builder for the kernels' shared-memory layouts (pure Python).

A layout is a sequence of named regions taken in order from the 1024-aligned
dynamic shared-memory base, each at the next multiple of its alignment. The
plans (``grouped_plan``, ``mega_plan``) describe their layouts with it, so
every kernel's offsets, total size and region table (the compile notes'
``smem_layout``: name -> [offset, bytes]) come from one piece of code.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Regions:
    """Regions taken in order; ``take`` returns a region's offset."""

    offsets: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    end: int = 0

    def take(self, name: str, size: int, align: int = 16) -> int:
        """Places ``size`` bytes named ``name`` at the next multiple of ``align``."""
        if name in self.offsets:
            raise ValueError(f"shared-memory region {name!r} taken twice")
        if size < 0 or align < 1:
            raise ValueError(f"region {name!r}: size {size} and alignment {align}")
        start = ceil_div(self.end, align) * align
        self.offsets[name], self.sizes[name] = start, size
        self.end = start + size
        return start

    def table(self) -> dict[str, list[int]]:
        """name -> [offset, bytes], in address order (the compile notes' form)."""
        return {n: [self.offsets[n], self.sizes[n]] for n in self.offsets}
