"""Is a decode step run-to-run deterministic on CUDA? (Why onnxgen's SDPA leaves cuDNN out.)

    python -m bench.sdpa_determinism [--steps 256]

1. Each SDPA backend, on decode-shaped inputs (14 query heads, 2 KV heads, head 64, a bool mask),
   called 3,000 times: how many results differ from the first.
2. onnxgen's eager decode step, Qwen2.5-0.5B shape fp16 (random weights), run twice per step on
   the same inputs for --steps steps, with onnxgen's SDPA backends and then with cuDNN allowed:
   the first step whose two runs differ (verify mode needs none).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.random_package import add_package_args, build_random_package, open_package
from onnxgen.genai.kv_cache import StaticKV
from onnxgen.runtime.dtypes import ONNX_TO_TORCH
from onnxgen.runtime.ops import common


def backend_repeats(calls: int) -> None:
    torch.manual_seed(0)
    for length in (512, 2048):
        q = torch.randn(1, 14, 1, 64, device="cuda", dtype=torch.float16)
        k = torch.randn(1, 2, length, 64, device="cuda", dtype=torch.float16)
        v = torch.randn(1, 2, length, 64, device="cuda", dtype=torch.float16)
        mask = torch.zeros(1, 1, 1, length, dtype=torch.bool, device="cuda")
        mask[..., :300] = True
        expanded = k.repeat_interleave(7, 1), v.repeat_interleave(7, 1)
        for name, backend, gqa in [
            ("cudnn", SDPBackend.CUDNN_ATTENTION, True),
            ("efficient (KV heads repeated)", SDPBackend.EFFICIENT_ATTENTION, False),
            ("math", SDPBackend.MATH, True),
        ]:
            keys, values = (k, v) if gqa else expanded
            try:
                with sdpa_kernel([backend]):
                    args = (q, keys, values)
                    first = F.scaled_dot_product_attention(*args, attn_mask=mask, enable_gqa=gqa)
                    differ = 0
                    for _ in range(calls):
                        again = F.scaled_dot_product_attention(*args, attn_mask=mask, enable_gqa=gqa)
                        differ += not torch.equal(again, first)
                print(f"L={length} {name}: {differ} of {calls} calls differ from the first")
            except RuntimeError as exc:
                print(f"L={length} {name}: unavailable ({str(exc)[:80]})")


def eager_twice(steps: int) -> None:
    parser = argparse.ArgumentParser()
    add_package_args(parser)
    args = parser.parse_args(["--shape", "qwen2.5-coder-0.5b-instruct", "--context", "512"])
    with tempfile.TemporaryDirectory() as tmp:
        build_random_package(args, tmp)
        session, config = open_package(args)
        names = [o.name for o in session.program.outputs]
        past = next(i for i in session.graph_inputs if i.name == config.past_key_name(0))
        cudnn = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
        cudnn += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        for label, backends in (("onnxgen's SDPA backends", None), ("cuDNN allowed", cudnn)):
            if backends is not None:
                common.CUDA_SDPA_BACKENDS[:] = backends
            kv = StaticKV(config, ONNX_TO_TORCH[past.elem_type], session.device, args.context)
            ids = torch.randint(0, 1000, (1, 7), device="cuda")
            first_bad = None
            t0 = time.perf_counter()
            with torch.inference_mode():
                for step in range(steps):
                    n = ids.shape[1]
                    feeds = {"input_ids": ids, "attention_mask": kv.attention_mask(n), **kv.feeds()}
                    a = session.program.run({name: t.clone() for name, t in feeds.items()})
                    b = session.program.run(feeds)
                    if first_bad is None and any(not torch.equal(a[nm], b[nm]) for nm in names):
                        first_bad = step
                    kv.update({nm: b[nm] for nm in names}, n)
                    ids = b["logits"][0, -1].argmax().reshape(1, 1)
            print(f"eager twice per step, {label}: first differing step {first_bad} ({time.perf_counter() - t0:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    backend_repeats(args.calls)
    eager_twice(args.steps)


if __name__ == "__main__":
    main()
