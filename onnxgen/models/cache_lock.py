"""One writer at a time per target (a cached GGUF, a cached package, a `build -o` directory).

The lock is an flock on `.NAME.lock` beside the target. Invariants:
- every process that creates staging entries for a target (`.building-NAME.*` and
  `.replaced-NAME.*` directories, `.download-NAME.*` wheel folders, `.NAME.*.partial` files)
  holds the target's lock for as long as they exist, so the holder may treat any such entry it
  finds as left by a process that died, and remove it;
- the holder unlinks the lock file before releasing it; a waiter that then gets the lock checks
  that the path still names the file it locked and otherwise starts over, so the file does not
  stay behind and no two processes ever hold the lock at once.
flock locks belong to the open file, so two threads of one process exclude each other as well.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from onnxgen.errors import OnnxgenError

_SUFFIX_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"
_SUFFIX = "[a-z0-9_]{8}"  # also what tempfile made in older onnxgen versions, so their leftovers match


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _suffix() -> str:
    return "".join(random.SystemRandom().choice(_SUFFIX_CHARS) for _ in range(8))


def make_staging_dir(target: Path, kind: str) -> Path:
    """A new empty `.KIND-NAME.XXXXXXXX` directory beside `target` (mode 0o777 less the umask)."""
    while True:
        path = target.parent / f".{kind}-{target.name}.{_suffix()}"
        try:
            path.mkdir(mode=0o777)
            return path
        except FileExistsError:
            continue


def staging_file_name(target: Path) -> Path:
    """A `.NAME.XXXXXXXX.partial` path beside `target` (the caller creates it with O_EXCL)."""
    return target.parent / f".{target.name}.{_suffix()}.partial"


def _stale_pattern(name: str) -> re.Pattern[str]:
    n = re.escape(name)
    return re.compile(rf"\.(?:building|replaced|download)-{n}[.-]{_SUFFIX}|\.{n}\.{_SUFFIX}\.partial")


def leftovers(target: Path) -> list[Path]:
    """Staging entries of `target` in its folder (stale only if the target's lock is free)."""
    pattern = _stale_pattern(target.name)
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    return sorted(target.parent / n for n in names if pattern.fullmatch(n))


def remove_leftovers(target: Path) -> list[Path]:
    """Delete the staging entries of `target`; call only with its lock held."""
    found = leftovers(target)
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found


def _open_locked(path: Path, blocking: bool, what: str, error: type[OnnxgenError]) -> int | None:
    announced = False
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise error(f"cannot create the lock file {path}: {e.strerror}; {path.parent} must be writable") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not blocking:
                    os.close(fd)
                    return None
                if not announced:
                    print(f"onnxgen: waiting for another onnxgen process that is writing {what}", file=sys.stderr,
                          flush=True)  # fmt: skip
                    announced = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)  # the previous holder removed the file we waited on: lock the current one


def _release(fd: int, path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
    os.close(fd)


@contextlib.contextmanager
def held(target: Path, what: str, error: type[OnnxgenError]) -> Iterator[None]:
    """Hold `target`'s lock (waiting for it, with one line on stderr if another process has it)."""
    path = lock_path(target)
    fd = _open_locked(path, True, what, error)
    assert fd is not None
    try:
        yield
    finally:
        _release(fd, path)


def clean_if_idle(target: Path) -> None:
    """Remove `target`'s staging leftovers if no process holds its lock now (never waits).

    Cheap when there are none (one directory listing), so it can run on the fast cache-hit path;
    a read-only cache is left as it is.
    """
    if not leftovers(target):
        return
    path = lock_path(target)
    try:
        fd = _open_locked(path, False, "", OnnxgenError)
    except OnnxgenError:
        return
    if fd is None:
        return
    try:
        remove_leftovers(target)
    finally:
        _release(fd, path)


def is_disk_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)
