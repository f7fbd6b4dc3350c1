"""``moe-build merge``: join artifacts built on several machines into one.

Inputs are verified artifacts (runtime.artifact) of the same config and the
same toolchain (DSL, Python, libzstd). Shards (``compile --shard i/n``) must
all be present: the same count, every index once, and together exactly the
names of their recorded selection. Inputs without a shard record (e.g. one
build per ``--arch``) are joined as they are. Variant records and compressed
cubins are copied unchanged and the manifest is rebuilt by the same function
as ``compile`` uses, so merging the shards of a build gives the manifest a
single-machine build of the same selection with the same cubins would.
"""

from __future__ import annotations

import contextlib
import datetime
from pathlib import Path

from pipeline import manifest as mf
from pipeline.artifacts import ArtifactError, open_artifact
from pipeline.output import Staging


class MergeError(ValueError):
    """The inputs do not form one artifact (message says why)."""


def merge(inputs: list[str | Path], out: str | Path) -> Path:
    """Writes the merged artifact to ``out``; raises MergeError, ArtifactError
    or OutputError (nothing written)."""
    if len(inputs) < 1:
        raise MergeError("merge needs at least one input")
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(open_artifact(p)) for p in inputs]
        manifests = [o.manifest for o in opened]
        first = manifests[0]
        for path, m in zip(inputs, manifests, strict=True):
            if m["config_hash"] != first["config_hash"]:
                raise MergeError(
                    f"{path}: config_hash {m['config_hash']} differs from "
                    f"{inputs[0]}'s {first['config_hash']}"
                )
            if _tools(m) != _tools(first):
                raise MergeError(
                    f"{path}: toolchain {_tools(m)} differs from {inputs[0]}'s {_tools(first)}"
                )
        _check_shards(inputs, manifests)

        records, sources = {}, {}
        for path, o in zip(inputs, opened, strict=True):
            for record in o.manifest["variants"]:
                name = record["name"]
                if name in records:
                    raise MergeError(f"variant {name}: in both {sources[name]} and {path}")
                records[name] = record
                sources[name] = path
        result = mf.manifest(first["config"], list(records.values()), _tools(first))
        with Staging(out) as staging:
            for name, record in records.items():
                o = opened[inputs.index(sources[name])]
                staging.write(record["file"], (o.root / record["file"]).read_bytes())
            staging.write_json("build-record.json", _record(inputs, sources))
            return staging.commit(result)


def _tools(m: dict) -> dict:
    """The toolchain facts that must agree (``ptxas`` is recomputed)."""
    return {k: v for k, v in m["toolchain"].items() if k != "ptxas"}


def _check_shards(inputs, manifests) -> None:
    shards = [m.get("shard") for m in manifests]
    if all(s is None for s in shards):
        return
    if any(s is None for s in shards):
        raise MergeError("some inputs are shards and some are not: merge shards of one build")
    count = shards[0]["count"]
    selection = shards[0]["selection"]
    seen = {}
    for path, s in zip(inputs, shards, strict=True):
        if s["count"] != count or s["selection"] != selection:
            raise MergeError(f"{path}: shard {s['index']}/{s['count']} is from another build")
        if s["index"] in seen:
            raise MergeError(f"{path}: shard {s['index']}/{count} repeats {seen[s['index']]}")
        seen[s["index"]] = path
    missing = sorted(set(range(1, count + 1)) - set(seen))
    if missing:
        raise MergeError(f"shards {', '.join(f'{i}/{count}' for i in missing)} missing")
    names = sorted(r["name"] for m in manifests for r in m["variants"])
    if names != sorted(selection):
        raise MergeError("the shards' variants are not the build's selection")


def _record(inputs, sources) -> dict:
    return {
        "merged": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "inputs": [str(p) for p in inputs],
        "variants": {name: str(path) for name, path in sorted(sources.items())},
    }


__all__ = ["ArtifactError", "MergeError", "merge"]
