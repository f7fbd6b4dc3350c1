"""Killed and interrupted builds: the compile workers end with their parent,
the next build sweeps what a killed one left behind, and replacing an
artifact never loses both the old and the new one (pipeline.output).

The end-to-end cases run ``python -m pipeline.cli compile`` as a subprocess
with the slow stub kernel (tests/pipeline_slow_kernel.py), its temporary
directory (``TMPDIR``) under the test's own, and a marker in its environment
that every process it starts inherits, so /proc shows whether any is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from pipeline_support import GLM5, REPO, artifact_files, build, leftovers, modules_env, run

from pipeline import output, worker

needs_proc = pytest.mark.skipif(
    not Path("/proc/self/environ").exists(), reason="finds processes through /proc"
)
SMALL = ("--kernel", "mega", "--arch", "sm_90a")  # 8 variants, one pool
MARK = "MOE_BUILD_TEST_MARK"


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _marked(mark: str) -> list[int]:
    """Running processes whose environment carries ``MARK=mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in environ and _running(int(entry.name)):
            found.append(int(entry.name))
    return found


def _until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class SlowBuild:
    """``compile`` subprocesses whose compiles sleep a minute and record the
    worker's pid; scratch goes to ``tmp_path/tmp`` (also this process's
    tempfile directory while the test runs)."""

    def __init__(self, tmp_path: Path, monkeypatch):
        self.mark = uuid.uuid4().hex
        self.pids = tmp_path / "pids"
        self.tmp = tmp_path / "tmp"
        self.pids.mkdir()
        self.tmp.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(self.tmp))
        self.env = dict(os.environ, MOE_BUILD_KERNEL_MODULES=modules_env("pipeline_slow_kernel"),
                        MOE_BUILD_STUB_SLEEP="60", MOE_BUILD_PID_DIR=str(self.pids),
                        TMPDIR=str(self.tmp), PYTHONPATH=str(REPO / "tests"),
                        **{MARK: self.mark})  # fmt: skip
        self.runs = 0

    def start(self, out: Path, *extra: str, **popen) -> subprocess.Popen:
        """The build, its output to files (a pipe would stay open as long as
        any process that inherited it)."""
        args = [sys.executable, "-m", "pipeline.cli", "compile", str(GLM5), "-o", str(out), *extra]
        self.runs += 1
        log = self.tmp.parent / f"run-{self.runs}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(args, cwd=REPO, env=self.env, stdout=f, stderr=f, **popen)
        proc.log = log
        return proc

    def finish(self, proc: subprocess.Popen) -> tuple[int, str]:
        """(exit status, output) once the build ends."""
        return proc.wait(timeout=60), proc.log.read_text()

    def workers(self, proc: subprocess.Popen, count: int) -> list[int]:
        """Waits until ``count`` workers are compiling; their pids."""
        started = _until(lambda: len(list(self.pids.iterdir())) >= count or proc.poll() is not None,
                         60)  # fmt: skip
        if proc.poll() is not None or not started:
            proc.kill()
            pytest.fail(f"the build did not start {count} compiles: {self.finish(proc)[1]}")
        return [int(p.name) for p in self.pids.iterdir()]

    def stop_all(self) -> None:
        """Kills what a failed test left running (only this test's processes)."""
        for pid in _marked(self.mark):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def scratch(self) -> list[str]:
        return sorted(p.name for p in self.tmp.iterdir() if p.name.startswith("moe-build-"))


@pytest.fixture
def slow(tmp_path, stub_env, monkeypatch):
    build = SlowBuild(tmp_path, monkeypatch)
    yield build
    build.stop_all()


@needs_proc
def test_killed_build_leaves_no_process_and_the_next_build_sweeps(tmp_path, slow):
    out = tmp_path / "out"
    proc = slow.start(out, *SMALL, "-j", "2")
    workers = slow.workers(proc, 2)
    assert leftovers(tmp_path) and slow.scratch()  # a build in progress
    proc.kill()
    proc.wait()
    assert _until(lambda: not _marked(slow.mark), 10), f"left running: {_marked(slow.mark)}"
    assert not any(_running(pid) for pid in workers)
    assert not out.exists()
    stale_staging, stale_scratch = leftovers(tmp_path), slow.scratch()
    assert stale_staging and stale_scratch  # SIGKILL runs no cleanup

    slow.env["MOE_BUILD_STUB_SLEEP"] = "0"
    code, text = slow.finish(slow.start(out, *SMALL))
    assert code == 0, text
    assert leftovers(tmp_path) == [] and slow.scratch() == []
    assert len(artifact_files(out)) == 1 + 8  # manifest and cubins


@needs_proc
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_signalled_build_keeps_the_old_artifact(tmp_path, slow, signum):
    out = build(tmp_path / "out", *SMALL)
    before = artifact_files(out)

    def default_hup():  # as from a shell without nohup, whatever this test runs under
        signal.signal(signal.SIGHUP, signal.SIG_DFL)

    proc = slow.start(out, *SMALL, "-j", "2", "--no-cache", preexec_fn=default_hup)
    workers = slow.workers(proc, 2)
    proc.send_signal(signum)
    code, text = slow.finish(proc)
    assert code == 130, text
    assert "interrupted; nothing was written" in text
    assert artifact_files(out) == before
    assert leftovers(tmp_path) == [] and slow.scratch() == []
    assert _until(lambda: not _marked(slow.mark), 10), f"left running: {_marked(slow.mark)}"
    assert not any(_running(pid) for pid in workers)


_ALONE = {
    # the portable fallback on its own
    "watch": "worker.watch_parent(os.getppid())",
    # the parent death signal on its own
    "pdeathsig": "worker.watch_parent = lambda parent: None; worker.exit_with_parent(os.getppid())",
}


@needs_proc
@pytest.mark.parametrize("how", sorted(_ALONE))
def test_each_way_ends_a_worker_whose_parent_died(tmp_path, how):
    """Either mechanism of pipeline.worker alone ends a process soon after its
    parent is killed."""
    if how == "pdeathsig" and not sys.platform.startswith("linux"):
        pytest.skip("prctl is Linux's")
    ready = tmp_path / "ready"
    child = (f"import os, time; from pipeline import worker; {_ALONE[how]}; "
             f"open({str(ready)!r}, 'w').close(); time.sleep(60)")  # fmt: skip
    middle = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
              f"{child!r}]); print(p.pid, flush=True); time.sleep(60)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", middle], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    pid = int(proc.stdout.readline())
    proc.stdout.close()  # the child holds it too
    try:
        assert _until(ready.exists, 30)
        time.sleep(0.2)
        assert _running(pid)  # a live parent keeps it
        proc.kill()
        proc.wait()
        assert _until(lambda: not _running(pid), 10)
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_worker_whose_parent_died_before_it_started_exits_at_once(tmp_path):
    """The parent the build named is not this process's parent (any more):
    the check after prctl, without the watch."""
    script = (
        "import os; from pipeline import worker; worker.watch_parent = lambda parent: None; "
        f"worker.init('sm_90a', {str(tmp_path)!r}, os.getppid() + 1); print('still here')"
    )
    done = subprocess.run([sys.executable, "-c", script],
                          cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == worker.ORPHANED, done.stderr
    assert "still here" not in done.stdout


# The swap of Staging.commit, interrupted between its two renames.

_SWAP = textwrap.dedent("""\
    import os, signal, sys
    from pipeline import output

    target, how = sys.argv[1], sys.argv[2]

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # as compile does
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == 2:  # the old artifact is aside, the new one not yet in
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGTERM)
        real(src, dst)

    os.replace = replace
    with output.Staging(target) as staging:
        staging.write("cubins/new.cubin.zst", b"new")
        try:
            staging.commit({"new": True})
        except KeyboardInterrupt:
            sys.exit(130)
    """)


def _old_artifact(target: Path) -> dict[str, bytes]:
    (target / "cubins").mkdir(parents=True)
    (target / "cubins" / "old.cubin.zst").write_bytes(b"old")
    (target / "manifest.json").write_text('{"old": true}\n')
    return artifact_files(target)


def _swap(target: Path, how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SWAP, str(target), how], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_sigterm_between_the_renames_lets_the_swap_finish(tmp_path):
    target = tmp_path / "out"
    _old_artifact(target)
    done = _swap(target, "term")
    assert done.returncode == 130, done.stderr  # the interrupt arrives after the swap
    assert sorted(artifact_files(target)) == ["cubins/new.cubin.zst", "manifest.json"]
    assert leftovers(tmp_path) == []


def test_kill_between_the_renames_is_recovered_by_the_next_staging(tmp_path):
    target = tmp_path / "out"
    before = _old_artifact(target)
    done = _swap(target, "kill")
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not target.exists()
    assert [n.split("-")[0] for n in leftovers(tmp_path)] == [".out.old", ".out.tmp"]
    with output.Staging(target) as staging:
        assert staging.recovered is not None
        assert artifact_files(target) == before
    assert artifact_files(target) == before and leftovers(tmp_path) == []


def test_compile_says_it_restored_the_old_artifact(tmp_path, stub_env, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    target = tmp_path / "out"
    _old_artifact(target)
    assert _swap(target, "kill").returncode == -signal.SIGKILL
    code, _, stderr = run("compile", GLM5, "-o", target, "--variant", "mega-sm_90a-m1-float32")
    assert code == 0, stderr
    assert "restored the previous artifact" in stderr
    assert sorted(artifact_files(target)) == ["cubins/mega-sm_90a-m1-float32.cubin.zst",
                                              "manifest.json"]  # fmt: skip
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_failed_second_rename_puts_the_old_artifact_back(tmp_path, monkeypatch, failure):
    target = tmp_path / "out"
    before = _old_artifact(target)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise failure
        real(src, dst)

    with pytest.raises((output.OutputError, KeyboardInterrupt)) as raised:
        with output.Staging(target) as staging:
            staging.write("cubins/new.cubin.zst", b"new")
            monkeypatch.setattr(os, "replace", replace)
            staging.commit({"new": True})
    monkeypatch.undo()
    assert len(calls) == 3  # aside, in (fails), back
    if isinstance(failure, OSError):
        assert "No space left on device" in str(raised.value)
    assert artifact_files(target) == before and leftovers(tmp_path) == []


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(proc.stdout)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    pytest.skip(f"pid {pid} was taken again at once")


def test_sweep_removes_only_our_dead_owners_directories(tmp_path):
    dead, host = _dead_pid(), output.host_tag()
    other_host = "00000000" if host != "00000000" else "11111111"
    day_old = time.time() - 2 * 24 * 3600
    names = {
        f"moe-build-{dead}-{host}-abc_1234": False,  # dead owner: swept
        f"moe-build-{os.getpid()}-{host}-abc_1234": True,  # live owner
        f"moe-build-{dead}-{other_host}-abc_1234": True,  # another machine's
        "moe-build-young123": True,  # no owner in the name, recent
        "moe-build-olddir12": False,  # no owner in the name, a day old
        "moe-build-open-abcdefgh": True,  # another command's
        f"moe-build-{dead}-{host}-abc_12345": True,  # not mkdtemp's suffix
        f"moe-build-{dead}-{host}": True,
        f"other-{dead}-{host}-abc_1234": True,
    }
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    os.utime(tmp_path / "moe-build-olddir12", (day_old, day_old))
    (tmp_path / f"moe-build-{dead}-{host}-file1234").write_text("a file")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / f"moe-build-{dead}-{host}-link1234").symlink_to(tmp_path / "elsewhere")
    removed = output.sweep(tmp_path, "moe-build-")
    assert sorted(p.name for p in removed) == [f"moe-build-{dead}-{host}-abc_1234",
                                               "moe-build-olddir12"]  # fmt: skip
    for name, kept in names.items():
        assert (tmp_path / name).exists() == kept, name
    assert (tmp_path / f"moe-build-{dead}-{host}-file1234").is_file()
    assert (tmp_path / f"moe-build-{dead}-{host}-link1234").is_symlink()
    assert (tmp_path / "elsewhere").is_dir()


def test_staging_names_carry_the_owner(tmp_path):
    with output.Staging(tmp_path / "out") as staging:
        owner = f"{os.getpid()}-{output.host_tag()}-"
        assert staging.path.name.startswith(f".out.tmp-{owner}")
        assert output.sweep(tmp_path, ".out.tmp-") == []  # alive: kept
        assert staging.path.is_dir()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("written", [False, True])
def test_interrupt_message_says_whether_the_new_artifact_is_in_place(
    tmp_path, stub_env, monkeypatch, written
):
    """A signal held back during the swap lands after it: compile still exits
    130, but must not claim that nothing was written."""
    from pipeline import commands

    target = tmp_path / "out"

    def interrupted(req, progress):
        exc = KeyboardInterrupt()
        if written:
            exc.written = target
        raise exc

    monkeypatch.setattr(commands, "build", interrupted)
    code, _, stderr = run("compile", GLM5, "-o", target, "--variant", "mega-sm_90a-m1-float32")
    assert code == 130
    if written:
        assert f"interrupted after the new artifact was written to {target}" in stderr
        assert "nothing was written" not in stderr
    else:
        assert "interrupted; nothing was written" in stderr
