"""Prompt prefill: time to first token per prompt length, and where a prefill's time goes.

    python -m bench.prefill --shape qwen2.5-coder-0.5b-instruct --precision fp16 --lengths 16,1024
    python -m bench.prefill --shape qwen2.5-coder-0.5b-instruct --lengths 1024 --profile --top 15
    python -m bench.prefill --device cpu --shape smollm2-135m-instruct --precision fp32 --lengths 16,256

Random weights in a real model's shape (or --package). For each length the engine generates one
token from a seeded prompt of that many tokens, 3 + --repeats times: the median TTFT (prefill +
first token read back) of the last --repeats runs is printed, and the first three apart (with
captured prefill, the CUDA default for static KV: two eager warm-up runs, then the recording).
With --profile, one more prefill per length runs under the torch profiler and cProfile: GPU busy
time against wall time, kernels launched, host synchronisations, the top GPU kernels and the top
host functions; --copies then names the onnxgen lines whose ops issue copies and fills, cuBLAS'
operand copies included (one more eager prefill, each op labelled; use --capture off). A prefill whose wall time is
far above its GPU busy time is bound by the host (the node loop, host reads), not by the kernels.
Each --variant NAME:ENV=VALUE,... runs the lengths again under those settings (bench/step_sweep.py's
form), on a fresh engine over the same package and session:

    python -m bench.prefill --shape qwen2.5-coder-1.5b-instruct --precision int4 --lengths 16,64 \
        --variant auto: --variant split:ONNXGEN_Q4_PROMPT=split --variant dequant:ONNXGEN_Q4_PROMPT=dequant

--mixed N runs N prompts of seeded random lengths between the smallest and largest of --lengths
once each instead (a user's prompts, first sightings of a chunk shape included) and prints their
TTFT medians:

    python -m bench.prefill --shape qwen3.5-0.8b --precision fp16 --lengths 16,300 --mixed 40
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import tempfile
import time
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.random_package import add_package_args, build_random_package, describe, greedy_run, make_engine, open_package
from bench.step_sweep import apply_env, check_variant, parse_variant
from onnxgen.genai.engine import DecodeEngine

SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}


def ttft_ms(engine: DecodeEngine, args: argparse.Namespace, runs: int) -> list[float]:
    """TTFT of ``runs`` generations of one token from the same prompt, in order: with captured
    prefill the first two warm the chunk sizes up eagerly, the third records, the rest replay."""
    return [1000 * greedy_run(engine, args, new_tokens=1).ttft_s for _ in range(runs)]


def mixed_ttfts(engine: DecodeEngine, args: argparse.Namespace, lo: int, hi: int) -> None:
    """--mixed: TTFT of args.mixed prompts of seeded random lengths in [lo, hi], one run each, with
    the medians of the first and the last quarter (recordings are made on a shape's third sighting:
    the first prompts pay for them)."""
    lengths = [random.Random(args.mixed * 7919 + i).randint(lo, hi) for i in range(args.mixed)]
    times = []
    for n in lengths:
        args.prompt_tokens = n
        times.append(ttft_ms(engine, args, 1)[0])
    quarter = max(1, len(times) // 4)
    print(
        f"mixed: {len(times)} prompts of {lo}-{hi} tokens ({len(set(lengths))} lengths), one run each: TTFT median "
        f"{statistics.median(times):.2f} ms (first quarter {statistics.median(times[:quarter]):.2f}, last quarter "
        f"{statistics.median(times[-quarter:]):.2f}, max {max(times):.2f})"
    )


def profile_prefill(engine: DecodeEngine, args: argparse.Namespace, top: int) -> None:
    cuda = engine.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    python = cProfile.Profile()
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        python.enable()
        run = greedy_run(engine, args, new_tokens=1)
        python.disable()
        wall = time.perf_counter() - t0
    gpu_us: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    host_ops: Counter[str] = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += 1
            gpu_us[event.name] += event.device_time
        elif event.name in SYNC_CALLS or event.name in LAUNCH_CALLS:
            calls[event.name] += 1
        elif event.name.startswith("aten::"):
            host_ops[event.name] += 1
    print(f"  profiled prefill: wall {1000 * wall:.1f} ms (TTFT {1000 * run.ttft_s:.1f} ms, under the profilers)")
    if cuda:
        print(f"  GPU busy {sum(gpu_us.values()) / 1000:.2f} ms in {sum(kernels.values())} GPU activities")
    print("  host API calls: " + (", ".join(f"{k} {v}" for k, v in calls.most_common()) or "none recorded"))
    print(f"  aten ops: {sum(host_ops.values())} ({', '.join(f'{k} {v}' for k, v in host_ops.most_common(8))})")
    if cuda:
        print(f"  top {top} GPU activities (count, ms):")
        for name, us in gpu_us.most_common(top):
            print(f"    {kernels[name]:5d}  {us / 1000:8.3f}  {name[:100]}")
    if args.copies:
        print_copy_sites(engine, args, top)
        return
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(top)
    print(f"  top {top} host functions by own time (cProfile):")
    for line in text.getvalue().splitlines():
        if line.strip() and (line.lstrip()[0].isdigit() or "ncalls" in line):
            print("    " + line.rstrip())


COPY_OPS = {"copy_", "fill_", "zero_", "clone", "_to_copy"}
COPY_KERNELS = ("direct_copy", "copy_kernel", "FillFunctor")


class _SiteLabels(TorchDispatchMode):
    """Runs each op that reaches the dispatcher inside a profiler range named after the innermost
    onnxgen line that issued it, so that every kernel the op launches, those its C++ launches
    behind the dispatcher's back included (cuBLAS' operand copies), can be traced to that line."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with torch.profiler.record_function(f"site {func.__name__.split('.')[0]} at {_onnxgen_line()}"):
            return func(*args, **(kwargs or {}))


def _onnxgen_line() -> str:
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/onnxgen/" in path:
            return f"{path[path.rindex('/onnxgen/') + 1 :]}:{frame.lineno} ({frame.name})"
    return "no onnxgen frame"


def print_copy_sites(engine: DecodeEngine, args: argparse.Namespace, top: int) -> None:
    """The onnxgen lines whose ops issue a prefill's copies and fills, by count: on the GPU each is
    a kernel of its own. One more eager prefill, each op labelled with its line (run with --capture
    off: a replayed graph issues no ops to label, though it replays the kernels its eager run made).
    On the CPU, the copies and fills the ops themselves dispatch; on the GPU, the copy and fill
    kernels launched under each label."""
    cuda = engine.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof, _SiteLabels():
        greedy_run(engine, args, new_tokens=1)
    sites: Counter[str] = Counter()
    for event in prof.events():
        if not event.name.startswith("site "):
            continue
        if cuda:
            for kernel in _kernels_under(event):
                if any(k in kernel for k in COPY_KERNELS):
                    sites[f"{event.name[5:]} -> {kernel[:60]}"] += 1
        elif event.name.split()[1] in COPY_OPS:
            sites[event.name[5:]] += 1
    print(f"  top {top} copy and fill sites (count, op at the innermost onnxgen line), {sites.total()} in all:")
    for site, count in sites.most_common(top):
        print(f"    {count:5d}  {site}")


def _kernels_under(event) -> list[str]:
    """The GPU kernels launched by ``event`` and the host events nested in it, not by nested site labels."""
    names = [k.name for k in event.kernels]
    for child in event.cpu_children:
        if not child.name.startswith("site "):
            names += _kernels_under(child)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_package_args(parser)
    parser.add_argument("--lengths", default="16,1024", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="runs after the first three (warm-up, record)")
    parser.add_argument("--capture", default=None, choices=["on", "off", "verify"], help="default: on for CUDA")
    parser.add_argument("--profile", action="store_true", help="profile one more prefill per length")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument(
        "--copies",
        action="store_true",
        help="with --profile: the onnxgen lines issuing copies and fills (use "
        "--capture off: a replayed graph's copies issue no ops to attribute)",
    )
    parser.add_argument(
        "--mixed",
        type=int,
        default=0,
        help="instead of repeating each length: this many prompts of seeded random lengths between the "
        "smallest and largest of --lengths, each run once (what a user sees, first sightings included)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:ENV=VALUE,... (bench/step_sweep.py's form): the lengths again under these settings, a fresh "
        "engine over the same package (e.g. 'split:ONNXGEN_Q4_PROMPT=split')",
    )
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) + 1 > args.context:
        parser.error(f"--context {args.context} is too small for a {max(lengths)}-token prompt")
    capture = args.capture or ("on" if args.device == "cuda" else "off")
    variants = [parse_variant(v) for v in args.variant]
    for _, env in variants:
        check_variant(env)  # a bad setting stops here, before the package is built
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        build_random_package(args, tmp)
        session, config = open_package(args)
        print(f"prefill: {describe(args)}, capture {capture}, device {args.device}")
        for name, env in variants or [("", {})]:
            if name or env:
                apply_env(env)
                print(f"variant {name}: {', '.join(f'{k}={v}' for k, v in env.items()) or 'the process settings'}")
            engine = make_engine(session, config, args, capture=capture)  # fresh recordings per variant
            if args.mixed:
                mixed_ttfts(engine, args, min(lengths), max(lengths))
            else:
                for n in lengths:
                    args.prompt_tokens = n
                    times = ttft_ms(engine, args, 3 + args.repeats)
                    first, steady = times[:3], times[3:]
                    print(
                        f"prompt {n:5d} tokens: TTFT median {statistics.median(steady):8.2f} ms "
                        f"(min {min(steady):.2f}, max {max(steady):.2f}, {len(steady)} runs; "
                        f"the first three runs {', '.join(f'{t:.1f}' for t in first)} ms)"
                    )
                    if args.profile:
                        profile_prefill(engine, args, args.top)
            if capture != "off":
                print(f"prefill chunks: {engine.prefill_capture_stats.summary()}")
            del engine


if __name__ == "__main__":
    main()
