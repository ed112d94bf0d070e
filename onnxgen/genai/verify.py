"""``onnxgen verify``: a package's path checked against a reference by teacher forcing.

For each prompt the reference records a fixed context (the prompt, then ``tokens`` greedy tokens of
its own); then the path under test and the reference both read that same context, and each
position's logits are compared (agreement.py: top-1 agreement, KL divergence, near-ties). Because
both read the recorded tokens, a difference at one position cannot move the later ones: each
position is judged on its own.

References:
- ``"fp32"`` (default): the same package's graph with float32 arithmetic and its weights
  dequantized (runtime/fp32_reference.py), on the same device, in one pass over the context.
- ``"eager"``: the same package on the same device through the decode engine's eager one-token
  steps (capture off): against ``capture="on"`` it shows what capture changes (it must be nothing).
- a package directory: another package of the same model (the fp32 build against the int4 one,
  onnxruntime-genai's package against onnxgen's), as it is, in one pass.

Paths under test (``capture``): None runs the package's graph in one pass over the context (the
prompt path's kernels); "off" and "on" run it through the decode engine: the prompt as one prefill,
then one-token decode steps, eager or captured (CUDA graphs; on the CPU only with a test recorder).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from onnxgen.errors import ModelLoadError, OnnxgenError
from onnxgen.genai.agreement import Agreement
from onnxgen.genai.engine import DecodeEngine, engine_model
from onnxgen.genai.graph_layout import with_graph_layout
from onnxgen.genai.package import PackageConfig, load_package_config
from onnxgen.genai.package_checks import check_package
from onnxgen.genai.prompt_text import PromptText, checked_prompt_ids
from onnxgen.genai.teacher_forcing import decode_forced, prefill_logits
from onnxgen.genai.verify_report import VerifyReport
from onnxgen.runtime.fp32_reference import fp32_reference
from onnxgen.runtime.model_io import load_model
from onnxgen.runtime.session import InferenceSession, resolve_device
from onnxgen.threads import ThreadOptions

# The near-tie threshold, in logits: where the reference prefers its token over the path's by less
# than this, the two tokens are within e^0.5 (about 1.65x) of each other in probability, and the
# rounding of a lower precision can flip them (docs/verify.md).
DEFAULT_NEAR_TIE = 0.5
DEFAULT_MIN_AGREEMENT = 0.9
DEFAULT_TOKENS = 64
# Prompts of different kinds (prose, code, a list, a question), so the recorded contexts do not all
# stay in one register.
DEFAULT_PROMPTS = (
    "The lighthouse keeper climbed the stairs at dusk, as he had every evening for thirty years,",
    "def fibonacci(n):\n    ",
    "Three things to pack for a week of hiking in the mountains:",
    "Why does the sky look blue during the day but red at sunset?",
)
SHAPE_FIELDS = ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_size", "hidden_size")


class VerifyError(OnnxgenError):
    """verify's inputs do not fit together (packages of different models, a context too long, a
    capture that cannot run here); the message says what was expected."""


@dataclass
class VerifySpec:
    """What ``run_verify`` checks. ``prompts``: texts (encoded with the package's tokenizer, with its
    chat template if ``chat``) or token id lists. ``all_positions``: score the prompt's positions too
    (default: the generated tokens' only). ``recorder``: a CPU stand-in for CUDA graphs (tests).
    ``max_kl``: fail where the mean KL divergence exceeds it (None: no limit). ``allow_real``: real
    disagreements are reported but do not fail (a reference with other weights, where quantization
    moves logits by more than rounding does). ``threads`` (CPU): torch's thread count, as the
    Generator sets it (onnxgen/threads.py: by default half the cores)."""

    package: Path
    reference: str = "fp32"
    device: str = "cpu"
    capture: str | None = None
    prompts: Sequence[str | list[int]] = DEFAULT_PROMPTS
    tokens: int = DEFAULT_TOKENS
    chat: bool = False
    all_positions: bool = False
    near_tie: float = DEFAULT_NEAR_TIE
    min_agreement: float = DEFAULT_MIN_AGREEMENT
    max_kl: float | None = None
    allow_real: bool = False
    kv: str = "auto"
    threads: ThreadOptions | None = None
    recorder: object = None
    progress: Callable[[str], None] = field(default=lambda line: None)


@dataclass
class _Side:
    """One side of the comparison, loaded: how it runs a context."""

    name: str
    config: PackageConfig
    session: InferenceSession | None = None  # the graph with a logits row per token (one pass)
    engine: DecodeEngine | None = None  # the decode engine (decode steps, and the reference's greedy tokens)


def run_verify(spec: VerifySpec) -> VerifyReport:
    """Checks the inputs (before any weight is read), loads both sides, records each context with the
    reference and compares every scored position. Raises VerifyError (or the package's own load error)
    on bad input; a failed comparison is a report whose ``passed`` is False."""
    _check_numbers(spec)
    device = resolve_device(spec.device)
    if device.type == "cpu":  # as the Generator does: a full thread pool stalls where cores are shared
        (spec.threads or ThreadOptions()).apply()
    if spec.capture not in (None, "on", "off"):
        raise VerifyError(f"capture must be 'on', 'off' or None (one pass), got {spec.capture!r}")
    if spec.capture == "on" and device.type != "cuda" and spec.recorder is None:
        raise VerifyError(
            "--capture on runs the captured decode steps, which need CUDA graphs: use --device cuda on a machine "
            "with an NVIDIA GPU (on the CPU, --capture off checks the eager decode steps)"
        )
    package = Path(spec.package)
    config = _config(package, "the package")
    reference_dir = _reference_dir(spec.reference)
    ref_config = config if reference_dir is None else _config(reference_dir, "the reference package")
    if reference_dir is not None:
        _check_same_model(config, ref_config)
    text = _prompt_text(config, spec.prompts)
    contexts = [
        text.encode(p, chat=spec.chat) if text else checked_prompt_ids(p, config.vocab_size, config.context_length)
        for p in spec.prompts
    ]
    if reference_dir is not None and text is not None:
        _check_same_tokens(spec, contexts, PromptText(ref_config))
    _check_lengths(spec, contexts, config, ref_config)

    spec.progress(f"loading the reference ({_reference_name(spec.reference)})")
    reference = _load_reference(spec, config, ref_config, device)
    spec.progress(f"loading the package ({_path_name(spec.capture, device)})")
    test = _load_test(spec, config, device)

    agreement = Agreement(spec.near_tie)
    recorded: list[list[int]] = []
    for index, prompt in enumerate(contexts):
        spec.progress(f"context {index + 1}/{len(contexts)}: {len(prompt)} prompt tokens + {spec.tokens}")
        first = 0 if spec.all_positions else len(prompt) - 1  # the first position scored
        reference_rows, context = _reference_rows(spec, reference, prompt, first)
        test_rows = _test_rows(test, context, first)
        agreement.add(index, first, reference_rows, test_rows)
        recorded.append(context)
    return VerifyReport(
        package=str(package),
        reference=_reference_name(spec.reference),
        reference_notes=reference.name,
        device=str(device),
        path=_path_name(spec.capture, device),
        contexts=recorded,
        prompt_lengths=[len(p) for p in contexts],
        all_positions=spec.all_positions,
        min_agreement=spec.min_agreement,
        max_kl=spec.max_kl,
        allow_real=spec.allow_real,
        agreement=agreement,
        tokenizer=text.tokenizer if text else None,
    )


def read_prompts(prompts: Sequence[str] | None, prompts_file: str | None) -> list[str]:
    """The --prompt texts, then the lines of --prompts FILE (blank ones skipped); empty when neither
    is given (the built-in prompts are used)."""
    texts = list(prompts or [])
    if prompts_file is not None:
        path = Path(prompts_file).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise VerifyError(f"cannot read --prompts {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise VerifyError(f"--prompts {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        found = [line for line in lines if line.strip()]
        if not found:
            raise VerifyError(f"--prompts {path} holds no prompt (one per line expected)")
        texts.extend(found)
    return texts


# -- checks before any work -----------------------------------------------------------------


def _check_numbers(spec: VerifySpec) -> None:
    if not isinstance(spec.tokens, int) or spec.tokens < 1:
        raise VerifyError(f"--tokens must be a positive number of tokens to record, got {spec.tokens!r}")
    if not 0.0 <= spec.min_agreement <= 1.0:
        raise VerifyError(f"--min-agreement must be within [0, 1], got {spec.min_agreement}")
    if spec.max_kl is not None and not spec.max_kl >= 0.0:
        raise VerifyError(f"--max-kl must be a non-negative KL divergence (nats), got {spec.max_kl}")
    if not spec.near_tie >= 0.0:
        raise VerifyError(f"--near-tie must be a non-negative logit difference, got {spec.near_tie}")
    if not spec.prompts:
        raise VerifyError("no prompts: give --prompt TEXT or --prompts FILE")


def _reference_dir(reference: str) -> Path | None:
    if reference in ("fp32", "eager"):
        return None
    path = Path(reference).expanduser()
    if not path.is_dir():
        raise VerifyError(
            f"the reference {reference!r} is neither 'fp32', 'eager' nor a package directory (no such directory)"
        )
    return path


def _config(package: Path, what: str) -> PackageConfig:
    if not package.is_dir():
        raise VerifyError(f"{what} {package} is not a directory; expected a model package (genai_config.json, ...)")
    try:
        return load_package_config(package)
    except OnnxgenError as exc:
        raise type(exc)(f"{what} cannot be loaded: {exc}") from None


def _prompt_text(config: PackageConfig, prompts: Sequence[str | list[int]]) -> PromptText | None:
    """The package's tokenizer and prompt checks; None where every prompt is token ids and the
    package has no tokenizer (the report then shows ids only)."""
    if all(not isinstance(p, str) for p in prompts) and not (config.directory / "tokenizer.json").is_file():
        return None
    return PromptText(config)


def _check_same_model(config: PackageConfig, ref: PackageConfig) -> None:
    """Packages of one model agree on the vocabulary and the decoder's shapes (genai_config.json)."""
    differ = []
    for name in SHAPE_FIELDS:
        ours, theirs = getattr(config, name), getattr(ref, name)
        if name == "hidden_size" and 0 in (ours, theirs):
            continue  # not every builder writes it
        if ours != theirs:
            differ.append(f"{name} {ours} vs {theirs}")
    if differ:
        raise VerifyError(
            f"{config.directory} and the reference {ref.directory} are not packages of the same model: "
            f"{', '.join(differ)} (package vs reference; genai_config.json)"
        )


def _check_same_tokens(spec: VerifySpec, contexts: list[list[int]], ref_text: PromptText) -> None:
    for index, prompt in enumerate(spec.prompts):
        if not isinstance(prompt, str):
            continue
        theirs = ref_text.encode(prompt, chat=spec.chat)
        if theirs != contexts[index]:
            raise VerifyError(
                f"the two packages' tokenizers encode prompt {index + 1} differently ({len(contexts[index])} vs "
                f"{len(theirs)} tokens): their token ids would not mean the same text"
            )


def _check_lengths(spec: VerifySpec, contexts: list[list[int]], config: PackageConfig, ref: PackageConfig) -> None:
    for index, prompt in enumerate(contexts):
        total = len(prompt) + spec.tokens
        for what, c in (("the package", config), ("the reference", ref)):
            if total > c.context_length:
                raise VerifyError(
                    f"context {index + 1} is {len(prompt)} prompt tokens + {spec.tokens} recorded = {total} tokens, "
                    f"longer than {what}'s context of {c.context_length} tokens ({c.directory}); use a shorter "
                    "prompt or fewer --tokens"
                )


# -- loading --------------------------------------------------------------------------------


@contextmanager
def _loading(what: str, where: Path) -> Iterator[None]:
    """A load failure as one error that names the package: the loader's own (an OnnxgenError, its
    type kept), or any other exception of a package damaged past what the loader checks, without a
    traceback."""
    try:
        yield
    except OnnxgenError as exc:
        raise type(exc)(f"{what} {where} cannot be loaded: {exc}") from None
    except Exception as exc:
        raise ModelLoadError(f"{what} {where} cannot be loaded: {type(exc).__name__}: {exc}") from None


def _graph(config: PackageConfig, what: str) -> tuple[onnx.ModelProto, Path, PackageConfig]:
    """The package's graph (weights not read yet), checked against its config."""
    with _loading(what, config.directory):
        proto, model_dir = load_model(config.model_file)
        check_package(config, proto)
        return proto, model_dir, with_graph_layout(config, proto)


def _session(model: onnx.ModelProto, model_dir: Path, device: torch.device, what: str, where: Path) -> InferenceSession:
    with _loading(what, where):
        return InferenceSession(model, device=device, base_dir=model_dir)


def _engine(session: InferenceSession, config: PackageConfig, spec: VerifySpec, capture: str) -> DecodeEngine:
    """An engine that samples between its steps (teacher_forcing.decode_forced needs the logits)."""
    recorder = spec.recorder if capture == "on" else None
    return DecodeEngine(
        session, config, kv=spec.kv, capture=capture, recorder=recorder, pipeline="off", sample_in_graph=False
    )


def _load_reference(spec: VerifySpec, config: PackageConfig, ref_config: PackageConfig, device: torch.device) -> _Side:
    if spec.reference == "eager":
        proto, model_dir, layout = _graph(config, "the package")
        session = _session(engine_model(proto, layout), model_dir, device, "the package", config.directory)
        return _Side("the same package, eager decode steps", layout, engine=_engine(session, layout, spec, "off"))
    if spec.reference == "fp32":
        proto, model_dir, layout = _graph(config, "the package")
        with _loading("the fp32 reference of", config.directory):
            rewrite = fp32_reference(proto, model_dir)
        spec.progress(f"fp32 reference: {rewrite.summary()}")
        session = _session(rewrite.model, model_dir, device, "the fp32 reference of", config.directory)
        name = f"the same graph in fp32: {rewrite.summary()}"
    else:
        proto, model_dir, layout = _graph(ref_config, "the reference package")
        session = _session(proto, model_dir, device, "the reference package", ref_config.directory)
        name = f"the package {ref_config.directory}, one pass"
    return _Side(name, layout, session=session, engine=_engine(session, layout, spec, "off"))


def _load_test(spec: VerifySpec, config: PackageConfig, device: torch.device) -> _Side:
    proto, model_dir, layout = _graph(config, "the package")
    if spec.capture is None:
        return _Side("one pass", layout, session=_session(proto, model_dir, device, "the package", config.directory))
    session = _session(engine_model(proto, layout), model_dir, device, "the package", config.directory)
    return _Side("decode steps", layout, engine=_engine(session, layout, spec, spec.capture))


# -- running --------------------------------------------------------------------------------


def _reference_rows(spec: VerifySpec, side: _Side, prompt: list[int], first: int) -> tuple[torch.Tensor, list[int]]:
    """The reference's logits for positions first .. end - 2 and the context it recorded."""
    assert side.engine is not None
    if side.session is None:  # the eager reference: its decode steps are the reference
        run = decode_forced(side.engine, prompt, first + 1, extend=spec.tokens)
        return run.logits, run.context
    run = decode_forced(side.engine, prompt, len(prompt), extend=spec.tokens)
    return prefill_logits(side.session, side.config, run.context[:-1])[first:], run.context


def _test_rows(side: _Side, context: list[int], first: int) -> torch.Tensor:
    if side.engine is None:
        assert side.session is not None
        return prefill_logits(side.session, side.config, context[:-1])[first:]
    return decode_forced(side.engine, context, first + 1).logits


def _reference_name(reference: str) -> str:
    return reference if reference in ("fp32", "eager") else str(Path(reference))


def _path_name(capture: str | None, device: torch.device) -> str:
    if capture is None:
        return f"one pass over the context ({device.type})"
    return f"decode steps, capture {capture} ({device.type})"
