"""``moe-build inspect``: what an artifact holds, as a table; and the SASS of
one variant through the CUDA binary utilities (cuobjdump, or nvdisasm).

The tools come from the nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels
(the ``compile`` extra) or from PATH.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.artifacts import open_artifact


class ToolMissing(RuntimeError):
    """A CUDA binary utility is not installed (message says how to get it)."""


COLUMNS = (
    ("variant", lambda v: v["name"]),
    ("entry", lambda v: v["entry"]),
    ("grid", lambda v: _dims(v["launch"]["grid"])),
    ("block", lambda v: _dims(v["launch"]["block"])),
    ("cluster", lambda v: _dims(v["launch"]["cluster"]) if v["launch"]["cluster"] else "-"),
    ("smem", lambda v: str(v["launch"]["smem"])),
    ("pdl", lambda v: "y" if v["launch"]["pdl"] else "n"),
    ("regs", lambda v: str(v.get("resources", {}).get("registers", "?"))),
    ("local", lambda v: str(v.get("resources", {}).get("local_bytes", "?"))),
    ("spills", lambda v: _opt(v.get("resources", {}).get("spills"))),
    ("static", lambda v: str(v.get("resources", {}).get("static_smem", "?"))),
    ("params", lambda v: str(len(v["params"]))),
    ("workspace", lambda v: str(sum(w["bytes"] for w in v["workspace"]))),
    ("cubin", lambda v: str(v["size"])),
)


def _dims(d) -> str:
    return "x".join(str(x) for x in d)


def _opt(x) -> str:
    return "?" if x is None else str(x)


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned text table."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(manifest: dict) -> str:
    """Header lines and the variant table of a manifest."""
    tc = manifest["toolchain"]
    head = [
        f"config      {manifest['config'].get('name', '?')}  (sha256 {manifest['config_hash'][:16]})",
        "toolchain   " + ", ".join(f"{k} {v}" for k, v in sorted(tc.items())),
        f"min driver  {manifest['min_driver']}",
        f"variants    {len(manifest['variants'])}",
    ]
    if manifest.get("shard"):
        s = manifest["shard"]
        head.append(f"shard       {s['index']}/{s['count']} of {len(s['selection'])} variants")
    rows = [[f(v) for _, f in COLUMNS] for v in manifest["variants"]]
    return "\n".join(head) + "\n\n" + table(rows, [c for c, _ in COLUMNS])


def find_tool(name: str) -> str:
    """Path of a CUDA binary utility: PATH first, then the nvidia-* wheels."""
    found = shutil.which(name)
    if found:
        return found
    for base in sys.path:
        for path in sorted(glob.glob(os.path.join(base, "nvidia", "*", "bin", name))):
            if os.access(path, os.X_OK):
                return path
    raise ToolMissing(
        f"{name} not found: install the 'compile' extra (nvidia-cuda-cuobjdump, "
        "nvidia-cuda-nvdisasm) or put the CUDA toolkit's bin on PATH"
    )


def sass(path: str | Path, variant: str) -> str:
    """SASS of one variant of the artifact at ``path``."""
    with open_artifact(path) as opened:
        match = [v for v in opened.data.variants if v.name == variant]
        if not match:
            names = ", ".join(v.name for v in opened.data.variants)
            raise KeyError(f"no variant {variant!r} in {path} (has: {names})")
        cubin = match[0].cubin
    tool = find_tool("cuobjdump")
    with tempfile.TemporaryDirectory(prefix="moe-build-sass-") as tmp:
        file = Path(tmp) / f"{variant}.cubin"
        file.write_bytes(cubin)
        done = subprocess.run([tool, "--dump-sass", str(file)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


__all__ = ["ToolMissing", "find_tool", "sass", "summary", "table"]
