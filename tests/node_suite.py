"""Run the ONNX backend node-test cases (built in memory by the onnx package) through onnxgen.

Usable as a module (``run_suite``) by the test, and as a script for kernel work:
    python tests/node_suite.py [-k SUBSTRING] [--failures] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import onnx


@dataclass
class CaseResult:
    name: str
    category: str
    status: str  # "pass" | "fail" | "error" | "unsupported"
    detail: str = ""


def _category(model: onnx.ModelProto) -> str:
    from onnxgen.runtime.ops.registry import load_all_ops, lookup, normalize_domain

    load_all_ops()
    opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
    for node in model.graph.node:
        if node.op_type == "Constant":
            continue
        spec = lookup(node.domain, node.op_type, opsets.get(normalize_domain(node.domain), 1))
        return spec.family if spec else "no implementation"
    return "constant"


def _compare(expected: object, actual: object, rtol: float, atol: float, where: str) -> None:
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            raise AssertionError(f"{where}: expected a sequence of {len(expected)} items, got {type(actual).__name__}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            _compare(e, a, rtol, atol, f"{where}[{i}]")
        return
    if expected is None:
        if actual is not None:
            raise AssertionError(f"{where}: expected an empty optional, got a value")
        return
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    if expected.dtype == object or expected.dtype.kind in "US":
        if expected.shape != actual.shape or not (expected.astype(object) == actual.astype(object)).all():
            raise AssertionError(f"{where}: string tensors differ: {expected!r} vs {actual!r}")
        return
    if expected.dtype != actual.dtype:
        raise AssertionError(f"{where}: dtype {actual.dtype}, expected {expected.dtype}")
    if expected.shape != actual.shape:
        raise AssertionError(f"{where}: shape {actual.shape}, expected {expected.shape}")
    if expected.dtype.kind in "fc" or expected.dtype.name in ("bfloat16",) or expected.dtype.name.startswith("float"):
        np.testing.assert_allclose(
            actual.astype(np.float64) if expected.dtype.kind != "c" else actual,
            expected.astype(np.float64) if expected.dtype.kind != "c" else expected,
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            err_msg=where,
        )
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=where)


def run_case(case, device: str = "cpu") -> CaseResult:
    from onnxgen.errors import UnsupportedOpError
    from onnxgen.runtime import InferenceSession

    model = case.model
    if case.name.endswith("_expanded") or "_expanded_" in case.name:
        category = "expanded"  # function bodies written out as primitive ops
    else:
        try:
            category = _category(model)
        except Exception:
            category = "no implementation"
    try:
        session = InferenceSession(model, device=device)
    except UnsupportedOpError as exc:
        return CaseResult(case.name, category, "unsupported", str(exc).splitlines()[-1].strip())
    except Exception as exc:
        return CaseResult(case.name, category, "error", f"load: {type(exc).__name__}: {exc}")
    input_names = [i.name for i in model.graph.input]
    init_names = {t.name for t in model.graph.initializer}
    output_names = [o.name for o in model.graph.output]
    for index, (inputs, outputs) in enumerate(case.data_sets):
        # some cases (Cast to/from float8, int4, ...) carry their data as TensorProtos
        inputs = [onnx.numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v for v in inputs]
        outputs = [onnx.numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v for v in outputs]
        feeds = {n: v for n, v in zip([n for n in input_names if n not in init_names] or input_names, inputs)}
        try:
            results = session.run(None, feeds)
        except Exception as exc:
            return CaseResult(case.name, category, "error", f"run: {type(exc).__name__}: {exc}"[:500])
        try:
            for name, expected, actual in zip(output_names, outputs, results):
                _compare(expected, actual, case.rtol, case.atol, f"data set {index}, output {name!r}")
        except AssertionError as exc:
            return CaseResult(case.name, category, "fail", str(exc)[:500])
    return CaseResult(case.name, category, "pass")


def collect_cases(pattern: str | None = None) -> list:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    if pattern:
        cases = [c for c in cases if pattern in c.name]
    return sorted(cases, key=lambda c: c.name)


def run_suite(pattern: str | None = None, device: str = "cpu") -> list[CaseResult]:
    results = []
    for case in collect_cases(pattern):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results.append(run_case(case, device))
    return results


def summarize(results: list[CaseResult]) -> str:
    by_category: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_category[r.category][r.status] += 1
    lines = []
    for category in sorted(by_category):
        c = by_category[category]
        failed = c["fail"] + c["error"] + c["unsupported"]
        lines.append(
            f"{category:>16}: {c['pass']} passed, {failed} failed"
            f" (wrong {c['fail']}, raised {c['error']}, no implementation {c['unsupported']})"
        )
    total = Counter(r.status for r in results)
    failed = len(results) - total["pass"]
    lines.append(
        f"{'node suite':>16}: {total['pass']} passed, {failed} failed of {len(results)} "
        f"({100.0 * total['pass'] / max(len(results), 1):.1f}%)"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-k", dest="pattern", default=None, help="only cases whose name contains this")
    parser.add_argument("--failures", action="store_true", help="print every failing case with its reason")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    start = time.perf_counter()
    results = run_suite(args.pattern, args.device)
    if args.failures:
        for r in results:
            if r.status != "pass":
                print(f"{r.status:>11} {r.name}: {r.detail}")
    print(summarize(results))
    print(f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
