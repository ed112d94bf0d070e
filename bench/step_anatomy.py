"""Where a captured decode step's time goes, on the GPU and on the host (random weights, GPU only).

    python -m bench.step_anatomy --shape qwen2.5-coder-0.5b-instruct --precision fp16 --context 512 \\
        --variant "default:" --variant "nopdl:ONNXGEN_PDL=0"

Per variant (environment as in step_sweep.py; one package, one process), after the greedy loop of
capture_decode.py has warmed up and recorded:

- ``loop``: the pipelined greedy loop's decode tok/s (median of --repeats), what every bench quotes;
- ``host``: host time to enqueue one whole step of the decode engine (feeds, CaptureRuntime.run, the
  sampler unless the argmax runs in the graph: ``--tail outside``, or ``ONNXGEN_SAMPLE_IN_GRAPH=0`` in a
  variant, keeps it out), measured while
  a sleeping kernel holds the GPU so that nothing waits for the device;
- ``gpu step``: GPU time of those same enqueued steps back to back (CUDA events after the sleep):
  the step with its eager work outside the graphs (mask/position updates and argmax, where they do not
  run in the graph's step tail);
- ``gpu graphs``: GPU time of the recorded graphs alone, replayed back to back the same way;
- ``host replay``: host time of the graph launches alone.
If ``loop`` is close to ``host``, the host bounds the loop; if it is close to ``gpu step``, the GPU.

``--kernels`` adds a kernel timeline of the graphs (torch profiler, chrome trace): for each kernel
of one step, in order, its mean duration and the mean time from the previous kernel's end to its
end (its marginal cost in the chain; under PDL the durations overlap, the end-to-end times do not),
then the same summed by kernel kind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from bench.random_package import (
    add_package_args,
    build_random_package,
    describe,
    engine_switches,
    greedy_run,
    make_engine,
    open_package,
)
from bench.step_sweep import apply_env, parse_variant
from onnxgen.genai.benchmark import prompt_ids
from onnxgen.genai.engine import DecodeEngine
from onnxgen.genai.kv_cache import StaticKV
from onnxgen.genai.sampling import SamplingParams
from onnxgen.genai.sequence import Sequence
from onnxgen.runtime.capture.runtime import CaptureRuntime

SLEEP_CYCLES = 1_500_000_000  # ~0.8 s at the H200's clock: far longer than the enqueues it hides


def recordings(runtime: CaptureRuntime) -> list:
    found = []
    for captured in runtime.keys.values():
        recs = getattr(captured, "recordings", {}) or {}
        found.extend(recs[i] for i in sorted(recs))
    return found


def behind_a_sleeping_gpu(work: Callable[[], None], steps: int) -> tuple[float, float]:
    """(host ms, GPU ms) per step of ``steps`` calls of ``work``, enqueued while a sleeping kernel
    holds the GPU: the host time is the enqueue alone, the GPU time (events after the sleep) that of
    the enqueued work back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        work()
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return 1000 * host / steps, start.elapsed_time(end) / steps


def timed_sequence(engine: DecodeEngine, args: argparse.Namespace) -> Sequence:
    """A greedy sequence of the bench's prompt, prefilled: the timed steps below step it on."""
    ids = prompt_ids(engine.config.vocab_size, args.prompt_tokens)
    sequence = engine.new_sequence(ids, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))
    engine.prefill([sequence])
    return sequence


def rewind(engine: DecodeEngine, sequence: Sequence) -> StaticKV:
    """The sequence's cache after a prompt's worth of (zero) rows, its feeds set for the next step: the
    timed steps and replays start there (a step tail moves the position on in every replay, so the
    graphs alone must not run past the rotary tables either)."""
    kv, feeds = sequence.kv, engine.decode_feeds
    assert isinstance(kv, StaticKV) and feeds is not None, "a captured static-KV engine, prefilled"
    ids, pos = feeds  # the engine's persistent feeds (the recording uses them in place)
    kv.reset()
    kv.length = len(sequence.prompt_ids)
    kv.mask[:, : kv.length + 1] = 1
    ids.zero_()
    pos.fill_(kv.length)
    sequence.token, sequence.token_at = ids.view(()), None
    sequence.prepared_at = kv.length if sequence.tail is not None else None  # the position and mask row are set
    return kv


def enqueue_steps(engine: DecodeEngine, sequence: Sequence, steps: int) -> tuple[float, float]:
    """(host ms per enqueued step, GPU ms per step) for ``steps`` single-token steps past the prompt:
    the engine's own step (feeds, CaptureRuntime.run, the sampler unless the tail runs in the graph)."""
    rewind(engine, sequence)
    return behind_a_sleeping_gpu(lambda: engine.step([sequence]), steps)


def replay_graphs(recs: list, steps: int) -> tuple[float, float]:
    """(host ms per step of graph launches, GPU ms per step) replaying the recorded graphs alone."""

    def replay() -> None:
        for rec in recs:
            rec.replay()

    return behind_a_sleeping_gpu(replay, steps)


def kernel_timeline(recs: list, steps: int, trace_path: str) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        for rec in recs:
            rec.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            for rec in recs:
                rec.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    kernels.sort(key=lambda e: float(e["ts"]))
    return kernels


def short_name(event: dict) -> str:
    name = event.get("name", "?")
    for cut in ("(", "<"):
        name = name.split(cut)[0]
    grid = event.get("args", {}).get("grid")
    return f"{name[:48]} grid={grid}" if grid else name[:60]


def print_timeline(kernels: list[dict], steps: int) -> None:
    if not kernels or len(kernels) % steps:
        print(f"kernel timeline: {len(kernels)} GPU activities for {steps} steps (not a whole number per step)")
        if not kernels:
            return
    per_step = len(kernels) // steps
    durations: dict[int, list[float]] = defaultdict(list)
    marginal: dict[int, list[float]] = defaultdict(list)
    names: dict[int, str] = {}
    for s in range(1, steps):  # the first step has no previous end
        for i in range(per_step):
            e = kernels[s * per_step + i]
            prev = kernels[s * per_step + i - 1]
            durations[i].append(float(e["dur"]))
            marginal[i].append(float(e["ts"]) + float(e["dur"]) - float(prev["ts"]) - float(prev["dur"]))
            names[i] = short_name(e)
    total = sum(statistics.mean(marginal[i]) for i in range(per_step))
    print(f"kernel timeline: {per_step} GPU activities per step, end-to-end sum {total:.1f} us per step")
    print("  #   duration  end-to-end  kernel")
    for i in range(per_step):
        print(f"  {i:3d} {statistics.mean(durations[i]):8.2f} {statistics.mean(marginal[i]):10.2f}  {names[i]}")
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for i in range(per_step):
        k = kinds[names[i]]
        k[0] += 1
        k[1] += statistics.mean(durations[i])
        k[2] += statistics.mean(marginal[i])
    print("  by kind: count, summed duration us, summed end-to-end us")
    for name, (count, dur, marg) in sorted(kinds.items(), key=lambda kv: -kv[1][2]):
        print(f"  {count:4d} {dur:9.1f} {marg:9.1f}  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_package_args(parser)
    parser.add_argument("--variant", action="append", default=None, help="NAME:ENV=VALUE,ENV=VALUE")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-s", type=float, default=2.0, help="warm-up runs per variant for at least this long")
    parser.add_argument("--steps", type=int, default=100, help="steps per host/GPU measurement")
    parser.add_argument("--kernels", action="store_true", help="also print the graphs' kernel timeline")
    parser.add_argument("--profile-steps", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("step_anatomy.py needs a CUDA GPU", file=sys.stderr)
        return 2
    variants = [parse_variant(v) for v in (args.variant or ["default:"])]
    with tempfile.TemporaryDirectory() as tmp:
        build_s = build_random_package(args, os.path.join(tmp, "pkg"))
        print(f"{describe(args)}: built in {build_s:.1f} s", flush=True)
        session, config = open_package(args)
        n = args.new_tokens - 1
        for name, env in variants:
            apply_env(env)
            # ONNXGEN_SAMPLE_IN_GRAPH / ONNXGEN_HOST_TOKENS in a variant are the engine's arguments
            engine = make_engine(session, config, args, capture="on", **engine_switches(args, env))
            runtime = engine.capture_runtime()
            start = time.perf_counter()
            greedy_run(engine, args)
            while time.perf_counter() - start < args.warmup_s:  # clocks and caches settle, for every variant
                greedy_run(engine, args)
            runs = [greedy_run(engine, args) for _ in range(args.repeats)]
            loop_ms = 1000 * statistics.median(r.decode_s for r in runs) / n
            sequence = timed_sequence(engine, args)
            with torch.inference_mode():
                host_ms, gpu_step_ms = enqueue_steps(engine, sequence, args.steps)
                recs = recordings(runtime)
                rewind(engine, sequence)
                replay_host_ms, gpu_graph_ms = replay_graphs(recs, args.steps)
            print(
                f"{name}: loop {loop_ms:.3f} ms/token ({1000 / loop_ms:.1f} tok/s) | host {host_ms:.3f} ms/step | "
                f"gpu step {gpu_step_ms:.3f} ms | gpu graphs {gpu_graph_ms:.3f} ms ({len(recs)} graph(s)) | "
                f"host replay {replay_host_ms:.3f} ms | invalidations {runtime.stats.invalidations}  {env}",
                flush=True,
            )
            if args.kernels:
                with torch.inference_mode():
                    rewind(engine, sequence)
                    kernels = kernel_timeline(recs, args.profile_steps, os.path.join(tmp, f"{name}.json"))
                print_timeline(kernels, args.profile_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
