"""``moe-build compile``: config -> variants -> cubins -> artifact directory.

Flow: select the variants (``--arch``, ``--kernel``, ``--shard``), key each
one (pipeline.cache), take hits from the build cache, compile the misses in
worker processes (one pool per architecture, spawn context: CUTE_DSL_ARCH
must be set before cutlass is imported), check every cubin against its
declared ABI, and write the artifact through pipeline.output (temporary
directory, manifest last, atomic rename). Any failed variant fails the
build: every failure is reported with the variant's name and the compiler's
message, and nothing is written.

Selection: ``--arch``, ``--kernel`` and ``--variant`` (name patterns) narrow
the config's variants; the manifest records the whole resolved config and
the variants built.

Sharding: the selected variants, sorted by name, are dealt round-robin, so
shard ``i/n`` (1-based) builds names ``i-1, i-1+n, ...``. A shard's manifest
carries a ``shard`` record (index, count, the names of the whole selection)
that ``moe-build merge`` uses to check it has every shard.

Interruption: while a build runs in the main thread, SIGTERM and SIGHUP
raise KeyboardInterrupt like Ctrl-C (where their handler is the default
one: a handler the caller installed, or SIG_IGN as ``nohup`` sets, is kept),
so the workers are stopped and the temporary directories removed. A build
killed outright (SIGKILL) runs no cleanup: its workers end by themselves
(pipeline.worker), and what it left is swept by the next build. The
scratch directory (``moe-build-<pid>-<host>-XXXXXXXX`` in the temporary
directory, holding the DSL's dump directories) and the staging directory
are owned names (pipeline.output): each build first removes the
``moe-build-`` ones of dead owners, and its Staging those of its target.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import datetime
import fnmatch
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline import manifest as mf
from pipeline import toolchain, worker
from pipeline.cache import BuildCache, cache_key, source_hashes
from pipeline.config import BuildConfig
from pipeline.output import Staging, owned_prefix, sweep
from pipeline.progress import Progress
from pipeline.variants import Variant, expand
from runtime.constants import ARCHS, KERNELS

#: The stem of a build's scratch directory name (pipeline.output, owned names).
SCRATCH_STEM = "moe-build-"


class BuildError(RuntimeError):
    """The build cannot start or did not succeed; ``problems`` lists one
    message per cause (a failed variant names itself)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class VariantsFailed(BuildError):
    """Variants that did not compile or whose cubin contradicts their declared
    ABI: ``failures`` maps variant name -> message."""

    def __init__(self, failures: dict[str, str]):
        self.failures = failures
        super().__init__([f"variant {name}: {text}" for name, text in failures.items()])

    def grouped(self) -> list[str]:
        """One message per distinct error, naming every variant that hit it."""
        by_text: dict[str, list[str]] = {}
        for name, text in self.failures.items():
            by_text.setdefault(text, []).append(name)
        return [
            f"variant{'s' if len(names) > 1 else ''} {', '.join(names)}: {text}"
            for text, names in by_text.items()
        ]


class SelectionError(BuildError):
    """The request names archs, kernels or a shard the config cannot give."""


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (1-based)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        head, sep, tail = text.partition("/")
        try:
            index, count = int(head), int(tail)
        except ValueError:
            index = count = 0
        if not sep or count < 1 or not 1 <= index <= count:
            raise ValueError(f"shard {text!r}: expected i/n with 1 <= i <= n, e.g. 1/4")
        return cls(index, count)

    def take(self, variants: list[Variant]) -> list[Variant]:
        ordered = sorted(variants, key=lambda v: v.name)
        return ordered[self.index - 1 :: self.count]

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass
class BuildRequest:
    config: BuildConfig
    out: Path
    archs: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    jobs: int = 1
    shard: Shard | None = None
    cache: BuildCache = field(default_factory=lambda: BuildCache(None))


def select(config: BuildConfig, archs=(), kernels=(), shard: Shard | None = None, patterns=()):
    """(variants to build, names of the whole selection before sharding);
    raises SelectionError for an arch or kernel the config does not build or
    a name pattern (fnmatch, e.g. ``'*-m1-float32'``) that matches nothing."""
    problems = []
    targets = [t.arch for t in config.targets]
    for arch in archs:
        if arch not in ARCHS:
            problems.append(f"--arch {arch}: unknown arch (known: {', '.join(ARCHS)})")
        elif arch not in targets:
            problems.append(f"--arch {arch}: not a target of this config ({', '.join(targets)})")
    for kernel in kernels:
        if kernel not in KERNELS:
            problems.append(f"--kernel {kernel}: unknown kernel (known: {', '.join(KERNELS)})")
        elif kernel not in config.kernels:
            problems.append(
                f"--kernel {kernel}: not built by this config ({', '.join(config.kernels)})"
            )
    if problems:
        raise SelectionError(problems)
    chosen = expand(config, archs=set(archs) or None, kernels=set(kernels) or None)
    if patterns:
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(v.name, p) for v in chosen)]
        if unmatched:
            raise SelectionError([f"--variant {p}: matches no variant" for p in unmatched])
        chosen = [v for v in chosen if any(fnmatch.fnmatchcase(v.name, p) for p in patterns)]
    names = sorted(v.name for v in chosen)
    if shard is not None:
        chosen = shard.take(chosen)
    if not chosen and shard is None:
        raise SelectionError(["nothing to build: the selection has no variants"])
    # A shard may be empty (more shards than variants): it still writes its
    # manifest, so that merge sees every shard of the build.
    return chosen, names


def build(req: BuildRequest, progress: Progress) -> Path:
    """Builds the artifact at ``req.out``; returns its path or raises
    BuildError (nothing written), OutputError, or KeyboardInterrupt (also
    for SIGTERM and SIGHUP: ``_interruptible``; its ``written`` attribute is
    the artifact's path when the signal came after the new artifact was in
    place, else the old one, if any, is untouched)."""
    with _interruptible():
        return _build(req, progress)


def _build(req: BuildRequest, progress: Progress) -> Path:
    started = time.time()
    variants, selection = select(req.config, req.archs, req.kernels, req.shard, req.patterns)
    tools = mf.local_toolchain()  # fails early when the DSL is missing
    identity = toolchain.identity()
    sources = {}
    keys = {}
    for v in variants:
        if (v.kernel, v.arch) not in sources:
            try:
                sources[(v.kernel, v.arch)] = source_hashes(v.kernel, v.arch)
            except (KeyError, OSError, SyntaxError) as exc:
                raise BuildError([f"variant {v.name}: kernel sources: {exc}"]) from None
        keys[v.name] = cache_key(v.spec(req.config), sources[(v.kernel, v.arch)], identity)

    sweep(tempfile.gettempdir(), SCRATCH_STEM)
    with Staging(req.out) as staging:
        if staging.recovered is not None:
            print(f"warning: output {staging.target}: restored the previous artifact from "
                  f"{staging.recovered.name}, where a build killed while replacing it had "
                  "left it", file=sys.stderr)  # fmt: skip
        results = {}
        for v in variants:
            hit = req.cache.get(keys[v.name])
            if hit is not None:
                results[v.name] = hit
        misses = [v for v in variants if v.name not in results]
        plan = _plan(misses, req.jobs)
        progress.start(len(variants), len(variants) - len(misses), sum(n for _, n, _ in plan))
        timings = {}
        for v in variants:
            if v.name in results:
                timings[v.name] = {"cached": True, "seconds": 0.0}
                progress.variant(v.name, "cached", 0.0)
        failures = {}
        for v, result in _compile(plan, req.config):
            seconds = result.pop("seconds", 0.0)
            timings[v.name] = {"cached": False, "seconds": round(seconds, 3)}
            if "error" in result:
                failures[v.name] = result["error"]
                progress.variant(v.name, "failed", seconds, result["error"])
                continue
            req.cache.put(keys[v.name], result)
            results[v.name] = result
            progress.variant(v.name, "compiled", seconds)
        if failures:
            raise VariantsFailed(failures)

        records = []
        for v in variants:
            packed = mf.compress(results[v.name]["cubin"])
            try:
                records.append(mf.variant_record(v, results[v.name], keys[v.name], packed))
            except mf.ManifestError as exc:
                failures[v.name] = str(exc)
                continue
            staging.write(f"cubins/{v.name}.cubin.zst", packed)
        if failures:
            raise VariantsFailed(failures)
        extra = {}
        if req.shard is not None:
            extra["shard"] = {"index": req.shard.index, "count": req.shard.count,
                              "selection": selection}  # fmt: skip
        manifest = mf.manifest(req.config.to_dict(), records, tools, extra)
        staging.write_json("build-record.json", _record(req, started, timings))
        try:
            return staging.commit(manifest)
        except KeyboardInterrupt as exc:
            # A signal held back during the swap lands once it is done: the
            # new artifact is in place, and the caller's message says so.
            if staging.committed:
                exc.written = staging.target
            raise


def _plan(misses: list[Variant], jobs: int) -> list[tuple[str, int, list[Variant]]]:
    """(arch, processes, variants) per arch with work: ``jobs`` processes
    shared in proportion to each arch's variants, at least one each."""
    by_arch: dict[str, list[Variant]] = {}
    for v in misses:
        by_arch.setdefault(v.arch, []).append(v)
    jobs = max(1, jobs)
    plan = []
    for arch, todo in by_arch.items():
        share = max(1, round(jobs * len(todo) / len(misses)))
        plan.append((arch, min(share, len(todo)), todo))
    return plan


def _compile(plan, config: BuildConfig):
    """Yields (variant, result dict) as compiles finish, across one process
    pool per arch (all pools run at once). The pools are started and shut
    down by the thread that runs this generator (the workers' parent death
    signal is tied to that thread: pipeline.worker)."""
    if not plan:
        return
    ctx = multiprocessing.get_context("spawn")
    pools = []
    futures = {}
    scratch = tempfile.mkdtemp(prefix=owned_prefix(SCRATCH_STEM))
    finished = False
    try:
        for arch, processes, todo in plan:
            pool = cf.ProcessPoolExecutor(processes, mp_context=ctx, initializer=worker.init,
                                          initargs=(arch, scratch, os.getpid()))  # fmt: skip
            pools.append(pool)
            for v in todo:
                futures[pool.submit(worker.compile_one, asdict(v.spec(config)))] = v
        for future in cf.as_completed(futures):
            v = futures[future]
            try:
                result = future.result()
            except cf.process.BrokenProcessPool:
                result = {"error": "the compiler process died (crashed or was killed) while "
                                   "this variant was being compiled or waiting"}  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be pickled
                result = {"error": f"{type(exc).__name__}: {exc}"}
            yield v, result
        finished = True
    finally:
        for pool in pools:
            if not finished:
                _kill_workers(pool)
            pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _interruptible():
    """Meanwhile, in the main thread, SIGTERM and SIGHUP raise
    KeyboardInterrupt where their handler is SIG_DFL; the previous handlers
    are restored after. Elsewhere (another thread cannot set handlers)
    nothing changes."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
                previous[sig] = signal.signal(sig, _interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _kill_workers(pool: cf.ProcessPoolExecutor) -> None:
    """Ends a pool's worker processes now: on an interrupt or error there is
    no point waiting for compiles whose results will be dropped (a real
    kernel takes seconds to minutes). The executor has no public way to do
    this; ``_processes`` has been its pid -> Process map since Python 3.2."""
    for process in list(getattr(pool, "_processes", {}).values()):
        if process.is_alive():
            process.terminate()


def _record(req: BuildRequest, started: float, timings: dict) -> dict:
    """build-record.json: facts about this run that are not part of the
    artifact's identity (so not in the manifest)."""

    def iso(t):
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()

    return {
        "started": iso(started),
        "finished": iso(time.time()),
        "seconds": round(time.time() - started, 3),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "argv": sys.argv,
        "jobs": req.jobs,
        "shard": str(req.shard) if req.shard else None,
        "cache": str(req.cache.root) if req.cache.root else None,
        "cpu_count": os.cpu_count(),
        "variants": timings,
    }
