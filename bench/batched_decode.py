"""Batched decode throughput of the engine's batched mode (genai/batched.py), in the manner of
llama.cpp's ``llama-batched-bench``: B sequences of --prompt-tokens prompt ids each, admitted
together, --new-tokens greedy tokens each (EOS ignored); per B, the time until every sequence has
its first token (the prompts, at most --prefill-budget tokens per iteration between the steps of
those already running), the decode throughput after it, and the end-to-end throughput (every token
made over the whole time, prompts included: what a server at that concurrency can sustain).

    python -m bench.batched_decode --device cpu --shape smollm2-135m-instruct --precision int4 --batch 1,4,8
    python -m bench.batched_decode --package PKG --device cpu --batch 1,8 --prompt-tokens 128 --new-tokens 128

Random weights in a real model's shape (or --package). Decode tok/s = the tokens made after the
last sequence's first token, over the time from then to the end (llama-batched-bench's S_TG is its
generated tokens over its generation phase). On CUDA the batched steps are captured per batch
bucket and the prompts that wait together run as captured groups (genai/prompt_groups.py); each B runs twice
with its own decoder, the first run warming and recording, the second measured (--capture off:
everything eager). The serial engine loop's tok/s on the same package and prompt (B = 1 through
DecodeEngine.generate: on CUDA the captured, pipelined single-sequence loop) is printed beside it,
with the greedy tokens of each run's sequences compared to the serial loop's on the same prompts
(where a batched kernel rounds otherwise than the one-row kernels, near-ties may flip).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time

import torch

from bench.random_package import add_package_args, build_random_package, describe, open_package
from onnxgen.genai.batched import BatchedDecoder
from onnxgen.genai.engine import DecodeEngine
from onnxgen.genai.sampling import SamplingParams


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, min(vocab, 10000)) for _ in range(length)] for _ in range(count)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_batch(decoder: BatchedDecoder, batch: int, args: argparse.Namespace) -> dict:
    engine = decoder.engine
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    sequences = [engine.new_sequence(p, params) for p in prompts(batch, args.prompt_tokens, engine.config.vocab_size,
                                                                 args.seed)]  # fmt: skip
    for sequence in sequences:
        decoder.admit(sequence)
    steps, groups, grouped = decoder.steps, decoder.prompt_groups, decoder.grouped_prompts
    sync(engine.device)
    start = time.perf_counter()
    while any(s.stats.new_tokens == 0 for s in sequences):
        decoder.iterate()
    sync(engine.device)
    first_all = time.perf_counter()
    before = sum(s.stats.new_tokens for s in sequences)  # the first ones had decoded while the rest were prompted
    while decoder.admitted:
        decoder.iterate()
    sync(engine.device)
    end = time.perf_counter()
    made = sum(s.stats.new_tokens for s in sequences)
    decode_tokens = made - before
    return {
        "end_to_end_tok_s": made / (end - start),
        "groups": f"{decoder.prompt_groups - groups} ({decoder.grouped_prompts - grouped} prompts)",
        "batch": batch,
        "prompts_s": first_all - start,
        "decode_s": end - first_all,
        "decode_tok_s": decode_tokens / (end - first_all) if end > first_all else 0.0,
        "steps": decoder.steps - steps,
        "tokens": [s.generated for s in sequences],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_package_args(parser)
    parser.add_argument("--batch", default="1,2,4,8", help="comma list of batch sizes")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--prefill-budget", type=int, default=None, help="prompt tokens per iteration at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capture", choices=["on", "off", "verify"], default="on", help="CUDA only (the CPU: off)")
    parser.add_argument("--serial-repeats", type=int, default=3, help="serial runs (their median is the baseline)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    if min(batches) < 1 or args.prompt_tokens < 1 or args.new_tokens < 2:
        parser.error("--batch values and --prompt-tokens must be >= 1, --new-tokens >= 2")
    args.kv = "dynamic" if args.device == "cpu" else args.kv
    capture = args.capture if args.device != "cpu" else "off"
    with tempfile.TemporaryDirectory() as directory, torch.inference_mode():
        built = build_random_package(args, directory)
        if built:
            say(f"built the package in {built:.1f} s")
        session, config = open_package(args)
        engine = DecodeEngine(session, config, kv=args.kv, capture=capture)
        serial_params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        all_prompts = prompts(max(batches), args.prompt_tokens, config.vocab_size, args.seed)
        list(engine.generate([engine.new_sequence(all_prompts[0], serial_params)]))  # warm-up
        runs = []
        for _ in range(args.serial_repeats):  # this machine's speed drifts: the median of a few
            run = engine.new_sequence(all_prompts[0], serial_params)
            list(engine.generate([run]))
            runs.append(run.stats.decode_tok_s)
        serial_tok_s = statistics.median(runs)
        serial_tokens = [list(engine.generate([engine.new_sequence(p, serial_params)])) for p in all_prompts]
        rows = []
        for batch in batches:
            decoder = BatchedDecoder(engine, max_seqs=batch, max_model_len=args.prompt_tokens + args.new_tokens + 1,
                                     prefill_chunk=args.prefill_chunk, prefix_caching=False,
                                     prefill_budget=args.prefill_budget)  # fmt: skip
            run_batch(decoder, batch, args)  # warm-up (and, captured, the recordings)
            row = run_batch(decoder, batch, args)
            row["same"] = sum(t == s for t, s in zip(row["tokens"], serial_tokens))
            row["capture"] = decoder.capture_stats.summary().splitlines()[0]
            rows.append(row)
            del decoder
            if args.device != "cpu":
                torch.cuda.empty_cache()
    print(f"{describe(args)} on {args.device}, capture {capture}: {args.prompt_tokens} prompt + {args.new_tokens} "
          f"new tokens per sequence, greedy; serial engine loop {serial_tok_s:.1f} tok/s decode (median of "
          f"{args.serial_repeats})\n")  # fmt: skip
    print("| batch | prompts s | prompt groups | decode s | decode tok/s | vs serial | end-to-end tok/s | steps "
          "| sequences = serial |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        ratio = row["decode_tok_s"] / serial_tok_s if serial_tok_s else float("nan")
        print(f"| {row['batch']} | {row['prompts_s']:.3f} | {row['groups']} | {row['decode_s']:.3f} "
              f"| {row['decode_tok_s']:.1f} | {ratio:.2f}x | {row['end_to_end_tok_s']:.1f} | {row['steps']} "
              f"| {row['same']}/{row['batch']} |")  # fmt: skip
    print()
    for row in rows:
        print(f"batch {row['batch']}: {row['capture']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
