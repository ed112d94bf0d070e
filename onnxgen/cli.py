"""The `onnxgen` command: generate, run (chat), serve (HTTP), bench, show, pull, list, build.

Generated text goes to stdout; progress, stats and errors go to stderr. User errors print one
line (no traceback) and exit with status 2.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

from onnxgen.errors import OnnxgenError

DEFAULT_MODEL = "smollm2-135m-instruct"


def _eprint(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


# -- model resolution -------------------------------------------------------------------------


def _add_build_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--precision",
        choices=["fp32", "fp16", "int4"],
        default=None,
        help="weights precision (default: int4 on cpu, fp16 on cuda)",
    )
    p.add_argument(
        "--attention",
        choices=["gqa", "standard"],
        default="gqa",
        help="gqa: onnxruntime-genai contrib-op layout; standard: default-domain ops, dynamic KV",
    )


def _package_of_path(name: str) -> Path | None:
    """The package directory a --model path means, or None for a registry name. A .onnx file counts
    as its package only where that directory's genai_config.json names it: a bare graph has no
    tokenizer or config to generate with."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "genai_config.json").is_file():
            raise OnnxgenError(f"{path} is not a model package (no genai_config.json)")
        return path
    if path.is_file():
        if path.suffix.lower() == ".onnx":
            from onnxgen.genai.package import load_package_config

            package = path.parent
            if (package / "genai_config.json").is_file():
                if load_package_config(package).model_file.resolve() == path.resolve():
                    return package
            raise OnnxgenError(
                f"{path} is an ONNX file, not a package: generating needs a package directory (the graph with "
                f"a genai_config.json that names it and tokenizer files); `onnxgen show {path}` prints the graph"
            )
        raise OnnxgenError(f"{path} is a file, not a package directory (expected genai_config.json, model.onnx, ...)")
    from onnxgen.models.registry import known_names, looks_like_path

    if looks_like_path(name):
        raise OnnxgenError(
            f"no such file or directory: {name} (expected a package directory or a registry name: "
            f"{', '.join(known_names())})"
        )
    return None


def resolve_model(model: str | None, device: str, precision: str | None, attention: str) -> Path:
    """A package directory for --model: an existing directory (or the .onnx file a package names),
    or a registry name (pulled on first use)."""
    name = model or DEFAULT_MODEL
    package = _package_of_path(name)
    if package is not None:
        return package
    from onnxgen.models.pull import ensure_package

    return ensure_package(name, precision=precision, device=device, attention=attention)


def _sampling_from_args(args: argparse.Namespace):
    from onnxgen.genai.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=list(args.stop or []),
    ).validate()


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help=f"registry name or package directory (default {DEFAULT_MODEL})")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--kv", choices=["auto", "static", "dynamic"], default="auto", help="KV cache strategy")
    p.add_argument(
        "--capture",
        choices=["on", "off", "verify"],
        default=None,
        help="CUDA graphs for the decode step (default: on with --device cuda, off on the CPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: half the cores, all of them for a batching `serve`; or "
        "OMP_NUM_THREADS if set)",
    )
    p.add_argument(
        "--omp-wait-policy",
        choices=["active", "passive"],
        default=None,
        help="OpenMP waiting threads spin (active) or sleep (passive); default: libgomp's",
    )
    _add_build_options(p)


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", "-n", type=int, default=None, help="default: what remains of the context")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="in [0, 2**64); default: a fresh one per generation")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def _cuda_missing() -> str | None:
    """Why --device cuda cannot run here (torch sees no CUDA device), or None when it can."""
    import torch

    if torch.cuda.is_available():
        return None
    return (
        f"--device cuda: torch sees no CUDA device (torch {torch.__version__}, built for CUDA "
        f"{torch.version.cuda or 'none'}); use --device cpu, or run on a machine with an NVIDIA GPU"
    )


def _load_generator(args: argparse.Namespace):
    from onnxgen.genai.generator import Generator

    if args.device == "cuda" and (problem := _cuda_missing()):
        raise OnnxgenError(problem)  # before any pull or build of a CUDA package
    package = resolve_model(args.model, args.device, args.precision, args.attention)
    return Generator(package, device=args.device, kv=args.kv, capture=args.capture, threads=args.thread_options)


def _thread_options(args: argparse.Namespace):
    """The --threads/--omp-wait-policy options; the wait policy is put in the environment here, before
    anything imports torch (libgomp reads it once, at load: onnxgen/threads.py)."""
    from onnxgen.threads import ThreadOptions

    options = ThreadOptions(num_threads=args.threads, wait_policy=args.omp_wait_policy)
    options.prepare()
    return options


# -- commands -----------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_from_args(args)
    generator = _load_generator(args)
    for piece in generator.stream(args.prompt, params, chat=args.chat):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    _eprint(generator.last_stats.summary())
    if args.stats:
        _eprint(generator.capture_stats.summary())
    return 0


CHAT_HELP = """commands:
  /help           this list
  /reset          forget the conversation (the system prompt stays)
  /system [TEXT]  set (or clear) the system prompt; forgets the conversation
  /stats          the last reply's statistics
  /exit, /quit    leave (also Ctrl-D, or Ctrl-C twice at the prompt)
  //TEXT          send TEXT starting with one '/'
Ctrl-C during a reply stops it. When the conversation outgrows the context, the oldest exchanges
are dropped until the prompt plus {reserve} tokens for the reply fit; a message too long even
alone is not sent, and the conversation is kept."""


def _read_line() -> str:
    """One line of input without its newline; the prompt goes to stderr unless stdin is a terminal
    (input() with line editing there). EOFError at the end of the input."""
    if sys.stdin.isatty():
        return input("> ")
    sys.stderr.write("> ")
    sys.stderr.flush()
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def _not_utf8(text: str) -> str | None:
    """What is wrong with a line read with surrogateescape, or None when it is UTF-8 text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"byte 0x{ord(text[exc.start]) - 0xDC00:02x} at character {exc.start}"
    return None


def cmd_run(args: argparse.Namespace) -> int:
    from onnxgen.genai.chat_session import ChatSession, reply_reserve

    params = _sampling_from_args(args)
    generator = _load_generator(args)
    context = generator.config.context_length

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return generator.tokenizer.encode(generator.apply_chat_template(messages))

    # a chat needs the package's template: without one (or if it cannot render a first message) say
    # so now, before the user types anything, rather than refusing every message
    generator.apply_chat_template([{"role": "user", "content": "Hello"}])
    session = ChatSession(encode, context, reply_reserve(context, params.max_new_tokens), system=args.system)
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")  # bytes that are not UTF-8 are refused, not fatal
    _eprint("onnxgen chat: type a message; /help lists the commands")
    armed = False  # Ctrl-C once at the prompt: the next one leaves
    while True:
        try:
            line = _read_line()
        except EOFError:
            _eprint("\n(end of input; bye)")
            return 0
        except KeyboardInterrupt:
            if armed:
                _eprint("\n(bye)")
                return 0
            armed = True
            _eprint("\n(Ctrl-C again to leave, or /exit)")
            continue
        armed = False
        text = line.strip()
        if not text:
            continue
        bad = _not_utf8(text)
        if bad:
            _eprint(f"(that line is not valid UTF-8 text: {bad}; not sent)")
            continue
        if text.startswith("/") and not text.startswith("//"):
            command, _, rest = text.partition(" ")
            if command in ("/exit", "/quit"):
                _eprint("(bye)")
                return 0
            if command == "/help":
                _eprint(CHAT_HELP.format(reserve=session.reserve))
            elif command == "/reset":
                session.reset(session.system)
                _eprint("(history cleared)")
            elif command == "/system":
                session.reset(rest.strip() or None)
                _eprint(f"(system prompt {'set' if session.system else 'cleared'}; history cleared)")
            elif command == "/stats":
                _eprint(generator.last_stats.summary())
            else:
                _eprint(f"(unknown command {command}; /help lists the commands; //TEXT sends TEXT with one '/')")
            continue
        if text.startswith("//"):
            text = text[1:]
        _chat_turn(generator, session, params, text)


def _chat_turn(generator, session, params, text: str) -> None:
    """One message and its reply; whatever fails, the conversation goes on (and stays as it was)."""
    try:
        fit = session.fit(text)
    except OnnxgenError as exc:
        _eprint(f"onnxgen: error: {exc} (message not sent)")
        return
    context = session.context_length
    if fit.refused:
        _eprint(
            f"(message not sent: it is {fit.tokens} tokens with the chat template, and the context holds "
            f"{context} with {session.reserve} kept for the reply; the history is kept)"
        )
        return
    if fit.dropped:
        _eprint(
            f"(dropped the oldest {fit.dropped} exchange{'s' if fit.dropped > 1 else ''} to fit the context: "
            f"prompt {fit.tokens} of {context} tokens, {session.reserve} kept for the reply)"
        )
    reply: list[str] = []
    try:
        for piece in generator.stream(fit.ids, params):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        _eprint("\n(stopped)")
    except OnnxgenError as exc:
        print(flush=True)
        _eprint(f"onnxgen: error: {exc} (the message is not kept)")
        return
    print(flush=True)
    stop = generator.last_stats.stop_reason
    if stop == "length":
        _eprint(f"(reply cut at --max-new-tokens {params.max_new_tokens})")
    elif stop == "context full":
        _eprint("(reply cut: the context is full; the oldest exchanges will be dropped for the next message)")
    session.add(fit, text, "".join(reply))


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from onnxgen.genai.benchmark import check_workload, run_bench

    check_workload(args.prompt_tokens, args.new_tokens, args.repeats, args.seed)  # before loading the model
    generator = _load_generator(args)
    result = run_bench(
        generator, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats,
        seed=args.seed, progress=lambda line: _eprint(f"bench: {line}"),
    )  # fmt: skip
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table())
    return 0


def serve_threads(threads, options):  # noqa: ANN001, ANN201 - ThreadOptions, ServeOptions (imported late)
    """The server's thread options: a batching server on the CPU defaults to all the usable cores
    (onnxgen/threads.py); --threads, OMP_NUM_THREADS or torch.set_num_threads still win."""
    from dataclasses import replace

    if options.device == "cpu" and options.batch_size > 1:
        return replace(threads, default="all")
    return threads


def cmd_serve(args: argparse.Namespace) -> int:
    from onnxgen.genai.engine_process import EngineSpec
    from onnxgen.genai.generator import Generator
    from onnxgen.server.options import ServeOptions, runner_for_package
    from onnxgen.server.serve import Server, bind

    if args.device == "cuda" and (problem := _cuda_missing()):
        raise OnnxgenError(problem)  # before any pull or build of a CUDA package
    name = args.served_model_name
    if name is None:
        name = Path(args.model).name if args.model and _package_of_path(args.model) else args.model or DEFAULT_MODEL
    options = ServeOptions(
        model_name=name, host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
        shutdown_grace_s=args.shutdown_grace, stream_interval_s=args.stream_interval_ms / 1000,
        max_chunk_rate=args.max_chunk_rate, device=args.device,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, prefix_caching=args.enable_prefix_caching,
        max_prefill_tokens=args.max_prefill_tokens, state_snapshots=args.state_snapshots,
        engine_process={"auto": None, "on": True, "off": False}[args.engine_process],
    )  # fmt: skip

    threads = serve_threads(args.thread_options, options)

    def make_generator() -> Generator:  # called on the server's engine thread, once run() starts
        return Generator(package, device=args.device, kv=args.kv, capture=args.capture, threads=threads)

    def engine_spec() -> EngineSpec:  # called when run() starts the engine process
        return EngineSpec(str(package), device=args.device, kv=args.kv, capture=args.capture, threads=threads)

    # the port first: one that is taken fails before any pull; the runner once the package is known
    listening = bind(options.host, options.port)
    package = resolve_model(args.model, args.device, args.precision, args.attention)
    options, note = runner_for_package(options, package)
    if note:
        _eprint(note)
    server = Server(options, make_generator, engine_spec=engine_spec, listening=listening)
    return server.run()


def cmd_show(args: argparse.Namespace) -> int:
    from onnxgen.show import show_model

    print(
        show_model(args.model, capture=args.capture, as_json=args.json, bind=args.bind, device=args.device, kv=args.kv)
    )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from onnxgen.models.pull import ensure_package

    if args.device == "cuda" and (problem := _cuda_missing()):
        raise OnnxgenError(problem)  # the package would be cached for a device this machine lacks
    path = ensure_package(
        args.name, precision=args.precision, device=args.device, attention=args.attention, force=args.force
    )
    print(path)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from onnxgen.models.pull import list_models

    print(list_models())
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from onnxgen.models.pull import build_from_source

    precision = args.precision or ("fp16" if args.device == "cuda" else "int4")
    if args.device == "cuda" and (problem := _cuda_missing()):
        # Building needs no GPU and the package may be meant for another machine: say so, go on.
        _eprint(f"onnxgen: note: {problem.split(';')[0]}; the package is built for CUDA all the same")
    path = build_from_source(
        Path(args.source),
        Path(args.output),
        precision=precision,
        device=args.device,
        attention=args.attention,
        int4_zero_points=args.int4_zero_points,
    )
    print(path)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    import json

    from onnxgen.genai.verify import VerifySpec, read_prompts, run_verify

    if args.device == "cuda" and (problem := _cuda_missing()):
        raise OnnxgenError(problem)
    prompts = read_prompts(args.prompt, args.prompts)
    spec = VerifySpec(
        package=Path(args.package).expanduser(), reference=args.reference, device=args.device, capture=args.capture,
        tokens=args.tokens, chat=args.chat, all_positions=args.all_positions, near_tie=args.near_tie,
        min_agreement=args.min_agreement, max_kl=args.max_kl, allow_real=args.allow_real,
        threads=args.thread_options, progress=lambda line: _eprint(f"verify: {line}"),
        **({"prompts": prompts} if prompts else {}),
    )  # fmt: skip
    report = run_verify(spec)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.table())
    return 0 if report.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxgen", description="Run ONNX generative models on GPUs and CPUs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    _add_model_options(p)
    p.add_argument("--prompt", "-p", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stats", action="store_true", help="print capture statistics (segments, replays, seams)")
    _add_sampling_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("run", help="interactive chat")
    _add_model_options(p)
    p.add_argument("--system", default=None, help="system prompt")
    _add_sampling_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="decode speed of a model: TTFT and tok/s over a fixed greedy workload")
    _add_model_options(p)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", "-n", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (the median is reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt ids")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/server.md)")
    _add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 503 (default 64)")
    p.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="sequences decoded at once, continuous batching (default 8 on the CPU; 1 on CUDA: one request at a "
        "time through the captured step)",
    )  # fmt: skip
    p.add_argument(
        "--max-model-len", type=int, default=None,
        help="tokens (prompt and output) one sequence may hold when batching (default: 16384 / --max-num-seqs, "
        "at most the model's context)",
    )  # fmt: skip
    p.add_argument(
        "--max-prefill-tokens", type=int, default=None,
        help="prompt tokens computed between two decode steps at most when batching (default 512; 2048 where "
        "steps are captured, on CUDA, and prompts that wait together run as one step)",
    )  # fmt: skip
    p.add_argument(
        "--engine-process", choices=("auto", "on", "off"), default="auto",
        help="run the engine in a process of its own, beside the HTTP server's (default auto: on with CUDA, "
        "off on the CPU)",
    )  # fmt: skip
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV of a prompt prefix the batching server still holds (default on)",
    )  # fmt: skip
    p.add_argument(
        "--state-snapshots", type=int, default=None, metavar="N",
        help="hybrid decoders (carried states): snapshots of the states after shared prompt prefixes kept "
        "for later prompts, so that conversations with one system prompt reuse it (default: --max-num-seqs; "
        "0: none)",
    )  # fmt: skip
    p.add_argument(
        "--shutdown-grace", type=float, default=10.0,
        help="seconds requests may run on after SIGINT/SIGTERM before they are cut (default 10)",
    )  # fmt: skip
    p.add_argument(
        "--stream-interval-ms", type=float, default=5.0,
        help="least time between two chunks of a stream; faster streams get several tokens per chunk (default 5)",
    )  # fmt: skip
    p.add_argument(
        "--max-chunk-rate", type=float, default=2000.0,
        help="chunks per second over all streams at most: with many streams each one's interval widens to "
        "streams / rate (default 2000; 0: no cap)",
    )  # fmt: skip
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("show", help="print a package or .onnx file: architecture, I/O, ops, parameters")
    p.add_argument("model", help="package directory, .onnx file or registry name")
    p.add_argument("--capture", action="store_true", help="print the capture plan of the decode step")
    p.add_argument("--json", action="store_true")
    p.add_argument("--bind", default=None, help="NAME=VALUE,... symbol bindings for --capture")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--kv", choices=["auto", "static", "dynamic"], default="auto",
        help="the KV cache of the planned decode step (auto: what a session on --device uses for the package)",
    )  # fmt: skip
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "verify",
        help="check a package against an fp32 (or another) reference by teacher forcing (docs/verify.md); exit 1 "
        "when it fails",
    )
    p.add_argument("package", help="package directory")
    p.add_argument(
        "--reference", default="fp32",
        help="fp32 (default): the same graph in fp32 arithmetic with dequantized weights; eager: the same package's "
        "eager decode steps; or the directory of another package of the same model",
    )  # fmt: skip
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--capture", choices=["on", "off"], default=None,
        help="run the package through the decode engine's one-token steps, captured (on, CUDA only) or eager (off); "
        "default: one pass over each context",
    )  # fmt: skip
    p.add_argument("--prompt", "-p", action="append", help="a prompt (repeatable; default: four built-in prompts)")
    p.add_argument("--prompts", default=None, help="a file of prompts, one per line (blank lines skipped)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--tokens", "-n", type=int, default=64, help="greedy tokens the reference records per prompt")
    p.add_argument("--all-positions", action="store_true", help="score the prompt's positions too")
    p.add_argument(
        "--near-tie", type=float, default=0.5,
        help="a disagreement is a near-tie when the reference prefers its token over the package's by less than "
        "this many logits (default 0.5: odds under e^0.5, 1.65x; fp16 and int4 rounding flips tokens well inside "
        "it, docs/verify.md)",
    )  # fmt: skip
    p.add_argument("--min-agreement", type=float, default=0.9, help="fail below this top-1 agreement (default 0.9)")
    p.add_argument("--max-kl", type=float, default=None, help="fail above this mean KL divergence, in nats")
    p.add_argument(
        "--allow-real", action="store_true",
        help="report real disagreements without failing (a reference with other weights: int4 against an fp32 build)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: half the cores)")
    p.add_argument("--omp-wait-policy", choices=["active", "passive"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("pull", help="fetch a registry model and build its package; prints the package directory")
    p.add_argument("name")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    _add_build_options(p)
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="cached packages and pullable models")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("build", help="build a package from a GGUF file or a Hugging Face directory")
    p.add_argument("source")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    _add_build_options(p)
    p.add_argument(
        "--int4-zero-points",
        choices=["exact", "packed", "none"],
        default="exact",
        help="int4 only. exact: a weight already in 4-bit blocks (a GGUF's Q4_1) keeps them, with float zero "
        "points; packed: 4-bit zero points everywhere, the form onnxruntime's CPU kernel runs fast, each such "
        "block rounded again; none: symmetric blocks, no zero points (onnxruntime-genai's builder's default "
        "form; less accurate than zero points: docs/benchmarks/2026-12-07-h100-symmetric-and-zero-bytes.md) "
        "(default: exact)",
    )
    p.set_defaults(func=cmd_build)
    return parser


class OutputError(OnnxgenError):
    """stdout cannot take the output (a full disk, a closed descriptor)."""


class _GuardedStdout:
    """sys.stdout while a command runs: a write or flush that fails for any reason but a closed pipe
    (a full disk, an I/O error) becomes one OutputError line instead of a traceback. A closed pipe
    stays a BrokenPipeError, which ends the command quietly (_stdout_gone)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def _guard(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(f"cannot write the output to stdout: {exc.strerror or exc}") from None

    def write(self, text: str) -> int:
        return self._guard(self._stream.write, text)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _stdout_gone() -> int:
    """The reader of stdout went away (`onnxgen ... | head`): leave quietly, as Unix tools do. Later
    writes (the interpreter's final flush included) go to /dev/null; the status is SIGPIPE's."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if sys.stdout is None:  # started with stdout closed (`onnxgen ... >&-`)
        _eprint("onnxgen: error: stdout is closed; onnxgen writes its output there (redirect it to a file)")
        return 2
    stdout = sys.stdout
    sys.stdout = _GuardedStdout(stdout)
    try:
        if hasattr(args, "threads"):  # first: before any command imports torch
            args.thread_options = _thread_options(args)
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then one more case below
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except OutputError as exc:
        _eprint(f"onnxgen: error: {exc}")
        _stdout_gone()  # what is still buffered would fail again at exit
        return 2
    except OnnxgenError as exc:
        _eprint(f"onnxgen: error: {exc}")
        return 2
    except KeyboardInterrupt:
        _eprint("onnxgen: interrupted")
        return 130
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
