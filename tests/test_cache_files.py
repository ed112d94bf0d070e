"""Files on disk: `onnxgen build -o`, pulls and the model cache never lose, half-write or misuse files.

Everything runs offline in temporary ONNXGEN_HOME folders: a tiny GGUF (written by the gguf
package) is shipped in a local wheel that pip installs from a --find-links folder (PIP_NO_INDEX and
PIP_FIND_LINKS in the environment, so subprocesses use it too), under a registry entry added for
the test. A full disk is simulated by making one write raise OSError(ENOSPC).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from onnxgen.errors import ModelFetchError, ModelLoadError, OnnxgenError
from onnxgen.models import fetch, pull, registry
from onnxgen.models.builder import BuildError
from onnxgen.models.package_files import MARKER
from onnxgen.models.registry import KnownModel, WheelPart
from tests.test_models_source import _wheel, write_gguf

NAME = "test-tiny"
PACKAGE = f"{NAME}-int4-cpu-gqa"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, KnownModel]:
    """(GGUF file, wheel folder, registry entry) of a two-layer model."""
    root = tmp_path_factory.mktemp("tiny")
    gguf = root / "tiny.gguf"
    write_gguf(gguf)
    data = gguf.read_bytes()
    wheels = root / "wheels"
    wheels.mkdir()
    _wheel(wheels, "onnxgen-test-tiny", "0.0.1", {"onnxgen_test_tiny/model.gguf": data})
    parts = (WheelPart("onnxgen-test-tiny", "0.0.1", "onnxgen_test_tiny/*.gguf"),)
    entry = KnownModel(NAME, "Test tiny", "llama", "F32", "none", parts, hashlib.sha256(data).hexdigest(), len(data))
    return gguf, wheels, entry


@pytest.fixture
def home(tmp_path, monkeypatch, tiny) -> Path:
    """A fresh models home with the test model registered (also for subprocesses, see CHILD)."""
    _, wheels, entry = tiny
    home = tmp_path / "home"
    monkeypatch.setenv("ONNXGEN_HOME", str(home))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setitem(registry.MODELS, NAME, entry)
    return home


# A CLI process that knows the test model.
CHILD = """
import json, sys
from onnxgen.models import registry
from onnxgen.models.registry import KnownModel, WheelPart
e = json.loads(sys.argv[1])
e["parts"] = tuple(WheelPart(**p) for p in e["parts"])
registry.MODELS[e["name"]] = KnownModel(**e)
from onnxgen.cli import main
sys.exit(main(sys.argv[2:]))
"""


def child(entry: KnownModel, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(asdict(entry)), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def onnxgen(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "onnxgen", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), **(env or {})},
    )


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def wait_for(proc: subprocess.Popen, text: str) -> str:
    """Read the child's stderr until `text` shows (it is then blocked) or it exits (it did not wait)."""
    seen = []
    while line := proc.stderr.readline():
        seen.append(line)
        if text in line:
            return "".join(seen)
    proc.wait()
    pytest.fail(f"the second process never waited for the first; its stderr:\n{''.join(seen)}")


# --------------------------------------------------------------- `onnxgen build -o`


def test_build_keeps_a_file_written_into_the_output_during_the_build(tiny, tmp_path, monkeypatch):
    gguf, _, _ = tiny
    out = tmp_path / "out"
    out.mkdir()
    real = pull._build_into

    def build_and_meddle(*args, **kwargs):
        real(*args, **kwargs)
        (out / "notes.txt").write_text("mine")  # another program writes into the directory meanwhile

    monkeypatch.setattr(pull, "_build_into", build_and_meddle)
    with pytest.raises(BuildError, match=r"out gained files during the build \(notes\.txt\).*not replaced"):
        pull.build_from_source(gguf, out, precision="int4", device="cpu", attention="gqa")
    assert tree(tmp_path) == ["out", "out/notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_build_refuses_int4_zero_points_on_another_precision(tiny, tmp_path):
    gguf, _, _ = tiny
    done = onnxgen("build", str(gguf), "-o", str(tmp_path / "pkg"), "--precision", "fp16", "--int4-zero-points",
                   "packed")  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--int4-zero-points applies to int4 builds; this one is --precision fp16" in done.stderr
    assert not (tmp_path / "pkg").exists()


def test_build_output_checks_before_building(tiny, tmp_path):
    gguf, _, _ = tiny
    (tmp_path / "keep.txt").write_text("x")
    here = onnxgen("build", str(gguf), "-o", ".", cwd=tmp_path)
    assert here.returncode == 2 and "Traceback" not in here.stderr, here.stderr
    assert "-o . is the current directory" in here.stderr and "build" not in here.stderr.split("error:")[0]
    file = onnxgen("build", str(gguf), "-o", str(tmp_path / "keep.txt"))
    assert file.returncode == 2 and "Traceback" not in file.stderr, file.stderr
    assert "keep.txt exists and is a file" in file.stderr
    foreign = onnxgen("build", str(gguf), "-o", str(tmp_path))
    assert foreign.returncode == 2 and "not written by onnxgen (keep.txt)" in foreign.stderr, foreign.stderr
    assert tree(tmp_path) == ["keep.txt"] and (tmp_path / "keep.txt").read_text() == "x"


def test_build_output_mode_and_rebuild_of_own_package(tiny, tmp_path):
    gguf, _, _ = tiny
    out = tmp_path / "pkg"
    old = os.umask(0o022)
    try:
        pull.build_from_source(gguf, out, precision="int4", device="cpu", attention="gqa")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    first = tree(out)
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json"} <= set(first)
    # A package onnxgen built may be rebuilt in place; one with a foreign file may not.
    pull.build_from_source(gguf, out, precision="fp32", device="cpu", attention="gqa")
    assert tree(out) == first and json.loads((out / "genai_config.json").read_text())["model"]["type"] == "llama"
    (out / "mine.txt").write_text("x")
    with pytest.raises(BuildError, match=r"not written by onnxgen \(mine\.txt\)"):
        pull.build_from_source(gguf, out, precision="int4", device="cpu", attention="gqa")
    assert (out / "mine.txt").read_text() == "x"
    assert tree(tmp_path) == sorted(["pkg", *[f"pkg/{n}" for n in [*first, "mine.txt"]]])


def test_build_rejects_non_finite_weights_naming_the_tensor(tmp_path):
    bad = {"blk.1.ffn_up.weight": np.full((128, 64), np.nan, np.float32)}
    write_gguf(tmp_path / "nan.gguf", weights=bad)
    with pytest.raises(BuildError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*8192 non-finite.*nan\.gguf"):
        pull.build_from_source(tmp_path / "nan.gguf", tmp_path / "out", precision="fp32", device="cpu",
                               attention="gqa")  # fmt: skip
    huge = {"blk.0.attn_norm.weight": np.full((64,), 1e6, np.float32)}
    write_gguf(tmp_path / "huge.gguf", weights=huge)
    with pytest.raises(BuildError, match=r"input_layernorm\.weight.*float16.*--precision fp32"):
        pull.build_from_source(tmp_path / "huge.gguf", tmp_path / "out", precision="fp16", device="cpu",
                               attention="gqa")  # fmt: skip
    assert tree(tmp_path) == ["huge.gguf", "nan.gguf"]


def test_full_disk_during_build_keeps_the_old_package(home, monkeypatch):
    """ENOSPC is simulated: the external-data write raises OSError(ENOSPC) part-way."""
    target = pull.ensure_package(NAME)
    before = {p: p.read_bytes() for p in target.iterdir()}
    from onnxgen.models import graph_writer

    real = graph_writer.GraphWriter._store
    calls = []

    def store(self, tensor, raw):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.model_path) + ".data")
        return real(self, tensor, raw)

    monkeypatch.setattr(graph_writer.GraphWriter, "_store", store)
    with pytest.raises(OnnxgenError, match=r"no space left on device.*model\.onnx\.data.*nothing was kept"):
        pull.ensure_package(NAME, force=True)
    assert {p: p.read_bytes() for p in target.iterdir()} == before
    assert [p for p in tree(home) if ".building-" in p or ".partial" in p or ".download-" in p] == []


def test_full_disk_during_pull_leaves_nothing(home, tiny, monkeypatch):
    """ENOSPC is simulated: writing the GGUF raises OSError(ENOSPC)."""
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, _data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(fetch.os, "fdopen", lambda *a, **k: Full(real_fdopen(*a, **k)))
    with pytest.raises(ModelFetchError, match=rf"no space left on device.*{NAME}\.gguf.*nothing was kept"):
        fetch.pull(NAME, progress=False)
    assert [p for p in tree(home) if not p.endswith(".lock")] == ["gguf"]


def test_pip_hitting_a_file_size_limit_is_named(home, tiny, monkeypatch):
    """pip's own words when a write passes RLIMIT_FSIZE (what `ulimit -f` does; the battery runs it
    for real): an internal-error banner, then the OSError on the last line of its traceback."""
    said = (
        'ERROR: Exception:\nTraceback (most recent call last):\n  File "pip/_internal/cli/base_command.py"\n'
        "OSError: [Errno 27] File too large\n"
    )
    monkeypatch.setattr(
        fetch.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2, stdout=said, stderr=None)
    )
    with pytest.raises(ModelFetchError, match=r"^pip could not write .*File too large.*nothing was kept"):
        fetch.pull(NAME, progress=False)
    assert [p for p in tree(home) if not p.endswith(".lock")] == ["gguf"]


# --------------------------------------------------------------- the cache


def test_damaged_cached_gguf_is_detected_and_pulled_again(home, tiny, capsys):
    path = fetch.pull(NAME, progress=False)
    good = path.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    path.write_bytes(bytes(data))
    assert fetch.cached_gguf(NAME) is None
    assert pull.ensure_package(NAME) == home / "packages" / PACKAGE
    assert "does not match its pinned sha256" in capsys.readouterr().err
    assert path.read_bytes() == good


def test_incomplete_package_is_listed_and_named_on_use(home, tiny):
    target = pull.ensure_package(NAME)
    assert pull.is_complete_package(target)
    (target / "model.onnx.data").unlink()
    assert not pull.is_complete_package(target)
    assert f"{PACKAGE}" in pull.list_models() and "(incomplete" in pull.list_models()
    with pytest.raises(ModelLoadError, match=rf"model\.onnx\.data.*onnxgen pull {NAME} --force"):
        pull.ensure_package(NAME)
    pull.ensure_package(NAME, force=True)  # a truncated data file is no better than a missing one
    data = target / "model.onnx.data"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    assert not pull.is_complete_package(target)
    pull.ensure_package(NAME, force=True)
    assert pull.is_complete_package(target)


def test_two_pulls_are_serialised(home, tiny, monkeypatch):
    """The first process holds the package's lock while it builds; the second waits, then finds it built."""
    _, _, entry = tiny
    real = pull._build_into
    second: list[subprocess.Popen] = []

    def build_while_another_waits(*args, **kwargs):
        second.append(child(entry, "pull", NAME))
        wait_for(second[0], "waiting for another onnxgen process")
        real(*args, **kwargs)

    monkeypatch.setattr(pull, "_build_into", build_while_another_waits)
    target = pull.ensure_package(NAME)
    built = (target / "model.onnx").stat().st_mtime_ns
    proc = second[0]
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == str(target), err
    assert "build " not in err and "Traceback" not in err  # it did not build again
    assert (target / "model.onnx").stat().st_mtime_ns == built


def test_two_forced_pulls_are_serialised(home, tiny, monkeypatch):
    _, _, entry = tiny
    pull.ensure_package(NAME)
    real = pull._build_into
    second: list = []

    def build_while_another_waits(*args, **kwargs):
        second.append(child(entry, "pull", NAME, "--force"))
        wait_for(second[0], "waiting for another onnxgen process")
        real(*args, **kwargs)

    monkeypatch.setattr(pull, "_build_into", build_while_another_waits)
    target = pull.ensure_package(NAME, force=True)
    out, err = second[0].communicate(timeout=60)
    assert second[0].returncode == 0 and out.strip() == str(target), err
    assert "rebuilt by another onnxgen process" in err and "Traceback" not in err


def test_killed_build_leftovers_are_cleaned_by_the_next_run(home, tiny):
    _, _, entry = tiny
    gguf_dir, packages = home / "gguf", home / "packages"
    packages.mkdir(parents=True)
    gguf_dir.mkdir()
    # What a killed process leaves: a staging package, a wheel folder and a partial GGUF.
    (packages / f".building-{PACKAGE}.abcdefgh").mkdir()
    (packages / f".building-{PACKAGE}.abcdefgh" / "model.onnx.data").write_bytes(b"0" * 1000)
    (gguf_dir / f".download-{NAME}.gguf.ab_12xyz").mkdir()
    (gguf_dir / f".{NAME}.gguf.k3j4h5g6.partial").write_bytes(b"0" * 1000)
    (packages / ".building-other-model.abcdefgh").mkdir()  # another target's: not ours to judge here
    pull.ensure_package(NAME)
    hidden = [p for p in tree(home) if "/." in "/" + p and not p.endswith(MARKER)]
    assert hidden == ["packages/.building-other-model.abcdefgh"]
    # ... also when the package is complete and only a killed `pull --force` left its staging behind
    (packages / f".building-{PACKAGE}.zzzzzzzz").mkdir()
    pull.ensure_package(NAME)
    assert not (packages / f".building-{PACKAGE}.zzzzzzzz").exists()


def test_models_home_that_cannot_be_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    for home in (tmp_path / "file", tmp_path / "file" / "below"):
        result = onnxgen("pull", "smollm2-135m-instruct", env={"ONNXGEN_HOME": str(home), "PIP_NO_INDEX": "1"})
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "ONNXGEN_HOME" in result.stderr and str(tmp_path / "file") in result.stderr
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_models_home_under_a_read_only_parent(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    result = onnxgen("pull", "smollm2-135m-instruct", env={"ONNXGEN_HOME": str(parent / "home"), "PIP_NO_INDEX": "1"})
    assert result.returncode == 2 and "Traceback" not in result.stderr and "ONNXGEN_HOME" in result.stderr


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="needs a machine where torch sees no CUDA device")
# generate, run and bench share _load_generator's check; pull has its own.
@pytest.mark.parametrize("command", [["pull", NAME], ["generate", "-m", NAME, "-p", "hi"]])
def test_device_cuda_without_cuda_fails_before_any_pull(home, tiny, command):
    _, _, entry = tiny
    proc = child(entry, *command, "--device", "cuda")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert "--device cuda" in err and "torch sees no CUDA device" in err
    assert not home.exists()
