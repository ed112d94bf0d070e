"""Shared by the benches that put onnxgen beside onnxruntime-genai on one package: a timed run of
each (same prompt ids, greedy, EOS ignored, exactly N new tokens), the median over repeats, and
package variants whose genai_config.json differs (weights hard-linked, not copied).

Timing convention (onnxgen's GenerationStats, applied to every engine): TTFT is prompt prefill +
first token; decode time covers the tokens after the first, so decode tok/s = (N - 1) / decode time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxgen.models.package_variants import link_package_files


@dataclass
class Run:
    ttft_s: float
    decode_s: float
    tokens: list[int]

    @property
    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0


def run_onnxgen(generator: Any, ids: list[int], new_tokens: int) -> Run:
    """One greedy generation through onnxgen's Generator; its own stats give TTFT and decode time."""
    from onnxgen.genai import SamplingParams

    tokens = list(generator.generate_ids(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)))
    stats = generator.last_stats
    return Run(stats.ttft_s, stats.decode_s, tokens)


def run_genai(model: Any, ids: list[int], new_tokens: int) -> Run:
    """One greedy generation through onnxruntime-genai; min_length = max_length keeps EOS from stopping it."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    total = len(ids) + new_tokens
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(ids)
    tokens: list[int] = []
    first = 0.0
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))  # a host read per token, as onnxgen does
        if len(tokens) == 1:
            first = time.perf_counter()
    end = time.perf_counter()
    return Run(first - start, end - first, tokens)


WARMUP_CALLS = 3  # onnxgen's captured prefill warms a prompt shape up twice, then records it


def timed_runs(fn: Callable[[], Run], repeats: int, warmup_s: float = 0.0) -> list[Run]:
    """WARMUP_CALLS warm-up calls (more until ``warmup_s`` seconds have passed), then `repeats` timed
    ones; the same for every engine."""
    start = time.perf_counter()
    for _ in range(WARMUP_CALLS):  # first-call allocations, weight repacking, dequant caches, graph recording
        fn()
    while time.perf_counter() - start < warmup_s:  # the GPU's clocks and caches settle, for every engine alike
        fn()
    return [fn() for _ in range(repeats)]


def median_run(fn: Callable[[], Run], repeats: int) -> tuple[Run, list[float]]:
    """The run of median decode speed among `repeats` timed ones (after a warm-up), and every rate."""
    runs = timed_runs(fn, repeats)
    rates = [r.decode_tok_s for r in runs]
    ordered = sorted(runs, key=lambda r: r.decode_tok_s)
    return ordered[len(ordered) // 2], rates


def genai_config_variant(package: Path, out: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A sibling package in `out` that shares `package`'s files (hard links) but whose
    genai_config.json is the original changed in place by `edit`."""
    link_package_files(package, out, skip={"genai_config.json"})
    config = json.loads((package / "genai_config.json").read_text())
    edit(config)
    (out / "genai_config.json").write_text(json.dumps(config, indent=4) + "\n")
    return out


def pin_intra_op_threads(config: dict[str, Any], threads: int) -> None:
    """Pins onnxruntime's intra-op thread count for the decoder's session. Its default is not one per
    core everywhere: on a 2-vCPU guest it runs one thread, so a comparison must pin the count it means."""
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads


def set_provider_option(config: dict[str, Any], provider: str, key: str, value: str) -> None:
    """Sets one option of a provider the decoder's session already names (it must name it: a
    variant should change how a provider runs, not which one)."""
    session = config["model"]["decoder"].setdefault("session_options", {})
    entries = session.get("provider_options", [])
    entry = next((e for e in entries if provider in e), None)
    if entry is None:
        named = [name for e in entries for name in e] or ["none (CPU)"]
        raise ValueError(f"genai_config.json names no {provider!r} provider (it names {', '.join(named)})")
    entry[provider][key] = value
