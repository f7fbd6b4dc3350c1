"""The three forms of build progress."""

from __future__ import annotations

import io
import json

from pipeline.progress import Progress


def drive(mode: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    p = Progress(mode, out=out, err=err)
    p.start(3, 1, 2)
    p.variant("mega-sm_90a-m1-float32", "cached", 0.0)
    p.variant("mega-sm_90a-m2-float32", "compiled", 1.25)
    p.variant("mega-sm_90a-m3-float32", "failed", 0.5, "ptxas fatal: boom")
    p.finish(False, None)
    return out.getvalue(), err.getvalue()


def test_json_lines_for_ci():
    out, err = drive("json")
    events = [json.loads(line) for line in out.splitlines()]
    assert err == ""
    assert [e["event"] for e in events] == ["start", "variant", "variant", "variant", "done"]
    assert events[0] == {"event": "start", "variants": 3, "cached": 1, "compile": 2, "jobs": 2}
    assert events[2]["status"] == "compiled" and events[2]["seconds"] == 1.25
    assert events[3]["error"] == "ptxas fatal: boom" and events[3]["done"] == 3
    assert events[4]["ok"] is False and events[4]["failed"] == 1 and events[4]["cached"] == 1


def test_plain_lines_for_logs():
    out, err = drive("plain")
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == "3 variants: 1 cached, 2 to compile (2 processes)"
    assert lines[1].startswith("[1/3] cached   mega-sm_90a-m1-float32")
    assert lines[3].startswith("[3/3] failed   mega-sm_90a-m3-float32") and "boom" in lines[4]
    assert "build failed, nothing written" in lines[-1] and "1 failed" in lines[-1]
    assert "\r" not in err


def test_tty_rewrites_one_status_line():
    _, err = drive("tty")
    assert "\r\x1b[K[2/3] compiled mega-sm_90a-m2-float32 1.2s  (1 cached, 0 failed)" in err
    assert err.count("\n") == 4  # start, the failure (two lines), the summary
