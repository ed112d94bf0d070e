"""Where onnxgen's peak device memory goes: the free-memory drop that bench/peers_decode.py reports
(issue 18 compares it with onnxruntime-genai's), taken apart at its peak by the onnxgen line that
allocated each block.

    python -m bench.memory_peak --shape qwen2.5-coder-1.5b-instruct --precision int4
    python -m bench.memory_peak --package PKG --top 20

The Generator loads the package and runs the bench's generations (peers_decode's warm-up calls
and --repeats timed ones: --prompt-tokens prompt, --new-tokens greedy tokens) with torch's
allocator history recorded from before loading. The history is then replayed: torch's reserved
bytes (its segments, which are what the free-memory measure sees of it) at their highest, the
blocks alive at that moment grouped by the innermost onnxgen frame that allocated them, and the
reserved bytes no block used then (cached free blocks, recording pools' free space). What the
free-memory drop holds beyond torch's peak (CUDA context, loaded kernels, graph executables,
library workspaces) is the difference. CUDA only; the replay itself (``replay``) is plain Python.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

_GROW = ("segment_alloc", "segment_map")
_SHRINK = ("segment_free", "segment_unmap")


def site_of(frames: Iterable[Mapping[str, Any]]) -> str:
    """``path:line function`` of the innermost frame inside onnxgen (else the innermost outside
    torch and the standard library; else "(no Python frame)"): who asked for the block."""
    frames = list(frames)
    for frame in frames:
        name = str(frame.get("filename", ""))
        if "/onnxgen/" in name:
            return f"onnxgen/{name.rsplit('/onnxgen/', 1)[1]}:{frame.get('line')} {frame.get('name')}"
    for frame in frames:
        name = str(frame.get("filename", ""))
        if name and "/torch/" not in name and "/lib/python" not in name:
            return f"{name}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame)"


@dataclass
class Peak:
    """torch's reserved bytes at their highest in a trace, and the blocks alive then."""

    reserved: int = 0  # bytes in torch's segments at the peak (reserved before the trace included)
    live: int = 0  # bytes in live blocks then (blocks allocated before the trace are not seen)
    sites: Counter[str] = field(default_factory=Counter)  # live bytes at the peak per allocating site
    live_high: int = 0  # the most live bytes at any point of the trace


def replay(events: Iterable[Mapping[str, Any]], reserved_before: int = 0) -> Peak:
    """Replays torch's allocator trace (``torch.cuda.memory._snapshot()["device_traces"][d]``).

    Segments grow and shrink the reserved bytes; a block lives from its ``alloc`` to its
    ``free_requested`` (the allocator may hand it out again from then, on its stream). The peak's
    blocks are taken at the first ``alloc`` after the reserved bytes pass their highest so far: a
    segment is made for the block about to be allocated, so that block belongs to the peak. Frees
    of blocks allocated before the trace began are ignored."""
    reserved = reserved_before
    live: dict[int, tuple[int, str]] = {}
    live_bytes = 0
    peak = Peak(reserved=reserved)
    pending = False
    for event in events:
        action = event.get("action")
        size = int(event.get("size", 0))
        if action in _GROW:
            reserved += size
            if reserved > peak.reserved:
                peak.reserved, pending = reserved, True
        elif action in _SHRINK:
            reserved -= size
        elif action == "alloc":
            live[int(event["addr"])] = (size, site_of(event.get("frames") or ()))
            live_bytes += size
            peak.live_high = max(peak.live_high, live_bytes)
            if pending:
                peak.live, peak.sites, pending = live_bytes, _by_site(live), False
        elif action == "free_requested":
            block = live.pop(int(event["addr"]), None)
            if block is not None:
                live_bytes -= block[0]
    if pending:  # the trace ended on a new segment with no block after it
        peak.live, peak.sites = live_bytes, _by_site(live)
    return peak


def _by_site(live: Mapping[int, tuple[int, str]]) -> Counter[str]:
    """Live bytes per allocating site of blocks {address: (bytes, site)}."""
    sites: Counter[str] = Counter()
    for size, site in live.values():
        sites[site] += size
    return sites


def report(peak: Peak, drop: int, reserved_end: int, top: int) -> list[str]:
    """The lines printed: the drop taken apart, then the top sites at the peak."""
    mb = 1e6
    lines = [
        f"free-memory drop since before loading: {drop / mb:.0f} MB (at the end of the run)",
        f"torch reserved: {peak.reserved / mb:.0f} MB at its peak, {reserved_end / mb:.0f} MB at the end; beyond "
        f"torch at the end: {(drop - reserved_end) / mb:.0f} MB (CUDA context, kernels, graph executables, "
        "library workspaces)",
        f"at the peak: {peak.live / mb:.0f} MB in live blocks, {(peak.reserved - peak.live) / mb:.0f} MB reserved "
        f"but free (cached blocks, recording pools' free space); live blocks at most {peak.live_high / mb:.0f} MB "
        "at any point",
        f"live blocks at the peak by allocating site (top {top}):",
    ]
    for site, size in peak.sites.most_common(top):
        lines.append(f"  {size / mb:9.1f} MB  {site}")
    rest = sum(size for _, size in peak.sites.most_common()[top:])
    if rest:
        lines.append(f"  {rest / mb:9.1f} MB  ({len(peak.sites) - top} more sites)")
    return lines


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.genai_peer import WARMUP_CALLS, run_onnxgen, timed_runs
    from bench.peers_decode import write_tokenizer
    from bench.random_package import add_package_args, build_random_package, describe
    from onnxgen.genai import Generator
    from onnxgen.genai.benchmark import prompt_ids
    from onnxgen.models.random_source import MODEL_SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_package_args(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations after the warm-up calls")
    parser.add_argument("--top", type=int, default=15, help="allocating sites listed")
    parser.add_argument("--max-entries", type=int, default=2_000_000, help="allocator events kept")
    args = parser.parse_args(argv)
    if args.device != "cuda" or not torch.cuda.is_available():
        print("memory_peak: needs CUDA (torch's allocator history is a CUDA allocator's)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as directory:
        seconds = build_random_package(args, directory)
        if seconds:
            print(f"package: built in {seconds:.1f} s", file=sys.stderr)
            write_tokenizer(MODEL_SHAPES[args.shape], args.package_dir)  # the Generator wants one
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        reserved_before = torch.cuda.memory_reserved()
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=args.max_entries)  # fmt: skip
        generator = Generator(args.package_dir, device="cuda", capture="on")
        ids = prompt_ids(generator.config.vocab_size, args.prompt_tokens)
        timed_runs(lambda: run_onnxgen(generator, ids, args.new_tokens), args.repeats)
        torch.cuda.synchronize()
        drop = free_before - torch.cuda.mem_get_info()[0]
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        traces = snapshot.get("device_traces") or [[]]
        events = traces[torch.cuda.current_device()]
        print(f"{describe(args)}: {WARMUP_CALLS} warm-up + {args.repeats} generations of {args.prompt_tokens} + "
              f"{args.new_tokens} tokens, {len(events)} allocator events")  # fmt: skip
        if len(events) >= args.max_entries:
            print("memory_peak: the trace filled --max-entries; its start is lost, raise it", file=sys.stderr)
        for line in report(replay(events, reserved_before), drop, torch.cuda.memory_reserved(), args.top):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
