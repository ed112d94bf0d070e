"""`onnxgen run` keeps the chat whatever comes in (long histories, long messages, random bytes,
unknown commands, Ctrl-C, EOF); `onnxgen generate` and friends give messages, not tracebacks, for
bad arguments and a closed stdout. The history rule is unit-tested with a small context."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onnxgen.genai.chat_session import ChatSession, reply_reserve
from tests.cli_in_process import onnxgen_in_process

# -- the history rule, with a counting encoder: 1 token per word, 2 per message, 3 for the generation prompt


def words(messages: list[dict[str, str]]) -> list[int]:
    return [0] * (3 + sum(2 + len(m["content"].split()) for m in messages))


def test_history_drops_oldest_exchanges_until_prompt_and_reserve_fit():
    session = ChatSession(words, context_length=36, reserve=10)
    fit = session.fit("one two three")  # 3 + 5 = 8 tokens
    assert (fit.tokens, fit.dropped, fit.refused) == (8, 0, False)
    session.add(fit, "one two three", "a b c d e")  # the exchange: 5 + 7 = 12 tokens
    fit = session.fit("x")  # 3 + 12 + 3 = 18
    assert (fit.tokens, fit.dropped) == (18, 0)
    session.add(fit, "x", "y z")  # the exchange: 3 + 4 = 7
    # 3 + 12 + 7 + "p q r s" (6) = 28 tokens, 28 + 10 > 36: the oldest exchange goes, 16 + 10 fits
    fit = session.fit("p q r s")
    assert (fit.tokens, fit.dropped) == (16, 1)
    assert session.turns == [("one two three", "a b c d e"), ("x", "y z")], "fit() leaves the history alone"
    session.add(fit, "p q r s", "ok")
    assert session.turns == [("x", "y z"), ("p q r s", "ok")]


def test_a_message_that_fits_alone_drops_all_history_and_one_that_does_not_is_refused():
    session = ChatSession(words, context_length=40, reserve=10, system="be brief")  # system: 4 tokens
    session.add(session.fit("a"), "a", "b")
    session.add(session.fit("c"), "c", "d")
    long = " ".join(["w"] * 22)  # 3 + 4 + 24 = 31 tokens alone: 31 + 10 > 40
    refused = session.fit(long)
    assert refused.refused and refused.tokens == 31 and refused.dropped == 0
    assert session.turns == [("a", "b"), ("c", "d")], "the history is kept"
    with pytest.raises(ValueError):
        session.add(refused, long, "")
    fit = session.fit(" ".join(["w"] * 19))  # 3 + 4 + 21 = 28: 28 + 10 <= 40 alone, not with one exchange (+6)
    assert (fit.tokens, fit.dropped) == (28, 2)
    session.add(fit, "w", "r")
    assert session.turns == [("w", "r")] and session.system == "be brief"


def test_reply_reserve():
    assert reply_reserve(160, 8) == 8
    assert reply_reserve(160, 1000) == 80  # at most half the context
    assert reply_reserve(160, None) == 40  # a quarter of it
    assert reply_reserve(1, None) == 1


# -- the CLI, driven as a user would, on the real default model -------------------------------


def onnxgen(*args, stdin: bytes | str | None = None, timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return subprocess.run([sys.executable, "-m", "onnxgen", *args], input=data, timeout=timeout, **kw)


def err(result: subprocess.CompletedProcess) -> str:
    return result.stderr.decode(errors="replace")


@pytest.fixture(scope="module")
def package() -> Path:
    """The cached int4 CPU package of the default model (read only; the CI fixture pulls it)."""
    from onnxgen.errors import RegistryUnreachableError
    from onnxgen.models.pull import ensure_package

    try:
        return ensure_package("smollm2-135m-instruct", device="cpu", precision="int4", attention="gqa")
    except RegistryUnreachableError as exc:
        pytest.skip(f"cannot pull the default model: {exc}")


@pytest.fixture(scope="module")
def small_context(package: Path, tmp_path_factory) -> Path:
    """The same package with a 96-token context (genai_config.json only; the graph's rotary cache
    covers the model's full context, so a shorter one is a prefix of it)."""
    directory = tmp_path_factory.mktemp("small-context")
    for item in package.iterdir():
        if item.name != "genai_config.json":  # a hard link: the loader refuses data outside the directory
            try:
                os.link(item, directory / item.name)
            except OSError:
                shutil.copy(item, directory / item.name)
    config = json.loads((package / "genai_config.json").read_text())
    config["model"]["context_length"] = config["search"]["max_length"] = 96
    (directory / "genai_config.json").write_text(json.dumps(config))
    return directory


COUNT = "Count from 1 to 50, please."


def test_chat_keeps_going_when_the_history_or_a_message_does_not_fit(small_context):
    script = "\n".join(
        [COUNT] * 4 + ["word " * 200, COUNT, "/nope", "//" + COUNT, "/help", "caf\xe9 \udcff ok", "/stats"]
    )
    result = onnxgen("run", "-m", str(small_context), "-n", "4", stdin=script.encode(errors="surrogateescape"))
    stderr = err(result)
    assert result.returncode == 0, stderr
    assert "Traceback" not in stderr
    # each message of COUNT is answered (and its reply cut at 12 tokens), the long one is not
    assert stderr.count("(reply cut at --max-new-tokens 4)") == 6, stderr  # 5 x COUNT + the // one
    assert "dropped the oldest" in stderr and "kept for the reply" in stderr
    assert "message not sent" in stderr and "history is kept" in stderr
    assert "unknown command /nope" in stderr
    assert "/reset" in stderr and "/system" in stderr and "//" in stderr  # /help
    assert "not valid UTF-8" in stderr and "0xff" in stderr
    assert "bye" in stderr.splitlines()[-1]


def test_chat_without_max_new_tokens_says_when_the_context_is_full(small_context):
    # a request whose reply runs past the 96-token context (the model answers COUNT with a short refusal)
    story = "Write a long story about a dragon."
    result = onnxgen("run", "-m", str(small_context), stdin=f"{story}\n{story}\n")
    stderr = err(result)
    assert result.returncode == 0 and "Traceback" not in stderr, stderr
    assert "(reply cut: the context is full" in stderr
    assert "dropped the oldest 1 exchange" in stderr  # the second message: the first exchange filled the context


def test_chat_survives_random_bytes(package):
    noise = random.Random(15).randbytes(3000)
    result = onnxgen("run", "-m", str(package), "-n", "2", stdin=noise)
    stderr = err(result)
    assert result.returncode == 0, stderr
    assert "Traceback" not in stderr and "bye" in stderr.splitlines()[-1]


def test_ctrl_c_at_the_prompt_asks_then_leaves(package):
    proc = subprocess.Popen(
        [sys.executable, "-m", "onnxgen", "run", "-m", str(package)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # a test runner started as a background job inherits SIGINT ignored, and Python then never
        # raises KeyboardInterrupt: give the chat the Ctrl-C a terminal user has
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        banner = proc.stderr.readline().decode()  # printed once the model is loaded, before the prompt
        assert "/help" in banner, banner
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    rest = rest.decode()
    assert proc.returncode == 0, rest
    assert "Ctrl-C again" in rest and "bye" in rest and "Traceback" not in rest


# -- generate: arguments and a closed stdout -----------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", str(2**64)], f"seed must be >= 0 and < 2**64, got {2**64}"),
        (["--seed", "-1"], "seed must be >= 0"),
        (["--temperature", "nan"], "temperature must be a finite number, got nan"),
        (["--top-p", "nan"], "top_p must be a finite number, got nan"),
    ],
)
def test_generate_refuses_bad_sampling_arguments(package, args, message):
    result = onnxgen_in_process("generate", "-m", str(package), "-p", "hi", *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_generate_refuses_a_prompt_that_is_not_utf8(package):
    result = onnxgen("generate", "-m", str(package), "-p", os.fsdecode(b"caf\xe9"))
    assert result.returncode == 2, err(result)
    assert "not valid UTF-8" in err(result) and "U+DCE9" in err(result) and "Traceback" not in err(result)


def test_tiny_temperature_is_greedy(package):
    """Through the Python API, one model load for the four generations (the CLI passes these values
    through unchanged: the refusals above show its checks)."""
    from onnxgen.genai import Generator, SamplingParams

    generator = Generator(package)
    greedy = generator.generate("The capital of France is", SamplingParams(max_new_tokens=6))
    tiny = generator.generate(
        "The capital of France is",
        SamplingParams(max_new_tokens=6, temperature=1e-39, repetition_penalty=1e-45, seed=3),
    )
    # a penalty of ~0 favours the seen tokens; the draw itself must not fail: tokens come out
    assert greedy.strip() and tiny.strip()
    # the five greedy tokens of this prompt each lead the next by at least 0.38 in onnxruntime's logits
    # of the same package. Where two logits tie, a tiny temperature draws among the tied tokens and
    # greedy takes the first (test_sampling_inputs.py checks that case on fixed logits): after
    # "The capital of France is Paris", ")." leads "," by 0.07 in onnxruntime's logits and the two tie
    # in onnxgen's int4 logits, so that prompt cannot show the draw to be greedy.
    prompt = "The first president of the United States was"
    no_penalty = generator.generate(prompt, SamplingParams(max_new_tokens=5, temperature=1e-39, seed=3))
    assert no_penalty == generator.generate(prompt, SamplingParams(max_new_tokens=5))


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "-p", "Count from 1 to 20.", "-n", "6"],
        ["list"],
        ["show", "{package}"],
        ["bench", "-n", "2", "--prompt-tokens", "2", "--repeats", "1"],
    ],
    ids=["generate", "list", "show", "bench"],
)
def test_a_closed_stdout_ends_quietly(package, args):
    """`onnxgen ... | head` once head has gone: no traceback, no 'Exception ignored', the SIGPIPE status."""
    args = [a.replace("{package}", str(package)) for a in args]
    if args[0] in ("generate", "bench"):
        args += ["-m", str(package)]
    read, write = os.pipe()
    os.close(read)
    try:
        result = onnxgen(*args, stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    stderr = result.stderr.decode()
    assert "Traceback" not in stderr and "Exception ignored" not in stderr and "BrokenPipe" not in stderr, stderr
    assert result.returncode == 141, stderr


def test_stdout_on_a_full_disk_or_closed_is_one_error_line(package):
    """`onnxgen generate > /dev/full` and `onnxgen generate >&-`: one error line, exit 2, no traceback."""
    args = ["generate", "-p", "Hi", "-n", "4", "-m", str(package)]
    with open("/dev/full", "wb") as full:
        result = onnxgen(*args, stdout=full, stderr=subprocess.PIPE)
    stderr = result.stderr.decode()
    assert result.returncode == 2 and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        "onnxgen: error: cannot write the output to stdout: No space left on device"
    ), stderr
    closed = subprocess.run(
        [sys.executable, "-m", "onnxgen", *args], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
        close_fds=True, pass_fds=(), preexec_fn=lambda: os.close(1), timeout=300,
    )  # fmt: skip
    stderr = closed.stderr.decode()
    assert closed.returncode == 2 and "Traceback" not in stderr, stderr
    assert "stdout is closed" in stderr, stderr


def test_run_without_a_chat_template_says_so_before_the_first_message(package, tmp_path):
    """A package whose tokenizer files hold no chat template: `run` refuses at start (exit 2) instead
    of refusing every message the user types."""
    for item in package.iterdir():
        if item.name != "tokenizer_config.json":
            try:
                os.link(item, tmp_path / item.name)
            except OSError:
                shutil.copy(item, tmp_path / item.name)
    config = json.loads((package / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    result = onnxgen("run", "-m", str(tmp_path), "-n", "2", stdin="Hello\n")
    assert result.returncode == 2 and "Traceback" not in err(result), err(result)
    assert "chat_template" in err(result).strip().splitlines()[-1], err(result)
    assert result.stdout == b""
