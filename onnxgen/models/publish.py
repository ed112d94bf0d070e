"""Build a package directory beside its target, then move it into place in one rename.

Invariants (the caller holds the target's lock, see cache_lock):
- the build writes only into a fresh staging directory in the target's folder (the same file
  system, so the final rename is atomic and readers see the old package or the new one, never
  a mix);
- an existing target is replaced only when it is empty or `foreign` finds nothing in it that is
  not ours (no `foreign`: a cache entry, ours by construction); it is checked again right before
  the rename and once more after moving it aside, since other programs may write into it while
  the build runs;
- on any failure the staging directory is removed, and an OSError (a full disk, a permission)
  becomes one error line that names the file and says that nothing was kept.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from onnxgen.errors import OnnxgenError
from onnxgen.models import cache_lock
from onnxgen.models.package_files import write_marker


def disk_error(e: OSError, staging: Path | None, target: Path, error: type[OnnxgenError]) -> OnnxgenError:
    """The one-line error for an OSError while writing `target` (staging paths shown as the target's)."""
    name = str(e.filename or target)
    if staging is not None:
        name = name.replace(str(staging), str(target))
    if cache_lock.is_disk_full(e):
        return error(
            f"no space left on device while writing {name}; nothing was kept (the partial files were removed). "
            f"Free some space on the disk that holds {target.parent} and run again"
        )
    return error(f"could not write {name}: {e.strerror or e}; nothing was kept (the partial files were removed)")


def build_directory(
    target: Path,
    build: Callable[[Path], None],
    *,
    source: str,
    foreign: Callable[[Path], list[str]] | None,
    error: type[OnnxgenError],
) -> Path:
    """Run `build(staging)`, mark the result as onnxgen's, and publish it at `target`.

    `foreign(directory)` lists the names in an existing target that onnxgen did not write; any
    such name stops the replacement (raised as `error`).
    """
    staging = None
    try:
        staging = cache_lock.make_staging_dir(target, "building")
        build(staging)
        write_marker(staging, source)
        _publish(staging, target, foreign, error)
    except OSError as e:
        raise disk_error(e, staging, target, error) from None
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _publish(
    staging: Path, target: Path, foreign: Callable[[Path], list[str]] | None, error: type[OnnxgenError]
) -> None:
    if not target.exists() and not target.is_symlink():
        os.rename(staging, target)
        return
    if target.is_dir() and not any(target.iterdir()):
        try:
            os.rename(staging, target)  # replaces an empty directory atomically; fails if it filled meanwhile
            return
        except OSError:
            pass
    _refuse_foreign(target, target, foreign, error)
    aside = cache_lock.make_staging_dir(target, "replaced")
    os.rename(target, aside / target.name)
    try:
        _refuse_foreign(aside / target.name, target, foreign, error)
        os.rename(staging, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rename(aside / target.name, target)  # put it back untouched
            aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _refuse_foreign(
    path: Path, target: Path, foreign: Callable[[Path], list[str]] | None, error: type[OnnxgenError]
) -> None:
    names = foreign(path) if foreign is not None else []
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise error(f"{target} gained files during the build ({shown}); it was not replaced and the new build was "
                    "discarded")  # fmt: skip
