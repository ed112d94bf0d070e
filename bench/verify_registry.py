"""docs/verify.md's table: teacher-forced agreement and KL of every registry model's int4 package.

    python -m bench.verify_registry                                   # every registry model (pulled if needed)
    python -m bench.verify_registry --models smollm2-135m-instruct --tokens 64 --json

For each model, the int4 and fp32 CPU packages (``onnxgen pull NAME`` and ``--precision fp32``, both
built from the same GGUF), and four rows on the same recorded contexts (the built-in prompts of
``onnxgen verify``, ``--tokens`` greedy tokens each, the generated positions scored):

- onnxgen int4 against the fp32 build: ``onnxgen verify INT4 --reference FP32``: what the int4
  package costs against the weights it was made from (its 4-bit rounding and onnxgen's arithmetic);
- onnxgen int4 against its own fp32 arithmetic: ``onnxgen verify INT4`` (the same int4 weights,
  dequantized, in fp32): what onnxgen's int4 kernels cost alone;
- onnxruntime int4 against the fp32 build, and against the int4 package's fp32 arithmetic: the
  same package's graph in an onnxruntime CPU session, as onnxruntime-genai runs it (MatMulNBits at
  the package's accuracy level 4: int8 activations), on the same contexts against the same
  reference logits.

Progress goes to stderr; the table (markdown) or ``--json`` to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from onnxgen.genai.agreement import Agreement
from onnxgen.genai.graph_layout import with_graph_layout
from onnxgen.genai.package import load_package_config
from onnxgen.genai.teacher_forcing import prefill_logits
from onnxgen.genai.verify import DEFAULT_PROMPTS, VerifySpec, run_verify
from onnxgen.genai.verify_report import VerifyReport
from onnxgen.models.fetch import package_dir
from onnxgen.models.pull import ensure_package, is_complete_package
from onnxgen.models.registry import MODELS
from onnxgen.runtime.fp32_reference import fp32_reference
from onnxgen.runtime.model_io import load_model
from onnxgen.runtime.session import InferenceSession

Logits = Callable[[list[int]], torch.Tensor]


def say(line: str) -> None:
    print(f"verify_registry: {line}", file=sys.stderr, flush=True)


def onnxgen_logits(package: Path, fp32: bool) -> Logits:
    """One pass of onnxgen over a context: the package's graph, or its fp32 reference."""
    config = load_package_config(package)
    proto, base_dir = load_model(config.model_file)
    config = with_graph_layout(config, proto)
    model = fp32_reference(proto, base_dir).model if fp32 else proto
    session = InferenceSession(model, base_dir=base_dir)
    return lambda ids: prefill_logits(session, config, ids)


def onnxruntime_logits(package: Path) -> Logits:
    """One pass of an onnxruntime CPU session over a context, on the package's graph as it is."""
    import onnxruntime as ort

    config = load_package_config(package)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(config.model_file), options, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    kv_type = np.float16 if "float16" in inputs[config.past_key_name(0)].type else np.float32

    def run(ids: list[int]) -> torch.Tensor:
        feeds = {config.io.input_ids: np.array([ids], np.int64)}
        if config.io.attention_mask in inputs:
            feeds[config.io.attention_mask] = np.ones((1, len(ids)), np.int64)
        if config.io.position_ids in inputs:
            feeds[config.io.position_ids] = np.arange(len(ids), dtype=np.int64)[None]
        empty = np.zeros((1, config.num_kv_heads, 0, config.head_size), kv_type)
        for layer in range(config.num_layers):
            feeds[config.past_key_name(layer)] = feeds[config.past_value_name(layer)] = empty
        (logits,) = session.run([config.io.logits], feeds)
        return torch.from_numpy(logits[0, :, : config.vocab_size].astype(np.float32))

    return run


def same_contexts(report: VerifyReport, reference: Logits, test: Logits) -> Agreement:
    """``test`` against ``reference`` over the contexts ``report`` recorded, its positions scored."""
    agreement = Agreement(report.agreement.near_tie)
    for index, (context, prompt) in enumerate(zip(report.contexts, report.prompt_lengths, strict=True)):
        first = 0 if report.all_positions else prompt - 1
        agreement.add(index, first, reference(context[:-1])[first:], test(context[:-1])[first:])
    return agreement


def row(model: str, path: str, reference: str, a: Agreement) -> dict[str, object]:
    return {
        "model": model,
        "path": path,
        "reference": reference,
        "positions": a.positions,
        "top1_agreement": a.top1_agreement,
        "kl_divergence_mean": a.kl_mean,
        "kl_divergence_max": a.kl_max,
        "near_ties": a.near_ties,
        "real_disagreements": a.real_disagreements,
    }


def measure(name: str, tokens: int) -> list[dict[str, object]]:
    int4 = ensure_package(name, precision="int4")
    fp32 = ensure_package(name, precision="fp32")
    build = f"fp32 build ({fp32.name})"
    say(f"{name}: onnxgen int4 against the fp32 build")
    common = {"tokens": tokens, "progress": say, "allow_real": True, "min_agreement": 0.0}
    against_build = run_verify(VerifySpec(int4, reference=str(fp32), **common))
    say(f"{name}: onnxgen int4 against its fp32 arithmetic")
    against_own = run_verify(VerifySpec(int4, **common))
    rows = [
        row(name, "onnxgen int4", build, against_build.agreement),
        row(name, "onnxgen int4", "its own fp32 arithmetic", against_own.agreement),
    ]
    gc.collect()
    say(f"{name}: onnxruntime int4 (accuracy level 4) on the same contexts")
    ort_int4 = onnxruntime_logits(int4)
    rows.append(
        row(name, "onnxruntime int4", build, same_contexts(against_build, onnxgen_logits(fp32, False), ort_int4))
    )
    gc.collect()
    own = onnxgen_logits(int4, True)
    rows.append(row(name, "onnxruntime int4", "its own fp32 arithmetic", same_contexts(against_own, own, ort_int4)))
    return rows


def table(rows: list[dict[str, object]], tokens: int) -> str:
    lines = [
        f"{len(DEFAULT_PROMPTS)} built-in prompts x {tokens} reference tokens, generated positions scored; "
        "near-tie: reference gap < 0.5 logits",
        "",
        "| model | path | reference | top-1 agreement | KL mean | KL max | near-ties | real |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['path']} | {r['reference']} | {r['top1_agreement']:.4f} | "
            f"{r['kl_divergence_mean']:.5f} | {r['kl_divergence_max']:.4f} | {r['near_ties']} | "
            f"{r['real_disagreements']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated registry names (default: all)")
    parser.add_argument("--tokens", type=int, default=64, help="reference tokens recorded per prompt")
    parser.add_argument("--cached-only", action="store_true", help="skip models whose packages are not built yet")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    for name in args.models.split(","):
        if args.cached_only and not all(
            is_complete_package(package_dir(name, precision, "cpu", "gqa")) for precision in ("int4", "fp32")
        ):
            say(f"{name}: not built (onnxgen pull {name}; onnxgen pull {name} --precision fp32): skipped")
            continue
        rows.extend(measure(name, args.tokens))
        gc.collect()
    print(json.dumps(rows, indent=2) if args.json else table(rows, args.tokens))


if __name__ == "__main__":
    main()
