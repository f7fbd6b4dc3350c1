"""What each ``moe-build`` command does between parsing and exiting: call one
module, turn its exceptions into clear messages on stderr, return the exit
status. Exit statuses: 0 success, 1 the work ran and failed (a variant did
not compile, an artifact did not verify, a diff found ABI or launch changes),
2 bad input (config, option, path, unreadable or corrupted artifact).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import click

from pipeline.build import BuildError, BuildRequest, SelectionError, Shard, VariantsFailed, build
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


def compile_config(cfg, out, archs, kernels, patterns, jobs, shard, cache_dir, no_cache,
                   as_json) -> int:  # fmt: skip
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
        patterns=tuple(patterns),
        jobs=jobs or default_jobs(),
        shard=shard,
        cache=cache,
    )
    progress = Progress.auto(as_json)
    # A CI job cancelled with SIGTERM unwinds like Ctrl-C: the temporary
    # build directory is removed and the workers are stopped.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        path = build(req, progress)
    except SelectionError as exc:
        _error(str(exc))
        return BAD_INPUT
    except (OutputError, ToolchainError) as exc:
        _error(str(exc))
        progress.finish(False, None)
        return BAD_INPUT
    except VariantsFailed as exc:
        progress.finish(False, None)
        _error(f"{len(exc.failures)} variant(s) failed; nothing was written:")
        for text in exc.grouped():
            _error(text)
        return FAILED
    except BuildError as exc:
        progress.finish(False, None)
        _error(str(exc))
        return FAILED
    except KeyboardInterrupt as exc:
        progress.finish(False, None)
        written = getattr(exc, "written", None)
        _error(f"interrupted after the new artifact was written to {written}" if written
               else "interrupted; nothing was written")  # fmt: skip
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    progress.finish(True, str(path))
    return OK


def _terminated(signum, frame):
    raise KeyboardInterrupt


def merge(inputs, out) -> int:
    from pipeline.merge import ArtifactError, MergeError, merge

    try:
        path = merge(list(inputs), out)
    except (ArtifactError, MergeError, OutputError) as exc:
        _error(str(exc))
        return BAD_INPUT
    click.echo(f"wrote {path}")
    return OK


def package(artifact, out) -> int:
    from pipeline.package import ArtifactError, PackageError, package

    try:
        path = package(artifact, out)
    except (ArtifactError, PackageError) as exc:
        _error(str(exc))
        return BAD_INPUT
    click.echo(f"wrote {path} ({path.stat().st_size} bytes)")
    return OK


def inspect(artifact, variant, as_json) -> int:
    from pipeline.artifacts import ArtifactError, open_artifact
    from pipeline.inspection import ToolMissing, sass, summary
    from runtime.artifact import canonical_json

    try:
        if variant:
            click.echo(sass(artifact, variant), nl=False)
            return OK
        with open_artifact(artifact) as opened:
            manifest = opened.manifest
    except (ArtifactError, KeyError, ToolMissing, RuntimeError) as exc:
        _error(exc.args[0] if isinstance(exc, KeyError) else str(exc))
        return BAD_INPUT
    click.echo(canonical_json(manifest) if as_json else summary(manifest), nl=not as_json)
    return OK


def verify(artifact, device, ordinal, as_json) -> int:
    import json

    from pipeline.artifacts import ArtifactError
    from pipeline.verify import verify_offline

    try:
        manifest, problems = verify_offline(artifact)
    except ArtifactError as exc:
        _error(str(exc))
        return BAD_INPUT
    result = {"artifact": str(artifact), "variants": len(manifest["variants"]),
              "problems": problems}  # fmt: skip
    if device and not problems:
        from pipeline.verify_device import DeviceUnavailable, verify_device

        try:
            record, path, device_problems = verify_device(artifact, ordinal)
        except DeviceUnavailable as exc:
            _error(str(exc))
            return BAD_INPUT
        problems += device_problems
        result["device"] = record.get("device")
        result["record"] = str(path) if path else None
    if as_json:
        click.echo(json.dumps(result, indent=1, sort_keys=True))
    else:
        for line in problems:
            click.echo(f"FAIL {line}")
        verdict = "OK" if not problems else f"{len(problems)} problem(s)"
        where = f"; wrote {result['record']}" if result.get("record") else ""
        click.echo(f"{artifact}: {len(manifest['variants'])} variants: {verdict}{where}")
    return OK if not problems else FAILED


def diff(a, b, as_json) -> int:
    import json

    from pipeline.artifacts import ArtifactError, open_artifact
    from pipeline.diffing import diff_manifests, relevant, render, to_json

    try:
        with open_artifact(a) as oa, open_artifact(b) as ob:
            changes = diff_manifests(oa.manifest, ob.manifest, oa.extra_records(),
                                     ob.extra_records())  # fmt: skip
    except ArtifactError as exc:
        _error(str(exc))
        return BAD_INPUT
    except RecursionError:  # json.loads of a verify-*.json record nested past its limit
        _error(f"{a} or {b}: a verify-*.json record nests too deeply to read")
        return BAD_INPUT
    if as_json:
        click.echo(json.dumps(to_json(changes), indent=1, sort_keys=True, default=str))
    else:
        click.echo(render(changes, str(a), str(b)))
    return FAILED if relevant(changes) else OK
