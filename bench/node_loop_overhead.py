"""Per-node cost of the node loop on the CPU: a long chain of cheap ops, run eagerly and captured.

    python -m bench.node_loop_overhead                      # 500 nodes, eager and replayed
    python -m bench.node_loop_overhead --nodes 1000 --runs 400 --repeats 7
    python -m bench.node_loop_overhead --ops Identity        # the loop's own cost, nearly alone

The kernels (Identity, Add, Mul on a [1, 4] float tensor) cost about as little as a torch call
can, so what this measures is mostly the loop's own Python work per node: argument lookup, the
kernel call and its error wrapping, output binding and releases. ``eager`` times
``GraphProgram.run``; ``replay`` times ``CaptureRuntime.run`` with the CPU ``ReplayRecorder``,
whose replays run every node of the one segment again through the capture path (frozen host
arguments). Each repeat is ``--runs`` runs; the median of the repeats is printed with its spread,
which on a shared machine says how far apart two numbers must be to differ.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxgen.runtime.capture.recorder import ReplayRecorder
from onnxgen.runtime.capture.runtime import CaptureRuntime
from onnxgen.runtime.session import InferenceSession

OPS = ("Identity", "Add", "Mul")


def chain_model(nodes: int, ops: tuple[str, ...] = OPS) -> onnx.ModelProto:
    """``nodes`` cheap ops in a chain, ``ops`` in turn: Identity(x), Add(x, c), Mul(x, c)."""
    c = numpy_helper.from_array(np.full((1, 4), 1.0, np.float32), "c")
    graph_nodes = []
    previous = "x"
    for i in range(nodes):
        op = ops[i % len(ops)]
        inputs = [previous] if op == "Identity" else [previous, "c"]
        out = "y" if i == nodes - 1 else f"v{i}"
        graph_nodes.append(helper.make_node(op, inputs, [out], name=f"{op.lower()}_{i}"))
        previous = out
    graph = helper.make_graph(
        graph_nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [c],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def per_node_us(run: object, feeds: dict, runs: int, nodes: int) -> float:
    start = time.process_time()  # CPU time: the machine may be shared
    for _ in range(runs):
        run(feeds)  # type: ignore[operator]
    return (time.process_time() - start) / runs / nodes * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--runs", type=int, default=200, help="runs of the graph per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--ops", default=",".join(OPS), help="op types in turn; Identity alone leaves the loop's own cost"
    )
    parser.add_argument("--skip-replay", action="store_true", help="time only GraphProgram.run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ops = tuple(args.ops.split(","))
    if not set(ops) <= set(OPS):
        parser.error(f"--ops takes {', '.join(OPS)}")
    model = chain_model(args.nodes, ops)
    session = InferenceSession(model, device="cpu")
    program = session.program
    feeds = {"x": torch.ones(1, 4)}
    paths = {"eager": program.run}
    if not args.skip_replay:
        runtime = CaptureRuntime(program, session.model, recorder=ReplayRecorder())
        for _ in range(4):  # warm-up, record, first replay
            runtime.run(feeds)
        assert runtime.stats.replays > 0, runtime.stats.summary()
        paths["replay"] = runtime.run
    for name, run in paths.items():
        per_node_us(run, feeds, max(1, args.runs // 10), args.nodes)  # warm
        samples = [per_node_us(run, feeds, args.runs, args.nodes) for _ in range(args.repeats)]
        median = statistics.median(samples)
        print(
            f"{name:6s} {args.nodes} nodes ({args.ops}): {median:.3f} us/node median of {args.repeats} "
            f"(min {min(samples):.3f}, max {max(samples):.3f})"
        )


if __name__ == "__main__":
    main()
