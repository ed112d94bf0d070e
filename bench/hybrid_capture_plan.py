"""Capture plans of hybrid (Gated DeltaNet + full attention) decode steps, dense and MoE, from
onnxgen's builder and onnxruntime-genai's.

    python -m bench.hybrid_capture_plan [--family dense|moe|both] [--device cpu|cuda] [--builders onnxgen,genai]

Writes a Qwen3.5-shaped multimodal checkpoint with random weights in the layer pattern of a real
model (dense: Qwen3.5-0.8B, 24 layers, every 4th full attention; moe: Qwen3.5-35B-A3B, 40 layers,
every 4th full attention, routed experts plus a gated shared expert in every layer) at tiny widths,
builds it with each builder and prints, for a growing (dynamic) and a fixed-capacity (static) KV
cache, the segments of the decode step's plan under three rules:

- classifier: the growing-symbol classifier (what onnxgen records; `onnxgen show PKG --capture`);
- all-vary: every symbolic extent treated as varying, pinned ones too (the planner's baseline);
- strict: every extent bound to a number (batch 1, one token, a static cache's capacity) and a node
  captured only where all its extents are numbers: the "every dim static" rule.

Segment counts depend on the graph's structure and symbols, not on its widths or expert count, so
tiny widths give the real shape's plan. The graph analysed is the one a session on --device runs
(CUDA sessions run the fused graph).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx

FAMILIES = {
    # name: (layers, every Nth layer full attention, routed experts (0: dense MLPs), the real model)
    "dense": (24, 4, 0, "Qwen3.5-0.8B"),
    "moe": (40, 4, 16, "Qwen3.5-35B-A3B"),
}
CAPACITY = 256


def write_checkpoint(directory: Path, layers: int, full_every: int, experts: int) -> Path:
    import torch
    import transformers

    types = ["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(layers)]
    text = dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=CAPACITY, layer_types=types,
        eos_token_id=1, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    )  # fmt: skip
    if experts:
        text.update(num_experts=experts, num_experts_per_tok=8, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32)  # fmt: skip
        config_class, model_class = transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration
    else:
        config_class, model_class = transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration
    # the vision tower's widths differ from the vocabulary's (onnxruntime-genai's builder takes any
    # Linear as wide as the vocabulary for the LM head)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    model_class(config_class(text_config=text, vision_config=vision)).save_pretrained(directory)
    return directory


def build(builder: str, checkpoint: Path, out: Path, device: str) -> Path:
    precision = "fp16" if device == "cuda" else "fp32"
    if builder == "onnxgen":
        from onnxgen.models.builder import build_package
        from onnxgen.models.hf_source import HFSource

        return build_package(HFSource(checkpoint), out, device=device, precision=precision)
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
               "-p", precision, "-e", device, "-c", str(out.parent / "genai-cache")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"onnxruntime-genai's builder failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return out


def kv_symbols(package: Path, model: onnx.ModelProto) -> list[str]:
    from onnxgen.genai.graph_layout import with_graph_layout
    from onnxgen.genai.package import load_package_config
    from onnxgen.genai.package_checks import kv_sequence_symbols

    return kv_sequence_symbols(with_graph_layout(load_package_config(package), model), model)


def report(package: Path, device: str) -> list[str]:
    from onnxgen.runtime.capture.report import analyse
    from onnxgen.runtime.fusion import fuse_for_device

    stored = onnx.load(str(package / "model.onnx"), load_external_data=False)
    model, _ = fuse_for_device(stored, device)
    symbols = kv_symbols(package, stored)
    batch = {"batch_size": 1} if any(d.dim_param == "batch_size" for v in model.graph.input
                                      for d in v.type.tensor_type.shape.dim) else {}  # fmt: skip
    lines = []
    for kv, bind in (("dynamic", {}), ("static", dict.fromkeys(symbols, CAPACITY))):
        analysis = analyse(model, bind)
        strict = analyse(model, {**bind, **batch}).baseline
        counts = analysis.plan.counts()
        seams = sorted({n.op_type for n in analysis.plan.nodes if n.segment is None and not n.folded})
        lines.append(
            f"  {kv:7} KV: classifier {len(analysis.plan.segments)} segment(s), all-vary "
            f"{len(analysis.baseline.segments)}, strict {len(strict.segments)}; {counts['captured']} of "
            f"{counts['nodes']} nodes captured, {counts['eager_seams']} eager seam(s)"
            f"{' (' + ', '.join(seams) + ')' if seams else ''}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="both", choices=[*FAMILIES, "both"])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="the packages' target device")
    parser.add_argument("--builders", default="onnxgen,genai", help="comma-separated: onnxgen, genai")
    args = parser.parse_args()
    builders = [b.strip() for b in args.builders.split(",") if b.strip()]
    unknown = [b for b in builders if b not in ("onnxgen", "genai")]
    if unknown:
        parser.error(f"unknown builder(s) {unknown}; expected onnxgen and/or genai")
    families = list(FAMILIES) if args.family == "both" else [args.family]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for family in families:
            layers, full_every, experts, real = FAMILIES[family]
            print(f"building the {real} layer pattern ({family})...", file=sys.stderr)
            checkpoint = write_checkpoint(root / family / "hf", layers, full_every, experts)
            full = layers // full_every
            what = f"{experts} routed experts" if experts else "dense MLPs"
            print(f"{real} pattern: {layers} layers ({full} full attention, {layers - full} Gated DeltaNet), {what}")
            for builder in builders:
                package = build(builder, checkpoint, root / family / builder, args.device)
                print(f" {builder} builder, {args.device} package:")
                print("\n".join(report(package, args.device)))


if __name__ == "__main__":
    main()
