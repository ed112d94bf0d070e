"""Shared by the GPU decode benches: a random-weights package in a real model's shape, and a
greedy decode loop over InferenceSession (optionally through a CaptureRuntime for single-token
steps) that reads one token id back per step, as the Generator does (pipelined with a captured
static-KV step, as the Generator's default on CUDA; --no-pipeline for the sequential loop)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

from onnxgen.genai.decode_tail import GreedyTail
from onnxgen.genai.host_read import host_read
from onnxgen.genai.kv_cache import DynamicKV, StaticKV
from onnxgen.genai.package import PackageConfig, load_package_config
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import MODEL_SHAPES, RandomSource
from onnxgen.runtime import InferenceSession
from onnxgen.runtime.capture.runtime import CaptureRuntime
from onnxgen.runtime.dtypes import ONNX_TO_TORCH


def add_package_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="smollm2-135m-instruct", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "int4"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", default="gqa", choices=["gqa", "standard"])
    parser.add_argument("--kv", default="static", choices=["static", "dynamic"])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--package", default=None, help="an existing package instead of random weights")
    parser.add_argument(
        "--no-pipeline",
        action="store_true",
        help="captured static-KV decode reads each token before building the next step (the old sequential "
        "loop) instead of enqueuing step N+1 before waiting for token N",
    )


def build_random_package(args: argparse.Namespace, directory: str | Path) -> float:
    """Builds the random-weights package into ``directory`` (or, with --package, points args at it)."""
    if args.package:
        args.package_dir = Path(args.package)
        return 0.0
    args.package_dir = Path(directory)
    t0 = time.perf_counter()
    build_package(
        RandomSource(MODEL_SHAPES[args.shape]),
        directory,
        precision=args.precision,
        device=args.device,
        attention=args.attention,
        context_length=args.context,
    )
    return time.perf_counter() - t0


def static_pin(session: InferenceSession, config: PackageConfig) -> set[str]:
    """The symbols a static cache fixes: the KV buffer length and the mask width."""
    return StaticKV.pinned_symbols(session.program.inputs, config)


class GreedyLoop:
    """Prefill + greedy single-token decode; one static cache reused across runs (reset in place),
    so a recorded graph keeps its addresses from one run to the next."""

    def __init__(self, session: InferenceSession, config: PackageConfig, args: argparse.Namespace):
        self.session, self.config, self.args = session, config, args
        self.inputs = {i.name for i in session.program.inputs}
        past = next(i for i in session.program.inputs if i.name == config.past_key_name(0))
        self.dtype = ONNX_TO_TORCH[past.elem_type]
        self.static: StaticKV | None = None
        self.decode_ids: torch.Tensor | None = None
        self.decode_pos: torch.Tensor | None = None
        self.tail: GreedyTail | None = None
        self.tail_wants_host = True
        self.tail_ready_at: int | None = None  # the KV length the last step's tail prepared the feeds for

    def sample_in_graph(self) -> bool:
        """As the Generator's default: the argmax, position and mask row run at the end of the captured
        step (GreedyTail); ``ONNXGEN_SAMPLE_IN_GRAPH=0`` (read per run: a sweep variant) keeps them as
        eager kernels between the steps."""
        return os.environ.get("ONNXGEN_SAMPLE_IN_GRAPH", "1") != "0"

    def pipelined(self, runtime: CaptureRuntime | None) -> bool:
        """Whether run() looks one step ahead: what the Generator does by default on CUDA (captured
        decode, static KV), unless --no-pipeline. (On the CPU with --replay-recorder: a smoke test.)"""
        return runtime is not None and self.args.kv == "static" and not getattr(self.args, "no_pipeline", False)

    def tail_of(self, kv: StaticKV) -> GreedyTail:
        """The greedy tail over the persistent decode feeds and this cache's mask (made once)."""
        assert self.decode_ids is not None and self.decode_pos is not None
        # ONNXGEN_HOST_TOKENS=0 (a sweep variant): the loop copies each token to the host as before
        wants_host = os.environ.get("ONNXGEN_HOST_TOKENS", "1") != "0"
        tail = self.tail
        if tail is None or tail.state()["mask"] is not kv.mask or self.tail_wants_host != wants_host:
            host = GreedyTail.host_tokens_for(kv.capacity, kv.device) if wants_host else None
            ids, pos = self.decode_ids, self.decode_pos
            tail = self.tail = GreedyTail("logits", self.config.vocab_size, ids, pos, kv.mask, host)
            self.tail_wants_host = wants_host
        return tail

    def new_kv(self) -> StaticKV | DynamicKV:
        dev = self.session.device
        if self.args.kv == "dynamic":
            return DynamicKV(self.config, self.dtype, dev)
        if self.static is None:
            self.static = StaticKV(self.config, self.dtype, dev, self.args.context)
        self.static.reset()
        return self.static

    def run(
        self, runtime: CaptureRuntime | None, new_tokens: int | None = None, after_prefill: Any = None
    ) -> tuple[float, float, list[int]]:
        """Returns (TTFT seconds, decode seconds for the tokens after the first, token ids).
        ``after_prefill()`` is called once the first token is read back (a profiler starts there)."""
        dev = self.session.device
        kv = self.new_kv()
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.config.vocab_size, (1, self.args.prompt_tokens), generator=gen).to(dev)
        n_new = self.args.new_tokens if new_tokens is None else new_tokens

        # as the Generator: a captured one-token step with static KV is fed the same ids and
        # positions tensors every step (used in place by the capture), and argmax writes the next
        # token straight into the ids
        persistent = runtime is not None and isinstance(kv, StaticKV)
        if persistent and self.decode_ids is None:
            self.decode_ids = torch.zeros((1, 1), dtype=torch.int64, device=dev)
            self.decode_pos = torch.zeros((1, 1), dtype=torch.int64, device=dev)
        tail = self.tail_of(kv) if persistent and self.sample_in_graph() else None

        def step(tokens: torch.Tensor) -> torch.Tensor:
            n = tokens.shape[1]
            one = persistent and n == 1
            if one and tokens.data_ptr() != self.decode_ids.data_ptr():
                self.decode_ids.copy_(tokens)
            step_tail = tail if one else None
            prepared = step_tail is not None and self.tail_ready_at == kv.length  # by the step before
            mask = kv.attention_mask(n, set_rows=not prepared) if isinstance(kv, StaticKV) else kv.attention_mask(n)
            feeds = {"input_ids": self.decode_ids if one else tokens, "attention_mask": mask}
            feeds.update(kv.feeds())
            if one and not prepared and ("position_ids" in self.inputs or step_tail is not None):
                self.decode_pos.fill_(kv.length)
            if "position_ids" in self.inputs:
                feeds["position_ids"] = (
                    self.decode_pos if one else torch.arange(kv.length, kv.length + n, device=dev).reshape(1, n)
                )
            if runtime is not None and n == 1:
                out = runtime.run(feeds, tail=step_tail)
            else:
                out = self.session.run_torch(feeds)
            kv.update(out, n)
            self.tail_ready_at = kv.length if step_tail is not None else None
            if step_tail is not None:
                return self.decode_ids  # the tail wrote the next token
            row = out["logits"][0, -1]
            if persistent:
                torch.argmax(row, out=self.decode_ids.view(()))
                return self.decode_ids
            return row.argmax().reshape(1, 1)

        tokens: list[int] = []
        with torch.inference_mode():
            start = time.perf_counter()
            token = step(ids)
            tokens.append(int(token))
            if after_prefill is not None:
                after_prefill()
            first = time.perf_counter()
            if not self.pipelined(runtime):
                for _ in range(n_new - 1):
                    token = step(token)
                    tokens.append(int(token))  # the one device-to-host read per token
                return first - start, time.perf_counter() - first, tokens
            # as Generator._decode_pipelined: token i's read is enqueued, then step i+1 (from the device
            # tensor), then the host waits for token i only, so it builds step i+2 while the GPU runs i+1;
            # no step past n_new tokens
            # a tail that stores each token in pinned host memory: the read waits for the step's end only
            host = tail.host_tokens if tail is not None and tail.writes_host else None
            reader = host_read(dev, host)
            at: int | None = None  # token i's index in host (the position it will be fed at)
            if n_new > 1:
                token = step(token)
                at = kv.length if host is not None else None
            for i in range(2, n_new + 1):  # token i is on the device
                reader.start(token, at)
                ahead, ahead_at = (step(token), kv.length if host is not None else None) if i < n_new else (token, at)
                tokens.append(reader.wait())
                token, at = ahead, ahead_at
            return first - start, time.perf_counter() - first, tokens


def open_package(args: argparse.Namespace) -> tuple[InferenceSession, PackageConfig]:
    config = load_package_config(args.package_dir)
    device = args.device
    return InferenceSession(config.model_file, device=device), config


def describe(args: argparse.Namespace) -> str:
    what = str(args.package) if args.package else f"{args.shape} {args.precision} {args.attention} (random weights)"
    return f"{what} kv={args.kv}"
