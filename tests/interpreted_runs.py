"""Child pytest runs with Triton's interpreter on, started when the session starts.

The interpreter must be on before triton defines a kernel, so the CUDA kernels' CPU parity cases run
in child pytest processes with TRITON_INTERPRET=1. Each child is one Python thread for minutes, and
most of the suite leaves a core idle: the children the selected tests declare (``runs``) start as
soon as collection ends, on all cores but one, and a test that needs a child's result before a
worker has taken it runs that child itself. A test reads its child's result with
``Interpreted.launches()``: the kernel launches the probe plugin counted (tests/triton_probe.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from onnxgen.runtime.gpu.launch import interpreting, triton_importable
from tests import triton_probe

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1200
NICENESS = 10


@dataclass(frozen=True)
class Interpreted:
    """One child run of the tests in ``files`` that match the ``-k`` expression ``selection``, with
    ``env`` added to the interpreter's. ``no_skips``: a skipped case fails the run (a kernel file's
    own cases, which skip only where nothing interprets them)."""

    selection: str
    files: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    no_skips: bool = False

    def launches(self) -> dict[str, int]:
        """The launches the child's probe counted, once the child has passed (run here if no
        worker has taken it yet)."""
        return _scheduled(self).result()


def interpreted(selection: str, files: tuple[str, ...], **env: str) -> Interpreted:
    return Interpreted(selection, files, tuple(sorted(env.items())))


def interpreted_file(test_file: str, deselect: str) -> Interpreted:
    """Every case of ``test_file`` but those matching ``deselect``, none of them skipped."""
    return Interpreted(f"not ({deselect})", (str(Path(test_file).relative_to(ROOT)),), no_skips=True)


# the tests that read a child's result: in the parent run only, where triton can interpret
IN_THE_PARENT = pytest.mark.skipif(
    interpreting() or not triton_importable(), reason="the parent run starts the interpreted child"
)


def runs(*wanted: Interpreted):
    """Declares the children a test reads, so that they start when the session does."""

    def mark(test):
        test.interpreted_runs = wanted
        return test

    return mark


class _Child:
    """One child run, taken by whichever comes first: a pool worker or the test that needs it."""

    def __init__(self, run: Interpreted) -> None:
        self.run = run
        self._claim = threading.Lock()
        self._claimed = False
        self._done = threading.Event()
        self._launches: dict[str, int] | None = None
        self._error: BaseException | None = None

    def take(self) -> None:
        with self._claim:
            if self._claimed:
                return
            self._claimed = True
        try:
            self._launches = _run_child(self.run)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test that reads the result
            self._error = exc
        finally:
            self._done.set()

    def result(self) -> dict[str, int]:
        self.take()
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._launches is not None
        return self._launches


_CHILDREN: dict[Interpreted, _Child] = {}
_PROCESSES: set[subprocess.Popen] = set()
_POOL: ThreadPoolExecutor | None = None
_STOPPING = threading.Event()


def _scheduled(run: Interpreted) -> _Child:
    return _CHILDREN.setdefault(run, _Child(run))


def _run_child(run: Interpreted) -> dict[str, int]:
    if _STOPPING.is_set():
        raise RuntimeError("the session ended before this interpreted run started")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.triton_probe"]
    cmd += [*run.files, "-k", run.selection, "-m", "not gpu"]
    # one torch thread per child: a child takes one core
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "ONNXGEN_TRITON": "1", **dict(run.env)}
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _PROCESSES.add(child)
    # below the main run's priority: the children take the core it leaves idle, not its time. The
    # child is not reaped before communicate(), so its pid stays valid even if it has exited already;
    # the suppress only guards platforms that refuse a zombie's priority.
    with contextlib.suppress(ProcessLookupError):
        os.setpriority(os.PRIO_PROCESS, child.pid, NICENESS)
    try:
        out, err = child.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        raise AssertionError(f"the interpreted run took over {TIMEOUT_S} s: {run.selection}\n{out[-3000:]}") from None
    finally:
        _PROCESSES.discard(child)
    assert child.returncode == 0, out[-6000:] + err[-3000:]
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert not (run.no_skips and " skipped" in summary), out[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("TRITON-LAUNCHES"))
    launches = json.loads(line.split(" ", 1)[1])
    unpinned = launches.pop(triton_probe.UNPINNED_KEY)
    assert not unpinned, f"onnxgen kernels launched without launch.COMPILE_OPTIONS (launches): {unpinned}"
    return launches


def start(items) -> None:
    """Starts the children the collected ``items`` declare, in the order the tests come, on all
    cores but one (the main run's); none where this process interprets already or triton is missing."""
    global _POOL
    from onnxgen.threads import usable_cores

    if interpreting() or not triton_importable():
        return
    wanted: list[Interpreted] = []
    for item in items:
        for run in getattr(getattr(item, "function", None), "interpreted_runs", ()):
            if run not in wanted:
                wanted.append(run)
    if not wanted:
        return
    _POOL = ThreadPoolExecutor(max_workers=max(1, usable_cores() - 1), thread_name_prefix="interpreted")
    for run in wanted:
        _POOL.submit(_scheduled(run).take)


def stop() -> None:
    """At the session's end: no new child starts, running ones are killed (an interrupted session
    does not wait minutes for them)."""
    _STOPPING.set()
    for child in list(_PROCESSES):
        child.kill()
    if _POOL is not None:
        _POOL.shutdown(wait=True, cancel_futures=True)
