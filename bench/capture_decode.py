"""Decode speed with CUDA-graph capture on vs off, in the same run (random weights, real model shape).

    python bench/capture_decode.py --shape qwen2.5-coder-0.5b-instruct --precision fp16 --attention gqa --kv static
    python bench/capture_decode.py --shape smollm2-135m-instruct --attention standard --kv dynamic --capture verify

For each mode it decodes --new-tokens greedy tokens after a short prompt (median of --repeats runs,
after a warm-up run) and prints tok/s, ms/token, the ratio, and the capture statistics (segments per
step, replays, seams and their reasons). Both modes must produce the same tokens: the script fails
loudly if they do not. --capture verify additionally checks each of the first steps bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from onnxgen.genai.kv_cache import DynamicKV, StaticKV
from onnxgen.genai.package import load_package_config
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import MODEL_SHAPES, RandomSource
from onnxgen.runtime import InferenceSession
from onnxgen.runtime.capture.runtime import CaptureRuntime
from onnxgen.runtime.dtypes import ONNX_TO_TORCH

_STATIC: dict[str, StaticKV] = {}


def new_kv(config, args, dtype: torch.dtype, dev: torch.device) -> StaticKV | DynamicKV:
    if args.kv == "dynamic":
        return DynamicKV(config, dtype, dev)
    # one static cache for every run, reset in place: its buffers keep their addresses, so the
    # recorded graph stays valid across runs (a fresh cache would cost an invalidation + re-record)
    kv = _STATIC.get("kv")
    if kv is None:
        kv = _STATIC["kv"] = StaticKV(config, dtype, dev, args.context)
    kv.length = 0
    kv.mask.zero_()
    return kv


def decode(session, config, args, runtime: CaptureRuntime | None) -> tuple[float, list[int]]:
    dev = session.device
    inputs = {i.name for i in session.program.inputs}
    dtype = ONNX_TO_TORCH[next(i for i in session.program.inputs if i.name == config.past_key_name(0)).elem_type]
    kv = new_kv(config, args, dtype, dev)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), generator=gen).to(dev)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        feeds = {"input_ids": tokens, "attention_mask": kv.attention_mask(n), **kv.feeds()}
        if "position_ids" in inputs:
            feeds["position_ids"] = torch.arange(kv.length, kv.length + n, device=dev).reshape(1, n)
        out = runtime.run(feeds) if (runtime is not None and n == 1) else session.run_torch(feeds)
        kv.update(out, n)
        return out["logits"][0, -1].argmax().reshape(1, 1)

    tokens: list[int] = []
    with torch.inference_mode():
        token = step(ids)
        tokens.append(int(token))
        start = time.perf_counter()
        for _ in range(args.new_tokens):
            token = step(token)
            tokens.append(int(token))  # the one device-to-host read per token, as the Generator does
        return time.perf_counter() - start, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m-instruct", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "int4"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", default="gqa", choices=["gqa", "standard"])
    parser.add_argument("--kv", default="static", choices=["static", "dynamic"])
    parser.add_argument("--capture", default="on", choices=["on", "verify"])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replay-recorder", action="store_true", help="CPU stand-in for CUDA graphs (smoke test)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        build_package(
            RandomSource(MODEL_SHAPES[args.shape]),
            tmp,
            precision=args.precision,
            device=args.device,
            attention=args.attention,
            context_length=args.context,
        )
        print(f"built {args.shape} {args.precision} {args.attention} in {time.perf_counter() - t0:.1f} s", flush=True)
        config = load_package_config(tmp)
        session = InferenceSession(config.model_file, device=args.device)
        recorder = None
        if args.replay_recorder:
            from onnxgen.runtime.capture.recorder import ReplayRecorder

            recorder = ReplayRecorder()
        pin: set[str] = set()
        if args.kv == "static":
            shapes = {i.name: i.shape or [] for i in session.program.inputs}
            dims = shapes[config.past_key_name(0)][2:3] + shapes["attention_mask"][1:2]
            pin = {d for d in dims if isinstance(d, str)}
        t0 = time.perf_counter()
        runtime = CaptureRuntime(session.program, session.model, mode=args.capture, recorder=recorder, pin=pin)
        plan_s = time.perf_counter() - t0
        results: dict[str, tuple[float, list[int]]] = {}
        for mode, rt in (("off", None), (args.capture, runtime)):
            decode(session, config, args, rt)  # warm-up (for capture: warm-up steps + recording)
            runs = [decode(session, config, args, rt) for _ in range(args.repeats)]
            seconds = statistics.median(r[0] for r in runs)
            results[mode] = (seconds, runs[0][1])
            print(
                f"capture {mode:6s}: {args.new_tokens / seconds:8.1f} tok/s  "
                f"({1000 * seconds / args.new_tokens:.2f} ms/token, median of {args.repeats})",
                flush=True,
            )
        (off_s, off_tokens), (on_s, on_tokens) = results["off"], results[args.capture]
        print(f"ratio on/off: {off_s / on_s:.2f}x   (runtime construction {plan_s:.1f} s)")
        print(runtime.stats.summary())
        if on_tokens != off_tokens:
            first = next(i for i, (a, b) in enumerate(zip(on_tokens, off_tokens)) if a != b)
            print(f"FAIL: greedy tokens differ at position {first}", file=sys.stderr)
            return 1
        print(f"greedy tokens identical ({len(on_tokens)} tokens)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
