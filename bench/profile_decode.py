"""Where a decode step's time goes: kernels per token and the top GPU kernels and host ops, from the
torch profiler, for eager decode and (with --capture) for captured decode of the same package. On
the CPU (--device cpu) the host ops alone, eager only.

    python -m bench.profile_decode --shape smollm2-135m-instruct --precision fp16 --kv static --capture
    python -m bench.profile_decode --shape qwen2.5-coder-0.5b-instruct --precision int4 --python-profile

Random weights in a real model's shape. --python-profile adds a cProfile of the eager steps
(host time by Python function), which tells dispatch overhead from kernel time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from collections import Counter

import torch

from bench.random_package import add_package_args, build_random_package, describe, greedy_run, make_engine, open_package
from onnxgen.genai.engine import DecodeEngine

LAUNCH_CALLS = {
    "cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
    "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
}  # fmt: skip


def profile_steps(engine: DecodeEngine, args: argparse.Namespace, steps: int, label: str, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    greedy_run(engine, args, new_tokens=steps)  # warm (and for capture: record)
    if cuda:
        torch.cuda.synchronize()
    prof = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])])
    # decode steps only: the profiler starts once the prefill's token is back
    ttft, decode_s, _ = greedy_run(engine, args, new_tokens=steps + 1, after_prefill=prof.start)
    if cuda:
        torch.cuda.synchronize()
    prof.stop()
    kernels: Counter[str] = Counter()
    gpu_us: Counter[str] = Counter()
    launches = Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += 1
            gpu_us[e.name] += e.device_time
        elif e.name in LAUNCH_CALLS:
            launches[e.name] += 1
    total = sum(kernels.values())
    per_token = 1000 * decode_s / steps
    print(f"\n== {label}: {steps} decode steps profiled (prefill excluded), {per_token:.3f} ms/token")
    print(f"TTFT {1000 * ttft:.1f} ms")
    if cuda:
        print(f"GPU activities per decode step: {total / steps:.1f}  (kernels + memcpy + memset)")
        print("host API calls per decode step: " + ", ".join(f"{k} {v / steps:.1f}" for k, v in launches.most_common()))
        print(f"GPU busy per decode step: {sum(gpu_us.values()) / steps / 1000:.3f} ms")
        print(f"top {top} GPU activities by time (count per step, total ms):")
        for name, us in gpu_us.most_common(top):
            print(f"  {kernels[name] / steps:7.1f}  {us / 1000:8.2f} ms  {name[:110]}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    print(f"top {top} host ops by self CPU time:\n{table}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_package_args(parser)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--capture", action="store_true", help="also profile captured decode")
    parser.add_argument("--python-profile", action="store_true")
    args = parser.parse_args()
    if args.capture and args.device != "cuda":
        parser.error("--capture profiles CUDA graphs: it needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    with tempfile.TemporaryDirectory() as tmp:
        build_s = build_random_package(args, tmp)
        session, config = open_package(args)
        print(f"{describe(args)}: built in {build_s:.1f} s")
        eager = make_engine(session, config, args)
        profile_steps(eager, args, args.steps, "eager", args.top)
        if args.python_profile:
            greedy_run(eager, args, new_tokens=4)
            profiler = cProfile.Profile()
            t0 = time.perf_counter()
            profiler.enable()
            greedy_run(eager, args, new_tokens=args.steps + 1)
            profiler.disable()
            print(f"\n== cProfile of eager decode ({time.perf_counter() - t0:.3f} s for prefill + {args.steps} steps)")
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
            print(out.getvalue())
        if args.capture:
            captured = make_engine(session, config, args, capture="on")
            profile_steps(captured, args, args.steps, "captured", args.top)
            print(captured.capture_stats.summary())


if __name__ == "__main__":
    main()
