"""The `onnxgen` command: generate, run (chat), bench, show, pull, list, build.

Generated text goes to stdout; progress, stats and errors go to stderr. User errors print one
line (no traceback) and exit with status 2.
"""

from __future__ import annotations

import argparse
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


def resolve_model(model: str | None, device: str, precision: str | None, attention: str) -> Path:
    """A package directory for --model: an existing directory, or a registry name (pulled on first use)."""
    name = model or DEFAULT_MODEL
    path = Path(name)
    if path.is_dir():
        if not (path / "genai_config.json").is_file():
            raise OnnxgenError(f"{path} is not a model package (no genai_config.json)")
        return path
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
        help="CPU threads for torch (default: half the cores, or OMP_NUM_THREADS if set)",
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
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def _load_generator(args: argparse.Namespace):
    from onnxgen.genai.generator import Generator

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


def cmd_run(args: argparse.Namespace) -> int:
    params = _sampling_from_args(args)
    generator = _load_generator(args)
    history: list[dict[str, str]] = []
    system: str | None = args.system
    _eprint(
        "onnxgen chat: /reset clears history, /system TEXT sets the system prompt, /stats, /exit; Ctrl-C stops a reply"
    )
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            _eprint("(history cleared)")
            continue
        if text.startswith("/system"):
            system = text[len("/system") :].strip() or None
            history.clear()
            _eprint(f"(system prompt {'set' if system else 'cleared'}; history cleared)")
            continue
        if text == "/stats":
            _eprint(generator.last_stats.summary())
            continue
        history.append({"role": "user", "content": text})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        prompt_ids = generator.encode(generator.apply_chat_template(messages))
        reply = []
        try:
            for piece in generator.stream(prompt_ids, params):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            _eprint("\n(stopped)")
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from onnxgen.genai.benchmark import run_bench

    generator = _load_generator(args)
    result = run_bench(
        generator, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats,
        seed=args.seed, progress=lambda line: _eprint(f"bench: {line}"),
    )  # fmt: skip
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from onnxgen.show import show_model

    print(show_model(args.model, capture=args.capture, as_json=args.json, bind=args.bind, device=args.device))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from onnxgen.models.pull import ensure_package

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
    path = build_from_source(
        Path(args.source), Path(args.output), precision=precision, device=args.device, attention=args.attention
    )
    print(path)
    return 0


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

    p = sub.add_parser("show", help="print a package or .onnx file: architecture, I/O, ops, parameters")
    p.add_argument("model", help="package directory, .onnx file or registry name")
    p.add_argument("--capture", action="store_true", help="print the capture plan of the decode step")
    p.add_argument("--json", action="store_true")
    p.add_argument("--bind", default=None, help="NAME=VALUE,... symbol bindings for --capture")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.set_defaults(func=cmd_show)

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
    p.set_defaults(func=cmd_build)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "threads"):  # first: before any command imports torch
            args.thread_options = _thread_options(args)
        return args.func(args)
    except OnnxgenError as exc:
        _eprint(f"onnxgen: error: {exc}")
        return 2
    except KeyboardInterrupt:
        _eprint("onnxgen: interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
