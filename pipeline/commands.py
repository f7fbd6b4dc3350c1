"""What each ``moe-build`` command does between parsing and exiting: call one
module, turn its exceptions into clear messages on stderr, return the exit
status. Exit statuses: 0 success, 1 the work ran and failed (a variant did
not compile, an artifact did not verify, a diff found ABI or launch changes),
2 bad input (config, option, path, unreadable or corrupted artifact).
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from pipeline.build import BuildError, BuildRequest, SelectionError, Shard, build
from pipeline.cache import BuildCache, default_dir
from pipeline.output import OutputError
from pipeline.progress import Progress
from pipeline.toolchain import ToolchainError

OK, FAILED, BAD_INPUT = 0, 1, 2


def _error(text: str) -> None:
    for line in text.splitlines() or [""]:
        click.echo(f"error: {line}", err=True)


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def compile_config(cfg, out, archs, kernels, jobs, shard, cache_dir, no_cache, as_json) -> int:
    try:
        shard = Shard.parse(shard) if shard else None
    except ValueError as exc:
        _error(f"--shard: {exc}")
        return BAD_INPUT
    cache = BuildCache(None if no_cache else (cache_dir or default_dir()))
    req = BuildRequest(
        config=cfg,
        out=Path(out) if out else Path("artifacts") / cfg.name,
        archs=tuple(archs),
        kernels=tuple(kernels),
        jobs=jobs or default_jobs(),
        shard=shard,
        cache=cache,
    )
    progress = Progress.auto(as_json)
    try:
        path = build(req, progress)
    except SelectionError as exc:
        _error(str(exc))
        return BAD_INPUT
    except (OutputError, ToolchainError) as exc:
        _error(str(exc))
        progress.finish(False, None)
        return BAD_INPUT
    except BuildError as exc:
        _error(f"{len(exc.problems)} variant(s) failed; nothing was written")
        _error(str(exc))
        progress.finish(False, None)
        return FAILED
    progress.finish(True, str(path))
    return OK
