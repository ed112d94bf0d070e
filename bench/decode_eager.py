"""Eager decode speed of a random-weights package in a real model's shape (no tokenizer needed).

    python bench/decode_eager.py --shape smollm2-135m-instruct --precision fp16 --device cuda --kv static

Prints prefill time and decode tok/s for onnxgen's eager executor (no CUDA graphs yet).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from onnxgen.genai.kv_cache import DynamicKV, StaticKV
from onnxgen.genai.package import load_package_config
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import MODEL_SHAPES, RandomSource
from onnxgen.runtime import InferenceSession
from onnxgen.runtime.dtypes import ONNX_TO_TORCH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="smollm2-135m-instruct", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "int4"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", default="gqa", choices=["gqa", "standard"])
    parser.add_argument("--kv", default="static", choices=["static", "dynamic"])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=2048)
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
        build_s = time.perf_counter() - t0
        config = load_package_config(tmp)
        session = InferenceSession(config.model_file, device=args.device)
        inputs = {i.name: i for i in session.program.inputs}
        dtype = ONNX_TO_TORCH[inputs[config.past_key_name(0)].elem_type]
        dev = session.device

        def run(n_new: int) -> float:
            kv = StaticKV(config, dtype, dev, args.context) if args.kv == "static" else DynamicKV(config, dtype, dev)
            ids = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), device=dev)

            def step(tokens: torch.Tensor) -> torch.Tensor:
                n = tokens.shape[1]
                feeds = {"input_ids": tokens, "attention_mask": kv.attention_mask(n), **kv.feeds()}
                if "position_ids" in inputs:
                    feeds["position_ids"] = torch.arange(kv.length, kv.length + n, device=dev).reshape(1, n)
                out = session.run_torch(feeds)
                kv.update(out, n)
                return out["logits"][0, -1].argmax().reshape(1, 1)

            with torch.inference_mode():
                token = step(ids)
                int(token)
                start = time.perf_counter()
                for _ in range(n_new):
                    token = step(token)
                int(token)
                return time.perf_counter() - start

        run(8)  # warm-up
        seconds = sorted(run(args.new_tokens) for _ in range(3))[1]
        print(
            f"{args.shape} {args.precision} {args.attention} kv={args.kv} on {args.device}: build {build_s:.1f} s, "
            f"decode {args.new_tokens / seconds:.1f} tok/s ({1000 * seconds / args.new_tokens:.2f} ms/token, "
            f"eager, median of 3)"
        )


if __name__ == "__main__":
    main()
