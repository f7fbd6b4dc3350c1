"""Build progress for people and for CI.

Three forms of the same events (start, one per variant, done):
- ``tty``: one status line rewritten in place (stderr), failures on their own
  lines;
- ``plain``: one line per event (stderr), for logs;
- ``json``: one JSON object per line on stdout, for CI to parse:
  ``{"event": "start", "variants": n, "cached": h, "compile": c, "jobs": j}``,
  ``{"event": "variant", "name": ..., "status": "cached"|"compiled"|"failed",
  "seconds": s, "done": k, "total": n[, "error": text]}``,
  ``{"event": "done", "ok": bool, "out": dir, "variants": n, "compiled": c,
  "cached": h, "failed": f, "seconds": s}``.
"""

from __future__ import annotations

import json
import sys
import time


class Progress:
    def __init__(self, mode: str, out=None, err=None):
        if mode not in ("tty", "plain", "json"):
            raise ValueError(f"unknown progress mode {mode!r}")
        self.mode = mode
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.total = 0
        self.done = 0
        self.counts = {"cached": 0, "compiled": 0, "failed": 0}
        self._start = time.monotonic()
        self._line = False

    @classmethod
    def auto(cls, as_json: bool) -> Progress:
        """json when asked, tty when stderr is a terminal, plain otherwise."""
        if as_json:
            return cls("json")
        return cls("tty" if sys.stderr.isatty() else "plain")

    def start(self, total: int, cached: int, jobs: int) -> None:
        self.total = total
        if self.mode == "json":
            self._json(event="start", variants=total, cached=cached, compile=total - cached,
                       jobs=jobs)  # fmt: skip
        else:
            self._print(
                f"{total} variants: {cached} cached, {total - cached} to compile "
                f"({jobs} process{'es' if jobs != 1 else ''})"
            )

    def variant(self, name: str, status: str, seconds: float, error: str | None = None) -> None:
        self.done += 1
        self.counts[status] += 1
        if self.mode == "json":
            extra = {"error": error} if error is not None else {}
            self._json(event="variant", name=name, status=status, seconds=round(seconds, 3),
                       done=self.done, total=self.total, **extra)  # fmt: skip
            return
        text = f"[{self.done}/{self.total}] {status:8} {name} {seconds:.1f}s"
        if status == "failed":
            self._print(text + "\n" + _indent(error or ""))
        elif self.mode == "tty":
            hits = self.counts["cached"]
            self._status(f"{text}  ({hits} cached, {self.counts['failed']} failed)")
        else:
            self._print(text)

    def finish(self, ok: bool, out: str | None) -> None:
        seconds = time.monotonic() - self._start
        c = self.counts
        if self.mode == "json":
            self._json(event="done", ok=ok, out=out, variants=self.total, compiled=c["compiled"],
                       cached=c["cached"], failed=c["failed"], seconds=round(seconds, 3))  # fmt: skip
            return
        verdict = f"wrote {out}" if ok else "build failed, nothing written"
        self._print(
            f"{verdict}: {self.total} variants ({c['compiled']} compiled, {c['cached']} cached, "
            f"{c['failed']} failed) in {seconds:.1f}s"
        )

    def _json(self, **fields) -> None:
        self.out.write(json.dumps(fields, sort_keys=True) + "\n")
        self.out.flush()

    def _print(self, text: str) -> None:
        if self._line:
            self.err.write("\r\x1b[K")
            self._line = False
        self.err.write(text + "\n")
        self.err.flush()

    def _status(self, text: str) -> None:
        self.err.write("\r\x1b[K" + text)
        self.err.flush()
        self._line = True


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
