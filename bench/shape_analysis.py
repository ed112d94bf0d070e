"""How long symbolic shape inference + classification + capture planning take on a large graph.

The graph is the onnxgen builder's own decoder graph in the shape of Qwen2.5-1.5B (hidden 1536,
28 layers, 12 heads / 2 KV heads, head_dim 128, intermediate 8960, vocab 151936), built without
weights: the weight source hands out zero-stride views and the writer keeps only each
initializer's dims (inference reads nothing else). Target: analysis under 2 s.

    python -m bench.shape_analysis [--attention standard|gqa|both] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from onnxgen.models.builder_gqa import build_gqa
from onnxgen.models.builder_parts import BuildOptions, DecoderGraph
from onnxgen.models.builder_standard import build_standard
from onnxgen.models.config import DecoderConfig, weight_shapes
from onnxgen.models.graph_writer import _INLINE_BELOW, GraphWriter
from onnxgen.models.random_source import MODEL_SHAPES
from onnxgen.runtime.capture.report import analyse

QWEN25_15B = MODEL_SHAPES["qwen2.5-coder-1.5b-instruct"]


class ZeroSource:
    """Weights as zero-stride views: the right shapes, no memory."""

    def __init__(self, config: DecoderConfig) -> None:
        self.config = config
        self._shapes = weight_shapes(config)

    def names(self) -> list[str]:
        return list(self._shapes)

    def get(self, name: str) -> np.ndarray:
        return np.broadcast_to(np.float32(0), self._shapes[name])


class DimsOnlyWriter(GraphWriter):
    """Large initializers keep their dims and an external-data marker, never their bytes."""

    def initializer(self, name: str, array: np.ndarray) -> str:
        if array.nbytes < _INLINE_BELOW:
            return super().initializer(name, array)
        self._names.add(name)
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT16 if array.dtype == np.float16 else 1)
        tensor.dims.extend(array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        entry = tensor.external_data.add()
        entry.key, entry.value = "location", "absent"
        self.initializers.append(tensor)
        return name


def graph_only(config: DecoderConfig, attention: str, workdir: Path) -> onnx.ModelProto:
    writer = DimsOnlyWriter(workdir / f"{attention}.onnx")
    options = BuildOptions("fp32", "cpu", attention, config.max_position_embeddings)
    graph = DecoderGraph(writer, ZeroSource(config), options, None)
    np_ascontiguous = np.ascontiguousarray
    # the builder transposes linear weights; keep that zero-copy too
    np.ascontiguousarray = lambda a, *args, **kw: a if a.strides and 0 in a.strides else np_ascontiguous(a, *args, **kw)  # type: ignore[assignment]
    try:
        (build_gqa if attention == "gqa" else build_standard)(graph)
    finally:
        np.ascontiguousarray = np_ascontiguous  # type: ignore[assignment]
    path = writer.save("bench")
    return onnx.load(str(path), load_external_data=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", choices=["standard", "gqa", "both"], default="both")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    kinds = ["standard", "gqa"] if args.attention == "both" else [args.attention]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for attention in kinds:
            t0 = time.perf_counter()
            model = graph_only(QWEN25_15B, attention, Path(tmp))
            built = time.perf_counter() - t0
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                result = analyse(model)
                times.append(time.perf_counter() - t0)
            best, median = min(times), statistics.median(times)
            worst = max(worst, median)
            plan = result.plan
            print(
                f"{attention:8s} nodes {len(model.graph.node):5d}  graph built in {built:.1f} s  "
                f"analysis (infer + classify + plan + baseline plan) median {median * 1000:.0f} ms, "
                f"best {best * 1000:.0f} ms  segments {len(plan.segments)} (baseline {len(result.baseline.segments)})"
            )
    print(f"target < 2 s: {'ok' if worst < 2.0 else 'MISSED'}")
    return 0 if worst < 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
