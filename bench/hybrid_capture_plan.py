"""Capture plans of a hybrid (Gated DeltaNet + full attention) decode step, from a layer pattern.

    python -m bench.hybrid_capture_plan [--layers 24] [--full-every 4] [--device cpu|cuda]

Writes a Qwen3_5ForCausalLM checkpoint with random weights in the given layer pattern (default:
the Qwen3.5-0.8B pattern, 24 layers, every 4th full attention) at tiny widths, builds it with
onnxgen's builder and prints, for a growing (dynamic) and a fixed-capacity (static) KV cache, the
planner's segments with the growing-symbol classifier and without it (every symbolic extent
treated as varying), as `onnxgen show PKG --capture` counts them. Segment counts depend on the
graph's structure and symbols, not on its widths, so the tiny widths give the real shape's plan.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import onnx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--full-every", type=int, default=4, help="every Nth layer is full attention")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="the package's target device")
    args = parser.parse_args()

    import transformers

    from onnxgen.models.builder import build_package
    from onnxgen.models.hf_source import HFSource
    from onnxgen.runtime.capture.report import analyse

    types = ["full_attention" if (i + 1) % args.full_every == 0 else "linear_attention" for i in range(args.layers)]
    config = transformers.Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256, layer_types=types,
        eos_token_id=1, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        transformers.Qwen3_5ForCausalLM(config).save_pretrained(directory / "hf")
        precision = "fp16" if args.device == "cuda" else "fp32"
        package = build_package(HFSource(directory / "hf"), directory / "pkg", device=args.device, precision=precision)
        model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    full = types.count("full_attention")
    print(f"{args.layers} layers ({full} full attention, {args.layers - full} Gated DeltaNet), {args.device} package")
    for kv, bind in (("dynamic", {}), ("static", {"past_sequence_length": 256, "total_sequence_length": 256})):
        analysis = analyse(model, bind)
        counts = analysis.plan.counts()
        seams = sorted({n.op_type for n in analysis.plan.nodes if n.segment is None and not n.folded})
        print(
            f"  {kv} KV: {len(analysis.plan.segments)} segment(s) with the classifier, "
            f"{len(analysis.baseline.segments)} without it; {counts['captured']} of {counts['nodes']} nodes captured, "
            f"{counts['eager_seams']} eager seam(s){' (' + ', '.join(seams) + ')' if seams else ''}"
        )


if __name__ == "__main__":
    main()
