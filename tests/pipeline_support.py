"""Shared helpers of the pipeline tests: run ``moe-build`` in-process, and
point the registry at the stand-in kernels (pure-Python stub or tiny DSL
kernel) with a private build cache per test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from pipeline.cli import main

REPO = Path(__file__).resolve().parent.parent
GLM5 = REPO / "configs" / "glm5.yaml"
PAIRS = ("mega/sm_90a", "mega/sm_100a", "grouped/sm_90a", "grouped/sm_100a")


def modules_env(module: str) -> str:
    return ",".join(f"{pair}={module}" for pair in PAIRS)


def use_stub(tmp_path, monkeypatch):
    """Every (kernel, arch) compiled by tests/pipeline_stub_kernel.py, a
    private cache, and a compile log (one line per real compile)."""
    log = tmp_path / "compiled.log"
    monkeypatch.setenv("MOE_BUILD_KERNEL_MODULES", modules_env("pipeline_stub_kernel"))
    monkeypatch.setenv("MOE_BUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MOE_BUILD_STUB_LOG", str(log))
    for key in ("MOE_BUILD_STUB_FAIL", "MOE_BUILD_STUB_CRASH", "MOE_BUILD_STUB_BAD_ABI"):
        monkeypatch.delenv(key, raising=False)
    return log


def compiled(log: Path) -> list[str]:
    """Names compiled so far (not served from the cache)."""
    return log.read_text().split() if log.exists() else []


def run(*args: str):
    """``moe-build ARGS`` in this process: (exit code, stdout, stderr)."""
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def build(out: Path, *extra: str, config: Path = GLM5) -> Path:
    code, stdout, stderr = run("compile", config, "-o", out, *extra)
    assert code == 0, stderr
    return out


def artifact_files(path: Path) -> dict[str, bytes]:
    """Every file of an artifact except the build record, by relative name."""
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "build-record.json"
    }


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def leftovers(parent: Path) -> list[str]:
    """Temporary build directories left beside the outputs."""
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def copy_config(tmp_path: Path, **model) -> Path:
    """configs/glm5.yaml with some model fields replaced."""
    import yaml

    raw = yaml.safe_load(GLM5.read_text())
    raw["model"].update(model)
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def copy_artifact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
