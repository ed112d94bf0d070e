"""Decode speed of onnxgen beside its peers, one model shape and precision, one table (issue 7).

One set of seeded random weights in a real model's shape is written as a Hugging Face checkpoint
(config.json + model.safetensors + a stand-in word-level tokenizer); onnxgen's builder turns that
directory into a package (attention gqa) for the target device and precision. Engines:

    onnxgen          onnxgen's Generator on the package, CUDA graphs on (capture="on"; the CPU has none)
    onnxgen-eager    the same with capture="off"
    ort-genai-graph  onnxruntime-genai on the same package, cuda provider option enable_cuda_graph "1" (CUDA only)
    ort-genai        the same with enable_cuda_graph "0" (on the CPU: its CPU provider, its intra-op threads
                     pinned to torch's count by --genai-threads: onnxruntime's own default is one on a 2-vCPU guest)
    ort-genai-own-graph, ort-genai-own
                     onnxruntime-genai on a package its own builder made from the same checkpoint
                     (python -m onnxruntime_genai.models.builder -p PRECISION -e DEVICE): its best form
    onnxgen-on-genai onnxgen on that package (what a user of the peer's packages gets from onnxgen)
    hf-eager         transformers' generate from the checkpoint directory (default attention, dynamic cache)
    llama-cpp        llama.cpp's llama-bench on a GGUF its own converter made from the checkpoint (F16; Q4_0 for
                     int4), needs --llamacpp and --tokenizer-from (bench/llamacpp_peer.py says why and how)
    hf-compile       transformers' generate with a static KV cache and the single-token forward compiled by
                     torch.compile(mode="reduce-overhead") (CUDA only)

Every engine decodes the same --prompt-tokens random prompt ids greedily and makes exactly
--new-tokens tokens: onnxgen ignores EOS (ignore_eos), onnxruntime-genai and transformers are kept
from stopping by min_length = max_length / min_new_tokens = max_new_tokens (which also keeps EOS from
being chosen, so token sequences are compared only before onnxgen's first EOS). Precision: the
package is fp16, int4 (MatMulNBits, fp16 activations on CUDA) or fp32; transformers runs fp16
weights on CUDA for both fp16 and int4 (it has no int4 path here: its int4 row is an fp16 run) and
fp32 on the CPU. The checkpoint holds fp16 weights unless --precision fp32, so onnxgen, onnxruntime-genai
and transformers compute from the same rounded values.

Method: warm-up generations per engine (at least three, and for at least --warmup-s seconds), then
--repeats timed ones; the table shows medians.
TTFT is prompt prefill + first token; decode tok/s = (N - 1) / (time after the first token).
onnxgen and onnxruntime-genai are timed token by token (each reads every token id back to the host).
transformers exposes only a whole generate() call, so each timed repeat is a 1-token generate (its
time is the TTFT) and an N-token generate: decode time = (time for N tokens - TTFT), over N - 1 tokens.
hf-compile keeps one StaticCache for every call (reset in between) so the recorded CUDA graphs keep
their KV addresses; where transformers has CompileConfig, generate() compiles the decode step itself
(prefill stays eager, as transformers requires for a static cache), else model.forward is wrapped
in torch.compile. A compile failure is reported in the table, not raised.

Bandwidth floor: a decode step must read every weight once; the floor is the bytes of the decoder's
initializers as stored in the package (tables that only a Gather reads, i.e. the embedding lookup of
one row, left out; rotary caches counted; a mixture of experts' per-expert tensors at top-k / experts
of their size, what one token's routing reads) divided by the H200's measured copy bandwidth.
KV-cache and recurrent-state reads (a few MB at these lengths) are left out.

Hybrid shapes (issue 21: qwen3.5-0.8b, qwen3.5-35b-a3b; tiny-qwen3.5, tiny-qwen3.5-moe for smoke runs):
Gated DeltaNet layers with gated full attention every 4th layer (MODEL_SHAPES says where the widths
come from). The checkpoint is transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (text only;
hf_config_for checks that the class holds exactly these weights, the routed experts one tensor per
expert as save_pretrained writes them). Per engine:
  - ort-genai, ort-genai-graph: onnxruntime-genai 0.18 feeds a hybrid's recurrent states
    (past.N.conv, past.N.recurrent) only where genai_config.json names them (past_conv_names /
    past_recurrent_names / present_*); onnxgen's builder writes those names, and for a package
    built before it did the bench adds them in a variant's genai_config.json (the row says so).
    onnxruntime-genai runs onnxgen's graph as it is (no position_ids input, channels-last conv
    states: it takes the states' shapes from the graph), checked on its CPU provider, where its
    greedy tokens equal onnxgen's. Whether its CUDA provider runs every op there is for the GPU run.
  - ort-genai-own*, onnxgen-on-genai: onnxruntime-genai 0.18's builder takes this layout only as the
    multimodal Qwen3_5(Moe)ForConditionalGeneration. The bench writes that form beside the checkpoint
    from the same tensors (model.language_model.*, lm_head.*), a one-block random vision tower
    (model.visual.*, TINY_VISION) whose widths differ from the vocabulary (the builder takes any Linear
    as wide as the vocabulary for the LM head; write_wrapper_checkpoint refuses a clash).
  - hf-eager: transformers' Qwen3_5(Moe)ForCausalLM; its note says whether flash-linear-attention and
    causal-conv1d are installed (without them its Gated DeltaNet runs its reference PyTorch code).
    hf-compile is left out of the issue-21 commands (not tried on a hybrid here).
  - llama-cpp: the converter of llama-cpp-python 0.3.36's tree registers Qwen3_5ForCausalLM and
    Qwen3_5MoeForCausalLM (qwen35 / qwen35moe) but stops unless the checkpoint has the published
    multi-token-prediction head, which random checkpoints lack: hybrids are converted with --no-mtp
    (converter_flags). Checked on the CPU with a CPU build of that tree and a Qwen2.5 tokenizer.json
    (--tokenizer-from; the converter pads the vocabulary to the shape's): converter, llama-quantize
    Q4_0 and llama-bench take both tiny hybrids and the qwen3.5-0.8b shape (this row's path). The
    35B-A3B shape has no checkpoint to convert (below).

Disk and memory: before anything is written the run estimates what it would write (--plan prints
it) and refuses early where it would not fit. The fp16 checkpoint of qwen3.5-35b-a3b is about 69 GB,
more than the GPU machine's 64 GB disk, and its writer would hold it all in memory; an int4-only
checkpoint is no way out, since onnxruntime-genai's builder, transformers and llama.cpp's converter
all start from float weights. So for a shape whose checkpoint does not fit (checkpoint_problem) no
checkpoint is written: onnxgen's package is built straight from RandomSource (the same seeded
weights, one tensor at a time, unrounded), the engines that read a checkpoint are refused with the
sizes, and onnxgen, onnxgen-eager, ort-genai-graph and ort-genai run (onnxgen's int4 package of the
35B-A3B shape is about 21 GB). That build draws and quantizes the 35 B weights in worker processes,
one per core but one (onnxgen.models.build_pool: the package a serial build writes, byte for byte),
so on the GPU machine's 16 cores it ends well inside one device call: bench/hybrid_peers_device.sh
build-35b runs it (--build-only) in a call of its own, and the next call runs the table on it.

Set-up on the offline GPU machine (facts from ../shared/device/README.md and pack-wheels.sh):
  1. here, from the repo root (downloads the cp312 wheels, about 272 MB, into git-ignored .wc1/ .wc2/ ...):
       bash ../shared/device/pack-wheels.sh onnxruntime-gpu==1.31.1 onnxruntime-genai-cuda==0.18.0
  2. on the device, one call per folder, in order K = 1, 2, ... (the last installs into /tmp/site and
     writes /tmp/site-env.sh; a restarted machine has lost /tmp: start again from .wc1):
       run(command="bash .wcK/stash.sh", carry=[".wcK"])
  3. on the device, in the same command as the bench (onnxruntime-gpu 1.31.1 is a CUDA 13 build that
     finds its CUDA libraries through that machine's torch; /tmp/site shadows the CPU onnxruntime there):
       export PYTHONPATH=/tmp/site:$PWD; source /tmp/site-env.sh

Examples (device):
    export PYTHONPATH=/tmp/site:$PWD; source /tmp/site-env.sh
    python3 -m bench.peers_decode --shape qwen2.5-coder-0.5b-instruct --precision fp16
    python3 -m bench.peers_decode --shape qwen2.5-coder-0.5b-instruct --precision int4 --workdir /tmp/peers
    python3 -m bench.peers_decode --shape smollm2-135m-instruct --engines onnxgen,ort-genai-graph --repeats 5
Issue 21 (H200, batch 1, 16-token prompt, 128 new tokens: the defaults), one device call per line, each
right after the last (the machine keeps /tmp only while warm):
    run(command="bash .wcK/stash.sh", carry=[".wcK"])                            # K = 1, 2, ... (set-up above)
    run(command="bash bench/hybrid_peers_device.sh 0.8b fp16")
    run(command="bash bench/hybrid_peers_device.sh 0.8b int4")
    run(command="bash bench/hybrid_peers_device.sh build-35b")                   # onnxgen's 35B-A3B int4 package
    run(command="bash bench/hybrid_peers_device.sh 35b")
  which run, with PYTHONPATH and /tmp/site-env.sh as above:
    python3 -m bench.peers_decode --shape qwen3.5-0.8b --precision fp16 --workdir /tmp/peers-qwen3.5-0.8b --engines \
        onnxgen,onnxgen-eager,ort-genai-graph,ort-genai,ort-genai-own-graph,ort-genai-own,onnxgen-on-genai,hf-eager
    (the same with --precision int4)
    python3 -m bench.peers_decode --shape qwen3.5-35b-a3b --precision int4 --engines onnxgen \
        --workdir /tmp/peers-qwen3.5-35b-a3b --memory-gb 120 --build-only
    python3 -m bench.peers_decode --shape qwen3.5-35b-a3b --precision int4 --workdir /tmp/peers-qwen3.5-35b-a3b \
        --memory-gb 120 --engines onnxgen,onnxgen-eager,ort-genai-graph,ort-genai
Smoke runs on a CPU (seconds):
    python -m bench.peers_decode --device cpu --tiny --engines onnxgen,onnxgen-eager,ort-genai,hf-eager
    python -m bench.peers_decode --device cpu --tiny tiny-qwen3.5 --precision fp32 --new-tokens 16 \
        --engines onnxgen,onnxgen-eager,ort-genai,ort-genai-own,onnxgen-on-genai,hf-eager
    python -m bench.peers_decode --device cpu --shape qwen3.5-35b-a3b --precision int4 --plan
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import reproduce_line
from bench.genai_peer import (
    Run,
    genai_config_variant,
    pin_intra_op_threads,
    run_genai,
    run_onnxgen,
    set_provider_option,
    timed_runs,
)
from onnxgen.models.config import DecoderConfig, weight_shapes
from onnxgen.models.hf_reference import transformers_config
from onnxgen.models.package_files import TOKENIZER_FILES
from onnxgen.models.pull import build_from_source, default_precision, is_complete_package
from onnxgen.models.random_source import MODEL_SHAPES, TINY_CONFIGS, RandomSource
from onnxgen.threads import usable_cores


def device_copy_bytes_per_s(size: int = 1 << 30, repeats: int = 10) -> float:
    """Device memory traffic per second (bytes read plus bytes written) of a device-to-device copy of
    ``size`` bytes on the current CUDA device, the fastest of ``repeats`` timed copies: the floor's
    bandwidth, measured on the card the run uses (H100 and H200 differ) rather than assumed. The
    fastest, not the median, because repeated medians on one H100 moved between calls: the floor
    is a lower bound on the step, so it takes the best rate the card showed."""
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * size / min(times)


ENGINES = (
    "onnxgen", "onnxgen-eager", "ort-genai-graph", "ort-genai", "ort-genai-own-graph", "ort-genai-own",
    "onnxgen-on-genai", "hf-eager", "hf-compile", "llama-cpp",
)  # fmt: skip
CUDA_ONLY = {"ort-genai-graph", "ort-genai-own-graph", "hf-compile"}
# the peers, for the headline ratio against each one's best form
PEER_FAMILIES = {"onnxruntime-genai": ("ort-genai-graph", "ort-genai", "ort-genai-own-graph", "ort-genai-own"),
                 "transformers": ("hf-eager", "hf-compile"), "llama.cpp": ("llama-cpp",)}  # fmt: skip


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- arguments --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-coder-0.5b-instruct", choices=sorted(MODEL_SHAPES))
    parser.add_argument(
        "--tiny", nargs="?", const="tiny-llama", choices=sorted(TINY_CONFIGS), help="a test-sized config instead"
    )
    parser.add_argument("--precision", choices=["fp16", "int4", "fp32"], help="default: fp16 on cuda, int4 on cpu")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--long-prompt-tokens", type=int, default=0,
        help="also time the TTFT of a prompt this long (onnxgen and onnxruntime-genai rows; 0: not)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--genai-threads", type=int,
        help="CPU: onnxruntime-genai's intra-op threads, written into its genai_config.json (default: torch's thread "
        "count, so both engines get the same cores; 0: onnxruntime's own default, one thread on a 2-vCPU machine)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup-s", type=float, default=2.0,
        help="each engine's warm-up generations go on until this many seconds have passed (at least three)",
    )  # fmt: skip
    parser.add_argument("--engines", help=f"comma list of {', '.join(ENGINES)} (default: every one that can run)")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompt ids")
    parser.add_argument(
        "--llamacpp", type=Path, help="a built llama.cpp tree (bench/llamacpp_peer.py): the llama-cpp row"
    )
    parser.add_argument(
        "--tokenizer-from", type=Path, help="a directory with a real tokenizer.json (for llama.cpp's converter)"
    )  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="keep (and reuse) the checkpoint and packages here")
    parser.add_argument(
        "--memory-gb", type=float,
        help="memory the machine can give, for the fit checks (default: MemAvailable; the GPU machines report "
        "less at first than they grow to, so pass their size there)",
    )  # fmt: skip
    parser.add_argument(
        "--plan", action="store_true", help="print what the run would write (estimated sizes) and run, then stop"
    )
    parser.add_argument(
        "--build-only", action="store_true",
        help="write the checkpoint and the packages (and GGUFs) the engines need into --workdir, then stop",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.precision = args.precision or default_precision(args.device)
    args.config = TINY_CONFIGS[args.tiny] if args.tiny else MODEL_SHAPES[args.shape]
    args.label = args.tiny or args.shape
    if args.new_tokens < 2 or args.prompt_tokens < 1 or args.repeats < 1 or args.long_prompt_tokens < 0:
        parser.error("need --new-tokens >= 2, --prompt-tokens >= 1, --repeats >= 1 and --long-prompt-tokens >= 0")
    if args.long_prompt_tokens + 2 > args.config.max_position_embeddings:
        parser.error(f"--long-prompt-tokens exceeds {args.config.max_position_embeddings - 2} (the context)")
    if args.prompt_tokens + args.new_tokens > args.config.max_position_embeddings:
        parser.error(f"prompt + new tokens exceed {args.label}'s context ({args.config.max_position_embeddings})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device (use --device cpu for a smoke run)")
    if args.genai_threads is not None and (args.device != "cpu" or args.genai_threads < 0):
        parser.error("--genai-threads is for --device cpu and takes a count >= 0")
    if args.device == "cpu" and args.genai_threads is None:
        args.genai_threads = torch.get_num_threads()
    if args.build_only and not args.workdir:
        parser.error("--build-only needs --workdir (where a later run finds what it built)")
    args.engines = choose_engines(parser, args)
    workdir = planned_workdir(args)
    writes = planned_writes(args, workdir)
    need, free = sum(size for _, size in writes), disk_free(workdir)
    if need * FIT_MARGIN > free and not args.plan:
        listed = "; ".join(f"{what} {size / GB:.1f} GB" for what, size in writes)
        parser.error(f"this run would write about {need / GB:.1f} GB ({listed}), but {free / GB:.1f} GB are free "
                     f"under {workdir}; choose fewer engines (--engines) or another --workdir")  # fmt: skip
    return args


def engine_blocker(engine: str, device: str, args: argparse.Namespace | None = None) -> str | None:
    """Why `engine` cannot run here, or None."""
    if engine in CUDA_ONLY and device != "cuda":
        return "CUDA only"
    if engine in CHECKPOINT_READERS and getattr(args, "config", None) is not None:
        if problem := checkpoint_problem(args, planned_workdir(args)):
            return f"it reads the Hugging Face checkpoint, which this run cannot write: {problem}"
    if engine == "llama-cpp":
        from bench.llamacpp_peer import tree_problem

        tree = getattr(args, "llamacpp", None)
        if tree is None or getattr(args, "tokenizer_from", None) is None:
            return "needs --llamacpp (a built llama.cpp tree) and --tokenizer-from (a real tokenizer.json)"
        return tree_problem(tree)
    if engine.startswith("ort-genai"):
        try:
            import onnxruntime_genai as og
        except ImportError as exc:
            return f"onnxruntime_genai does not import ({exc}); see the set-up in this script's docstring"
        if device == "cuda" and not og.is_cuda_available():
            return "this onnxruntime-genai has no CUDA (the onnxruntime-genai-cuda wheel: see the docstring)"
    if engine == "onnxgen-on-genai" or engine.startswith("ort-genai-own"):
        import importlib.util

        try:
            found = importlib.util.find_spec("onnxruntime_genai.models.builder") is not None
        except ImportError:
            found = False
        if not found:
            return "onnxruntime-genai's builder (onnxruntime_genai.models.builder) is not importable"
    if engine.startswith("hf"):
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            return f"transformers does not import ({exc})"
    return None


def choose_engines(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    if args.engines:
        wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
        unknown = [e for e in wanted if e not in ENGINES]
        if unknown:
            parser.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
        for engine in wanted:
            blocker = engine_blocker(engine, args.device, args)
            if blocker:
                parser.error(f"engine {engine} cannot run here: {blocker}")
        return wanted
    chosen = []
    for engine in ENGINES:
        blocker = engine_blocker(engine, args.device, args)
        if blocker:
            say(f"skipping {engine}: {blocker}")
        else:
            chosen.append(engine)
    return chosen


# --- the Hugging Face checkpoint -------------------------------------------------------------


def hf_config_for(config: DecoderConfig) -> Any:
    """A transformers config of the same architecture, chosen from the layout facts alone."""
    try:
        return hybrid_text_config(config) if config.layer_types else transformers_config(config)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


# the layout transformers' Qwen3.5 text classes hold (anything else would be a different model)
_QWEN35_LAYOUT = dict(attn_output_gate=True, qk_norm=True, norm_offset=1.0, attention_bias=False,
                      rope_interleaved=False, hidden_act="silu")  # fmt: skip


def mrope_section(config: DecoderConfig) -> list[int]:
    """The rotary pairs per position stream (temporal, height, width) in the published 11:11:10
    split. Text-only prompts give the three streams equal positions, so the split does not change
    the outputs; onnxruntime-genai's builder and llama.cpp's converter read it."""
    half = int(config.head_dim * config.partial_rotary_factor) // 2
    first = round(half * 11 / 32)
    return [first, first, half - 2 * first]


def hybrid_text_config(config: DecoderConfig) -> Any:
    """transformers' Qwen3_5TextConfig (dense MLPs) or Qwen3_5MoeTextConfig (every MLP a mixture
    of experts) for a hybrid of that layout; ValueError for one that these classes cannot hold."""
    import transformers

    la, moe = config.linear_attention, config.moe
    differ = [f"{key}={getattr(config, key)!r}" for key, want in _QWEN35_LAYOUT.items() if getattr(config, key) != want]
    if la is None or differ or (moe is not None and not moe.normalize):
        raise ValueError(
            f"{config.name or config.architecture}: transformers' Qwen3.5 classes hold hybrids with "
            f"{_QWEN35_LAYOUT} and renormalized top-k routing only; this one has {differ or 'other routing'}"
        )
    name = "Qwen3_5MoeTextConfig" if moe is not None else "Qwen3_5TextConfig"
    if not hasattr(transformers, name):
        raise ValueError(f"transformers {transformers.__version__} has no {name}")
    eos = config.eos_token_id
    facts = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, hidden_act=config.hidden_act, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=False, bos_token_id=config.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else list(eos),
        pad_token_id=config.pad_token_id, layer_types=list(config.layer_types),
        linear_num_key_heads=la.num_key_heads, linear_num_value_heads=la.num_value_heads,
        linear_key_head_dim=la.key_head_dim, linear_value_head_dim=la.value_head_dim,
        linear_conv_kernel_dim=la.conv_kernel,
        # the dense class reads it; the MoE class keeps it as an extra key, for loaders that require it
        intermediate_size=config.intermediate_size,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta,
                         "partial_rotary_factor": config.partial_rotary_factor,
                         "mrope_section": mrope_section(config), "mrope_interleaved": True},
    )  # fmt: skip
    if moe is not None:
        facts |= dict(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                       moe_intermediate_size=moe.expert_intermediate,
                       shared_expert_intermediate_size=moe.shared_intermediate)  # fmt: skip
    return getattr(transformers, name)(**facts)


def stored_weight_shapes(model: Any, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """The shapes of `model`'s weights under the names save_pretrained writes, decoder names
    (model.*, lm_head.*) from the decoder under `prefix`. transformers holds a layer's routed
    experts fused (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) and writes one
    tensor per expert and projection, the names weight_shapes uses."""
    shapes = {}
    for name, tensor in model.state_dict().items():
        if not name.startswith((prefix, "lm_head.")):
            continue
        name = "model." + name[len(prefix) :] if name.startswith(prefix) else name
        shape = tuple(tensor.shape)
        layer, fused, kind = name.partition(".mlp.experts.")
        if not fused or kind not in ("gate_up_proj", "down_proj"):
            shapes[name] = shape
            continue
        experts, rows, cols = shape
        for e in range(experts):
            if kind == "down_proj":
                shapes[f"{layer}.mlp.experts.{e}.down_proj.weight"] = (rows, cols)
            else:
                shapes[f"{layer}.mlp.experts.{e}.gate_proj.weight"] = (rows // 2, cols)
                shapes[f"{layer}.mlp.experts.{e}.up_proj.weight"] = (rows // 2, cols)
    return shapes


def check_hf_layout(hf_config: Any, config: DecoderConfig, model_class: Any = None, prefix: str = "model.") -> None:
    """The transformers model of `hf_config` (built on the meta device: no memory) must hold exactly
    the weights of `config` (its decoder under `prefix`), in the same shapes, tied the same way;
    otherwise the chosen class does not express this shape and the comparison would be of two
    different models."""
    import transformers

    with torch.device("meta"):
        model = model_class(hf_config) if model_class else transformers.AutoModelForCausalLM.from_config(hf_config)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    theirs = stored_weight_shapes(model, prefix)
    if tied:
        theirs.pop("lm_head.weight", None)  # the embedding table itself
    ours = weight_shapes(config)
    problems = [
        f"{name}: {theirs.get(name)} in transformers, {ours.get(name)} here"
        for name in sorted(set(theirs) | set(ours))
        if theirs.get(name) != ours.get(name)
    ]
    if tied != config.tie_word_embeddings:
        problems.insert(0, f"embeddings tied: {tied} in transformers, {config.tie_word_embeddings} here")
    if problems:
        raise SystemExit(f"{type(model).__name__} does not match {config.name or config.architecture}: {problems[:5]}")


def write_tokenizer(config: DecoderConfig, directory: Path) -> None:
    """A word-level vocabulary "<tN>" of the model's size: the benches feed token ids, but a package
    (and onnxgen's Generator) wants tokenizer files, and transformers wants special-token names."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"<t{i}>": i for i in range(config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))
    specials = {"bos_token": config.bos_token_id, "pad_token": config.pad_token_id}
    specials["eos_token"] = config.eos_token_id[0] if config.eos_token_id else None
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<t0>"}
    tokenizer_config |= {key: f"<t{i}>" for key, i in specials.items() if i is not None}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def write_checkpoint(config: DecoderConfig, directory: Path, dtype: torch.dtype, seed: int) -> None:
    """config.json (save_pretrained), model.safetensors with RandomSource's seeded weights (the same
    initialization the other random-weight benches use), tokenizer files."""
    import transformers
    from safetensors.torch import save_file

    hf_config = hf_config_for(config)
    check_hf_layout(hf_config, config)
    # the model class a loader picks (onnxruntime-genai's builder reads it from config.json)
    hf_config.architectures = [transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)].__name__]
    directory.mkdir(parents=True)
    hf_config.save_pretrained(directory)
    source = RandomSource(config, seed)
    # names as transformers writes them; a tied lm_head is absent, which is how loaders see the tie
    tensors = {name: torch.from_numpy(source.get(name)).to(dtype) for name in source.names()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(config, directory)


# A vision tower as small as transformers' Qwen3.5 vision classes allow: the wrapper form needs one,
# and its weights are never read for text. Its widths (32, 64, 3 x 32) must differ from the vocabulary.
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, spatial_merge_size=1,
                   temporal_patch_size=1)  # fmt: skip


def write_wrapper_checkpoint(config: DecoderConfig, text_dir: Path, directory: Path, seed: int) -> None:
    """The multimodal wrapper form of the hybrid checkpoint in `text_dir` (onnxruntime-genai 0.18's
    builder takes Qwen3.5 only as Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration
    and exports its text part): the same tensors under model.language_model.* (lm_head.* stays),
    a tiny random vision tower under model.visual.*, the text config nested."""
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    moe = config.moe is not None
    names = ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration") if moe else (
        "Qwen3_5Config", "Qwen3_5ForConditionalGeneration")  # fmt: skip
    if not all(hasattr(transformers, name) for name in names):
        raise SystemExit(f"transformers {transformers.__version__} has no {' / '.join(names)}")
    config_class, model_class = (getattr(transformers, name) for name in names)
    vision = TINY_VISION | {"out_hidden_size": config.hidden_size}
    text = hf_config_for(config).to_dict()
    wrapper = config_class(text_config=text, vision_config=vision, tie_word_embeddings=config.tie_word_embeddings)
    wrapper.architectures = [model_class.__name__]
    # the builder reads the top-level ids where the wrapper sets them
    wrapper.eos_token_id, wrapper.pad_token_id = text["eos_token_id"], text["pad_token_id"]
    check_hf_layout(wrapper, config, model_class, prefix="model.language_model.")
    with torch.device("meta"):
        meta = model_class(wrapper)
    lm_head = meta.get_output_embeddings()
    clash = [
        name
        for name, m in meta.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not lm_head and m.out_features == config.vocab_size
    ]
    if clash:
        raise SystemExit(f"{clash[0]} is as wide as the vocabulary ({config.vocab_size}); onnxruntime-genai's "
                         "builder would take it for the LM head")  # fmt: skip
    torch.manual_seed(seed)
    visual = type(meta.model.visual)(wrapper.vision_config)
    directory.mkdir(parents=True)
    wrapper.save_pretrained(directory)
    tensors = {}
    with safe_open(str(text_dir / "model.safetensors"), "pt") as stored:
        dtype = stored.get_tensor(next(iter(stored.keys()))).dtype
        for name in stored.keys():
            tensors["model.language_model." + name[len("model.") :] if name.startswith("model.") else name] = (
                stored.get_tensor(name))  # fmt: skip
    tensors |= {"model.visual." + name: t.to(dtype) for name, t in visual.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(text_dir / name, directory / name)


def check_roundtrip(directory: Path, config: DecoderConfig) -> None:
    """What onnxgen reads back from the checkpoint must be the shape it was written from."""
    from onnxgen.models.hf_source import HFSource

    back = HFSource(directory).config
    skip = {"architecture", "name", "eos_token_id", "bos_token_id", "pad_token_id"}
    differ = [
        f"{f.name}: wrote {getattr(config, f.name)!r}, read {getattr(back, f.name)!r}"
        for f in fields(DecoderConfig)
        if f.name not in skip and getattr(config, f.name) != getattr(back, f.name)
    ]
    if differ:
        raise SystemExit(f"the checkpoint in {directory} does not read back as written: {differ}")


def checkpoint_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.float16


def checkpoint_dir(args: argparse.Namespace, workdir: Path) -> Path:
    dtype = checkpoint_dtype(args.precision)
    return workdir / f"hf-{args.label}-{str(dtype).removeprefix('torch.')}-seed{args.seed}"


def ensure_checkpoint(args: argparse.Namespace, workdir: Path) -> Path:
    directory = checkpoint_dir(args, workdir)
    if (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file():
        say(f"checkpoint: reusing {directory}")
        return directory
    if problem := checkpoint_problem(args, workdir):
        raise SystemExit(f"checkpoint: {problem}")
    dtype = checkpoint_dtype(args.precision)
    say(f"checkpoint: writing {args.label} random weights ({dtype}) to {directory}")
    start = time.perf_counter()
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_checkpoint(args.config, partial, dtype, args.seed)
    check_roundtrip(partial, args.config)
    os.replace(partial, directory)  # complete or absent: a later --workdir run never reuses half a checkpoint
    say(f"checkpoint: written in {time.perf_counter() - start:.1f} s")
    return directory


def ensure_wrapper_checkpoint(args: argparse.Namespace, hf_dir: Path, workdir: Path) -> Path:
    directory = workdir / f"{hf_dir.name}-wrapper"
    if (directory / "model.safetensors").is_file():
        return directory
    say(f"checkpoint: the multimodal wrapper form (for onnxruntime-genai's builder) into {directory}")
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_wrapper_checkpoint(args.config, hf_dir, partial, args.seed)
    check_roundtrip(partial, args.config)
    os.replace(partial, directory)
    return directory


def package_dir(args: argparse.Namespace, workdir: Path) -> Path:
    return workdir / f"pkg-{args.label}-{args.precision}-{args.device}-gqa-seed{args.seed}"


def ensure_package(args: argparse.Namespace, hf_dir: Path | None, workdir: Path) -> Path:
    """onnxgen's package of the checkpoint in `hf_dir`; with none (it would not fit: see
    checkpoint_problem), of the same RandomSource weights, straight from the source."""
    package = package_dir(args, workdir)
    if is_complete_package(package):
        say(f"package: reusing {package}")
        return package
    shutil.rmtree(package, ignore_errors=True)
    start = time.perf_counter()
    if hf_dir is not None:
        say(f"package: building {args.precision}/{args.device}/gqa into {package}")
        build_from_source(hf_dir, package, precision=args.precision, device=args.device, attention="gqa")
    else:
        build_from_random_source(args, package)
    say(f"package: built in {time.perf_counter() - start:.1f} s")
    check_providers(package, args.device)
    return package


def build_workers() -> int:
    """Worker processes for a build from RandomSource: one per core this process may use, but one,
    left to the builder itself (it draws a float embedding table and writes the whole package)."""
    return max(1, usable_cores() - 1)


def build_from_random_source(args: argparse.Namespace, package: Path) -> None:
    """onnxgen's builder on RandomSource itself (float32 values, not a checkpoint's fp16-rounded
    ones) with build_workers() worker processes (build_pool: a serial build's bytes), into a
    .partial directory published whole; progress on stderr every twentieth of the tensors."""
    from onnxgen.models.builder import build_package

    partial = package.with_name(package.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    say(f"package: building {args.precision}/{args.device}/gqa from RandomSource (no checkpoint) into {package}")
    start = time.perf_counter()
    shown = [0]

    def progress(name: str, done: int, total: int) -> None:
        if done * 20 >= (shown[0] + 1) * total:
            shown[0] = done * 20 // total
            say(f"package: {done}/{total} tensors ({name}) after {time.perf_counter() - start:.0f} s")

    workers = build_workers()
    say(f"package: weights drawn and quantized ahead of the writer by {workers} worker process(es)")
    build_package(RandomSource(args.config, args.seed), partial, precision=args.precision, device=args.device,
                  attention="gqa", progress=progress, workers=workers)  # fmt: skip
    write_tokenizer(args.config, partial)
    os.replace(partial, package)


def check_providers(package: Path, device: str) -> None:
    """onnxruntime-genai runs the decoder on the providers genai_config.json names: on CUDA it must name cuda."""
    config = json.loads((package / "genai_config.json").read_text())
    named = [name for entry in config["model"]["decoder"]["session_options"]["provider_options"] for name in entry]
    if (device == "cuda") != ("cuda" in named):
        raise SystemExit(f"{package}/genai_config.json names providers {named} for device {device}")


# --- what a run writes, and whether it fits ---------------------------------------------------

# engines that read the Hugging Face checkpoint (directly, or through a package or GGUF made from it)
CHECKPOINT_READERS = frozenset(
    {"ort-genai-own-graph", "ort-genai-own", "onnxgen-on-genai", "hf-eager", "hf-compile", "llama-cpp"}
)
OWN_BUILDER = frozenset({"ort-genai-own-graph", "ort-genai-own", "onnxgen-on-genai"})
# estimates are within a few percent; the file system and the page cache need room beside them
FIT_MARGIN = 1.1
GB = 1e9


def parameter_count(config: DecoderConfig) -> int:
    return sum(math.prod(shape) for shape in weight_shapes(config).values())


def checkpoint_bytes(config: DecoderConfig, precision: str) -> int:
    return parameter_count(config) * checkpoint_dtype(precision).itemsize


def package_bytes(config: DecoderConfig, precision: str, device: str) -> int:
    """About what a package of `config` takes on disk. int4: per matrix element half a byte of
    code, and per block of 32 a scale in the activations' dtype and half a byte of zero point; the
    embedding table stays in the activations' dtype (tied: beside a quantized head). fp16 / fp32:
    every weight in that dtype."""
    io = 4 if precision == "fp32" or (precision == "int4" and device == "cpu") else 2
    per_int4 = 0.5 + (io + 0.5) / 32
    total = 0.0
    for name, shape in weight_shapes(config).items():
        matrix = len(shape) == 2 or (len(shape) == 3 and shape[1] != 1)  # not a depthwise conv kernel
        quantized = precision == "int4" and matrix and name != "model.embed_tokens.weight"
        total += math.prod(shape) * (per_int4 if quantized else io)
    if precision == "int4" and config.tie_word_embeddings:
        total += config.vocab_size * config.hidden_size * per_int4
    return int(total)


def gguf_bytes(config: DecoderConfig, precision: str) -> int:
    """llama.cpp's F16 GGUF, and for int4 the Q4_0 one beside it (18 bytes per block of 32)."""
    count = parameter_count(config)
    return count * 2 + (count * 18 // 32 if precision == "int4" else 0)


def disk_free(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def memory_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def planned_workdir(args: argparse.Namespace) -> Path:
    return args.workdir or Path(tempfile.gettempdir())


def checkpoint_problem(args: argparse.Namespace, workdir: Path) -> str | None:
    """Why the Hugging Face checkpoint cannot be written here (None: it can, or it is there). Its
    writer holds every tensor in memory at once (safetensors' save_file) and onnxgen's package is
    built beside it, so both the disk and the memory must hold it."""
    config, precision = args.config, args.precision
    directory = checkpoint_dir(args, workdir)
    if (directory / "model.safetensors").is_file():
        return None
    try:
        (hybrid_text_config if config.layer_types else transformers_config)(config)
    except (ImportError, ValueError) as exc:  # e.g. a transformers without the Qwen3.5 classes
        return f"no transformers class to write it with ({exc})"
    dtype = str(checkpoint_dtype(precision)).removeprefix("torch.")
    need = checkpoint_bytes(config, precision)
    package = 0 if is_complete_package(package_dir(args, workdir)) else package_bytes(config, precision, args.device)
    free = disk_free(workdir)
    if (need + package) * FIT_MARGIN > free:
        return (f"the {dtype} checkpoint of {args.label} would take {need / GB:.1f} GB on disk beside onnxgen's "
                f"package ({package / GB:.1f} GB); {free / GB:.1f} GB are free under {workdir}")  # fmt: skip
    largest = max(math.prod(shape) for shape in weight_shapes(config).values()) * 4  # one float32 tensor drawn
    given = getattr(args, "memory_gb", None)
    memory = int(given * GB) if given else memory_available()
    if memory is not None and (need + largest) * FIT_MARGIN > memory:
        return (f"writing the {dtype} checkpoint of {args.label} holds all of it in memory ({need / GB:.1f} GB); "
                f"{memory / GB:.1f} GB are available")  # fmt: skip
    return None


def planned_writes(args: argparse.Namespace, workdir: Path) -> list[tuple[str, int]]:
    """(what, estimated bytes) for everything this run would still write to disk, given its engines."""
    config, precision = args.config, args.precision
    writes = []
    with_checkpoint = checkpoint_problem(args, workdir) is None
    if with_checkpoint and not (checkpoint_dir(args, workdir) / "model.safetensors").is_file():
        writes.append(("the Hugging Face checkpoint", checkpoint_bytes(config, precision)))
    if not is_complete_package(package_dir(args, workdir)):
        how = "" if with_checkpoint else " (from RandomSource: no checkpoint)"
        writes.append((f"onnxgen's package{how}", package_bytes(config, precision, args.device)))
    engines = set(args.engines)
    if with_checkpoint and engines & OWN_BUILDER:
        if config.layer_types:
            writes.append(("the checkpoint's multimodal wrapper form", checkpoint_bytes(config, precision)))
        writes.append(("onnxruntime-genai's own package", package_bytes(config, precision, args.device)))
    if with_checkpoint and "llama-cpp" in engines:
        writes.append(("llama.cpp's GGUF(s)", gguf_bytes(config, precision)))
    return writes


def plan_lines(args: argparse.Namespace) -> list[str]:
    """What the run would write and run, before anything is written (--plan)."""
    workdir = planned_workdir(args)
    writes = planned_writes(args, workdir)
    memory = int(args.memory_gb * GB) if args.memory_gb else memory_available()
    lines = [f"plan for {args.label} {args.precision} on {args.device}: {parameter_count(args.config) / 1e9:.2f} B "
             f"parameters; workdir {workdir} ({disk_free(workdir) / GB:.1f} GB free"
             + (f", {memory / GB:.1f} GB memory available)" if memory is not None else ")")]  # fmt: skip
    if problem := checkpoint_problem(args, workdir):
        lines.append(f"  no checkpoint: {problem}")
    lines += [f"  writes {what}: about {size / GB:.2f} GB" for what, size in writes]
    lines.append(f"  engines: {', '.join(args.engines) or 'none'}")
    return lines


# --- the weight bytes a decode step reads -------------------------------------------------------


def weight_bytes(package: Path) -> tuple[int, int]:
    """(bytes of every initializer as stored, the bytes one decode step of one sequence reads):
    tables that only a Gather reads (the embedding lookup, one row per token) are left out, and a
    mixture of experts' per-expert tensors (first dimension = the experts) count k / experts of
    their size, the k experts one token is routed to."""
    import onnx

    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    consumers: dict[str, set[str]] = defaultdict(set)
    routed: dict[str, int] = {}  # an expert tensor's name -> the k of the node that reads it
    for node in model.graph.node:
        for name in node.input:
            consumers[name].add(node.op_type)
        if node.op_type in ("MoE", "QMoE"):
            k = next((a.i for a in node.attribute if a.name == "k"), 1)
            routed.update({name: k for name in node.input[2:] if name})
    stored = read = 0.0
    for tensor in model.graph.initializer:
        size = _stored_size(tensor)
        stored += size
        if not consumers[tensor.name] or consumers[tensor.name] <= {"Gather", "GatherBlockQuantized"}:
            continue
        experts = tensor.dims[0] if tensor.name in routed and len(tensor.dims) >= 2 else 0
        read += size * min(1.0, routed[tensor.name] / experts) if experts else size
    return int(stored), int(read)


def _stored_size(tensor: Any) -> int:
    import onnx

    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return int({entry.key: entry.value for entry in tensor.external_data}["length"])
    if tensor.raw_data:
        return len(tensor.raw_data)
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


# --- engines ----------------------------------------------------------------------------------


@dataclass
class Bench:
    args: argparse.Namespace
    workdir: Path
    hf_dir: Path | None  # None where the checkpoint would not fit (checkpoint_problem)
    package: Path
    ids: list[int]
    long_ids: list[int] = field(default_factory=list)  # --long-prompt-tokens ids (empty: not timed)
    free_before: int = 0  # free device bytes before the current engine loaded (run_engine)


@dataclass
class EngineResult:
    name: str
    note: str = ""
    runs: list[Run] = field(default_factory=list)
    error: str = ""
    long_ttft_ms: float | None = None  # TTFT of the long prompt (long_prompt_ttft)
    memory_mb: float | None = None  # device memory the engine holds after its runs (device_memory_mb)
    # an engine timed by its own tool (llama-bench): its rates and TTFTs, no Runs and no token ids
    rates: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.runs or self.rates)

    @property
    def decode_tok_s(self) -> float:
        if self.rates:
            return statistics.median(self.rates)
        return statistics.median(r.decode_tok_s for r in self.runs)

    @property
    def ms_per_token(self) -> float:
        return 1000.0 / self.decode_tok_s if self.decode_tok_s else float("nan")

    @property
    def ttft_ms(self) -> float:
        return 1000.0 * statistics.median(self.ttfts_s or [r.ttft_s for r in self.runs])

    @property
    def tokens(self) -> list[int]:
        return self.runs[0].tokens if self.runs else []


def long_prompt_ttft(bench: Bench, generate: Callable[[list[int], int], Run]) -> float | None:
    """The median TTFT of the long prompt (--long-prompt-tokens) over --repeats timed 2-token
    generations after the usual warm-up (the long prompt's own buffers and recordings are made
    there), or None when not asked for."""
    if not bench.long_ids:
        return None
    runs = timed_runs(lambda: generate(bench.long_ids, 2), bench.args.repeats)
    return 1000.0 * statistics.median(r.ttft_s for r in runs)


def device_memory_mb(bench: Bench) -> float | None:
    """Device memory taken since the engine started loading (free bytes then minus free bytes now,
    the same measure for every engine in this process: weights, caches, workspaces, recorded graphs
    and the allocators' pools), in MB; None on the CPU."""
    if bench.args.device != "cuda":
        return None
    torch.cuda.synchronize()
    return (bench.free_before - torch.cuda.mem_get_info()[0]) / 1e6


def say_memory_anatomy(engine: str, memory_mb: float) -> None:
    """Where a torch-based engine's device memory is (stderr): tensors alive, torch's pools around
    them (cached free blocks, recording pools), and what the free-memory measure saw beyond torch
    (CUDA-graph executables, loaded kernels, library workspaces outside torch's allocator)."""
    allocated = torch.cuda.memory_allocated() / 1e6
    reserved = torch.cuda.memory_reserved() / 1e6
    say(
        f"{engine} device memory: {memory_mb:.0f} MB taken = {allocated:.0f} MB in live tensors + "
        f"{reserved - allocated:.0f} MB cached in torch's pools + {memory_mb - reserved:.0f} MB outside torch "
        "(reserved before the engine loaded counts against the last term)"
    )
    for line in pool_lines(torch.cuda.memory_snapshot()):
        say(f"{engine} device memory: {line}")


def pool_lines(segments: list[dict[str, Any]], largest: int = 4) -> list[str]:
    """torch's reserved memory by pool (the default caching pool, each CUDA-graph recording's
    private pool): MB reserved, MB in live blocks, segments, and the largest segments' MB."""
    pools: dict[Any, list[dict[str, Any]]] = {}
    for segment in segments:
        pools.setdefault(tuple(segment.get("segment_pool_id") or (0, 0)), []).append(segment)
    lines = []
    for pool, members in sorted(pools.items(), key=lambda item: -sum(s["total_size"] for s in item[1])):
        reserved = sum(s["total_size"] for s in members) / 1e6
        live = sum(s["allocated_size"] for s in members) / 1e6
        sizes = sorted((s["total_size"] / 1e6 for s in members), reverse=True)[:largest]
        name = "default pool" if pool == (0, 0) else f"recording pool {pool}"
        lines.append(f"{name}: {reserved:.1f} MB reserved, {live:.1f} MB live, {len(members)} segment(s), "
                     f"largest {', '.join(f'{size:.1f}' for size in sizes)} MB")  # fmt: skip
    return lines


def checkpoint_of(bench: Bench) -> Path:
    """The checkpoint an engine reads (engine_blocker refuses those engines where none is written)."""
    if bench.hf_dir is None:
        raise RuntimeError("no Hugging Face checkpoint was written in this run (see checkpoint_problem)")
    return bench.hf_dir


def ensure_genai_package(bench: Bench) -> Path:
    """The package onnxruntime-genai's own builder makes from the bench's checkpoint (kept in the workdir)."""
    from bench.genai_built import build_with_genai

    args = bench.args
    package = bench.workdir / f"genai-own-{args.label}-{args.precision}-{args.device}-seed{args.seed}"
    if is_complete_package(package):
        return package
    hf_dir = checkpoint_of(bench)
    # the builder takes hybrids of this layout only in their multimodal wrapper form (its text part exported)
    source = ensure_wrapper_checkpoint(args, hf_dir, bench.workdir) if args.config.layer_types else hf_dir
    shutil.rmtree(package, ignore_errors=True)
    say(f"package: onnxruntime-genai's builder, {args.precision}/{args.device}, on {source.name} into {package}")
    build_with_genai(source, package, args.precision, args.device, args.config.vocab_size)
    return package


def run_onnxgen_engine(bench: Bench, eager: bool, genai_package: bool = False) -> EngineResult:
    from onnxgen.genai import Generator

    args = bench.args
    # the CPU has no CUDA graphs: there both onnxgen rows run eagerly
    capture = "off" if eager or args.device == "cpu" else "on"
    package = ensure_genai_package(bench) if genai_package else bench.package
    generator = Generator(package, device=args.device, capture=capture)
    runs = timed_runs(lambda: run_onnxgen(generator, bench.ids, args.new_tokens), args.repeats, args.warmup_s)
    memory = device_memory_mb(bench)  # before the long prompt: its longer cache is not the decode run's
    if memory is not None:
        say_memory_anatomy("onnxgen", memory)
    long_ttft = long_prompt_ttft(bench, lambda ids, n: run_onnxgen(generator, ids, n))
    note = ("onnxruntime-genai's package, " if genai_package else "") + f"capture {capture}, {generator.kv_kind} KV"
    if capture == "on":
        stats = generator.capture_stats
        say(f"onnxgen {stats.summary()}")
        note += f", {stats.segments_per_step} segment(s) + {stats.seams_per_step} seam(s)/step"
    elif args.device == "cpu":
        note += " (CPU: no CUDA graphs)"
    return EngineResult("", note, runs, long_ttft_ms=long_ttft, memory_mb=memory)


def run_genai_engine(bench: Bench, graph: bool, own: bool = False) -> EngineResult:
    import onnxruntime_genai as og

    args = bench.args
    base = ensure_genai_package(bench) if own else bench.package
    whose = "its own builder's package" if own else "onnxgen's package"
    missing = unnamed_states(base)
    edits: list[Callable[[dict[str, Any]], None]] = []
    if missing:
        # a package built before onnxgen's builder named the linear-attention states in
        # genai_config.json: without their names onnxruntime-genai feeds none of them and the first
        # CausalConvWithState fails
        edits.append(lambda config: [config["model"]["decoder"][part].update(names) for part, names in missing.items()])
        whose += " + its state names added to genai_config.json"
    package, note = base, f"{whose}, CPU provider"
    if args.device == "cpu" and args.genai_threads:
        threads = args.genai_threads
        edits.append(lambda config: pin_intra_op_threads(config, threads))
        note += f", {threads} intra-op threads"
    elif args.device == "cpu":
        note += ", onnxruntime's default intra-op threads"
    if args.device == "cuda":
        value = "1" if graph else "0"
        edits.append(lambda config: set_provider_option(config, "cuda", "enable_cuda_graph", value))
        note = f"{whose}, cuda provider, enable_cuda_graph={value}"
    if edits:
        # a sibling package sharing the weights (hard links) whose genai_config.json differs
        variant = bench.workdir / f"{base.name}-genai-variant-{'graph' if graph else 'plain'}"
        shutil.rmtree(variant, ignore_errors=True)
        genai_config_variant(base, variant, lambda config: [edit(config) for edit in edits])
        package = variant
    model = og.Model(str(package))
    runs = timed_runs(lambda: run_genai(model, bench.ids, args.new_tokens), args.repeats, args.warmup_s)
    memory = device_memory_mb(bench)
    long_ttft = long_prompt_ttft(bench, lambda ids, n: run_genai(model, ids, n))
    return EngineResult("", note, runs, long_ttft_ms=long_ttft, memory_mb=memory)


# genai_config.json keys of onnxruntime-genai's hybrid packages, by the graph names they pattern
STATE_KEYS = {
    "inputs": {"past.%d.conv": "past_conv_names", "past.%d.recurrent": "past_recurrent_names"},
    "outputs": {"present.%d.conv": "present_conv_names", "present.%d.recurrent": "present_recurrent_names"},
}


def unnamed_states(package: Path) -> dict[str, dict[str, str]]:
    """The genai_config.json keys naming the package's recurrent-state inputs and outputs
    (past.N.conv, present.N.recurrent, ...) that its genai_config.json lacks, by section."""
    import re

    import onnx

    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    decoder = json.loads((package / "genai_config.json").read_text())["model"]["decoder"]
    graph = {"inputs": {v.name for v in model.graph.input}, "outputs": {v.name for v in model.graph.output}}
    missing: dict[str, dict[str, str]] = {}
    for part, keys in STATE_KEYS.items():
        for pattern, key in keys.items():
            regex = re.escape(pattern).replace("%d", r"\d+")
            if key not in decoder.get(part, {}) and any(re.fullmatch(regex, name) for name in graph[part]):
                missing.setdefault(part, {})[key] = pattern
    return missing


class HFRunner:
    """transformers' generate on one prompt; compiled=True: one static cache for every call and a
    compiled single-token step (see the module docstring)."""

    def __init__(self, bench: Bench, compiled: bool) -> None:
        import transformers

        args = bench.args
        self.device = torch.device(args.device)
        self.dtype = torch.float16 if args.device == "cuda" and args.precision != "fp32" else torch.float32
        # loaded as stored, then cast: the same call whatever transformers calls its dtype argument
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_of(bench))
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.ids = torch.tensor([bench.ids], dtype=torch.int64, device=self.device)
        config = args.config
        self.base = dict(do_sample=False, num_beams=1, pad_token_id=config.pad_token_id)
        self.base["eos_token_id"] = list(config.eos_token_id)
        self.cache: Any = None
        self.cache_arg = ""
        attention = getattr(self.model.config, "_attn_implementation", None) or "default"
        self.how = f"{self.dtype}".removeprefix("torch.") + f" weights, {attention} attention"
        if config.layer_types:
            self.how += ", " + linear_attention_kernels()
        if compiled:
            self._prepare_compile(len(bench.ids) + args.new_tokens)

    def _prepare_compile(self, length: int) -> None:
        import transformers

        self.cache = static_cache(self.model, length)
        forward = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in forward else "past_key_values"
        if hasattr(transformers, "CompileConfig"):
            # generate() compiles the single-token step itself for a static cache and keeps prefill eager
            self.base["compile_config"] = transformers.CompileConfig(mode="reduce-overhead", fullgraph=True)
            self.how += ", static cache, generate's torch.compile(reduce-overhead) of the decode step"
        else:
            self.model.forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)
            self.how += ", static cache, torch.compile(model.forward, reduce-overhead)"

    def generate(self, n: int) -> tuple[float, list[int]]:
        import transformers

        config = transformers.GenerationConfig(max_new_tokens=n, min_new_tokens=n, **self.base)
        extra = {}
        if self.cache is not None:
            self.cache.reset()  # the same tensors every call: recorded graphs keep their addresses
            extra[self.cache_arg] = self.cache
        mask = torch.ones_like(self.ids)
        self._sync()
        start = time.perf_counter()
        out = self.model.generate(input_ids=self.ids, attention_mask=mask, generation_config=config, **extra)
        tokens = out[0, self.ids.shape[1] :].tolist()
        self._sync()
        return time.perf_counter() - start, tokens

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, new_tokens: int) -> Run:
        ttft, _ = self.generate(1)
        total, tokens = self.generate(new_tokens)
        return Run(ttft, total - ttft, tokens)


def linear_attention_kernels() -> str:
    """Which Gated DeltaNet kernels transformers can use here: it falls back to its reference
    PyTorch code (much slower) where flash-linear-attention and causal-conv1d are missing."""
    import importlib.util

    found = [name for name, module in (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))
             if importlib.util.find_spec(module) is not None]  # fmt: skip
    if found:
        return f"Gated DeltaNet with {' and '.join(found)} installed"
    return "Gated DeltaNet on transformers' reference PyTorch path (flash-linear-attention, causal-conv1d absent)"


def static_cache(model: Any, length: int) -> Any:
    """A StaticCache for batch 1 and `length` positions; the constructor's arguments changed across
    transformers versions, so only those it accepts are passed."""
    from transformers import StaticCache

    offered = dict(config=model.config, max_cache_len=length, max_batch_size=1, batch_size=1)
    offered |= dict(device=model.device, dtype=model.dtype)
    accepted = inspect.signature(StaticCache.__init__).parameters
    return StaticCache(**{key: value for key, value in offered.items() if key in accepted})


def run_hf_engine(bench: Bench, compiled: bool) -> EngineResult:
    runner = HFRunner(bench, compiled)
    runs = timed_runs(lambda: runner.run(bench.args.new_tokens), bench.args.repeats, bench.args.warmup_s)
    memory = device_memory_mb(bench)
    note = runner.how
    if compiled and "compile_config" in runner.base and not hasattr(runner.model, "_compiled_call"):
        note += " (generate did not compile: eager steps)"
    if bench.args.precision == "int4":
        note += f"; int4 row: HF runs the unquantized weights in {runner.dtype}".replace("torch.", "")
    return EngineResult("", note, runs, memory_mb=memory)


def converter_flags(config: DecoderConfig) -> list[str]:
    """llama.cpp's converter for the Qwen3.5 layout (llama-cpp-python 0.3.36's tree) expects the
    multi-token-prediction head that published checkpoints carry (mtp.*) and stops without it;
    the bench's random checkpoints have none, so hybrids are converted with --no-mtp."""
    return ["--no-mtp"] if config.layer_types else []


def run_llamacpp_engine(bench: Bench) -> EngineResult:
    from bench.llamacpp_peer import ensure_gguf, median_ms, run_llama_bench

    args = bench.args
    flags = converter_flags(args.config)
    gguf = ensure_gguf(args.llamacpp, checkpoint_of(bench), args.tokenizer_from, bench.workdir, args.precision, flags)
    threads = torch.get_num_threads()
    with peak_device_use(bench) as peak:
        numbers = run_llama_bench(
            args.llamacpp, gguf, args.device, len(bench.ids), args.long_prompt_tokens, args.new_tokens,
            args.repeats, threads,
        )  # fmt: skip
    long_ttft = median_ms(numbers.prompt_s[args.long_prompt_tokens]) if args.long_prompt_tokens else None
    note = f"{numbers.how}; TTFT: prompt processing alone; decode after a {len(bench.ids)}-token context"
    if peak.mb is not None:
        note += "; device MB: the peak while llama-bench ran (its own process, free memory sampled every 20 ms)"
    return EngineResult(
        "", note, rates=numbers.decode_tok_s, ttfts_s=numbers.prompt_s[len(bench.ids)], long_ttft_ms=long_ttft,
        memory_mb=peak.mb,
    )  # fmt: skip


class _Peak:
    mb: float | None = None


@contextlib.contextmanager
def peak_device_use(bench: Bench) -> Iterator[_Peak]:
    """The most device memory taken (free bytes before the engine minus the least free seen) while
    the block runs, sampled from a thread: for an engine in another process (llama-bench), whose
    memory is gone by the time it has exited. None on the CPU."""
    import threading

    peak = _Peak()
    if bench.args.device != "cuda":
        yield peak
        return
    least = [torch.cuda.mem_get_info()[0]]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            least[0] = min(least[0], torch.cuda.mem_get_info()[0])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()
        peak.mb = (bench.free_before - least[0]) / 1e6


RUNNERS: dict[str, Callable[[Bench], EngineResult]] = {
    "onnxgen": lambda b: run_onnxgen_engine(b, eager=False),
    "onnxgen-eager": lambda b: run_onnxgen_engine(b, eager=True),
    "ort-genai-graph": lambda b: run_genai_engine(b, graph=True),
    "ort-genai": lambda b: run_genai_engine(b, graph=False),
    "ort-genai-own-graph": lambda b: run_genai_engine(b, graph=True, own=True),
    "ort-genai-own": lambda b: run_genai_engine(b, graph=False, own=True),
    "onnxgen-on-genai": lambda b: run_onnxgen_engine(b, eager=False, genai_package=True),
    "hf-eager": lambda b: run_hf_engine(b, compiled=False),
    "hf-compile": lambda b: run_hf_engine(b, compiled=True),
    "llama-cpp": run_llamacpp_engine,
}


def run_engine(name: str, bench: Bench) -> EngineResult:
    """One engine, its failure caught and named (a peer that cannot run is a result, not a crash)."""
    say(f"{name}: warm-up + {bench.args.repeats} timed generation(s)")
    start = time.perf_counter()
    if bench.args.device == "cuda":
        bench.free_before = torch.cuda.mem_get_info()[0]
    try:
        result = RUNNERS[name](bench)
    except Exception as exc:  # any failure of a peer becomes its table row
        import traceback

        traceback.print_exc(file=sys.stderr)
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        result = EngineResult("", error=f"{type(exc).__name__}: {first_line}")
    finally:
        gc.collect()  # drop this engine's weights before the next one loads its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result.name = name
    if result.ok:
        took = time.perf_counter() - start
        say(f"{name}: {result.decode_tok_s:.1f} tok/s, TTFT {result.ttft_ms:.1f} ms (engine total {took:.1f} s)")
    return result


# --- report -----------------------------------------------------------------------------------


def versions() -> Iterator[str]:
    yield f"torch {torch.__version__}"
    for module in ("transformers", "onnxruntime_genai", "onnxruntime"):
        try:
            imported = __import__(module)
        except ImportError:
            yield f"{module} not installed"
            continue
        line = f"{module} {getattr(imported, '__version__', '?')}"
        if module == "onnxruntime":
            line += f" (providers: {', '.join(imported.get_available_providers())})"
        yield line


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                return f"{name} ({os.cpu_count()} CPUs, torch threads {torch.get_num_threads()})"
    return platform.processor() or "CPU"


def cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def table(results: list[EngineResult], floor_ms: float | None, long_tokens: int = 0) -> list[str]:
    reference = next((r for r in results if r.name == "onnxgen" and r.ok), None)
    lines = [
        f"| engine | decode tok/s | ms/token | TTFT ms | TTFT ms, {long_tokens or 'long'} tokens | device MB "
        "| onnxgen / engine | x floor | notes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.name} | - | - | - | - | - | - | - | failed: {cell(r.error)} |")
            continue
        ratio = f"{reference.decode_tok_s / r.decode_tok_s:.2f}" if reference else "-"
        over = f"{r.ms_per_token / floor_ms:.1f}" if floor_ms else "-"
        long_ttft = f"{r.long_ttft_ms:.1f}" if r.long_ttft_ms is not None else "-"
        memory = f"{r.memory_mb:.0f}" if r.memory_mb is not None else "-"
        lines.append(
            f"| {r.name} | {r.decode_tok_s:.1f} | {r.ms_per_token:.3f} | {r.ttft_ms:.1f} | {long_ttft} | {memory} "
            f"| {ratio} | {over} | {cell(r.note)} |"
        )
    return lines


def best_forms(results: list[EngineResult]) -> list[str]:
    """The headline: onnxgen against each peer's fastest row in this run (its best form measured)."""
    ours = next((r for r in results if r.name == "onnxgen" and r.ok), None)
    lines = []
    for peer, names in PEER_FAMILIES.items():
        rows = [r for r in results if r.name in names and r.ok]
        if ours is None or not rows:
            continue
        best = max(rows, key=lambda r: r.decode_tok_s)
        lines.append(
            f"against {peer}'s best form here ({best.name}, {best.decode_tok_s:.1f} tok/s): "
            f"onnxgen {ours.decode_tok_s / best.decode_tok_s:.2f}x decode; TTFT onnxgen {ours.ttft_ms:.1f} ms, "
            f"{best.name} {best.ttft_ms:.1f} ms"
        )
        quickest = min(rows, key=lambda r: r.ttft_ms)
        line = f"  {peer}'s lowest TTFT here: {quickest.name} {quickest.ttft_ms:.1f} ms (onnxgen {ours.ttft_ms:.1f} ms)"
        longs = [r for r in rows if r.long_ttft_ms is not None]
        if longs and ours.long_ttft_ms is not None:
            quick_long = min(longs, key=lambda r: r.long_ttft_ms or 0.0)
            line += f"; long prompt: {quick_long.name} {quick_long.long_ttft_ms:.1f} ms"
            line += f" (onnxgen {ours.long_ttft_ms:.1f} ms)"
        lines.append(line)
    return lines


def token_agreement(results: list[EngineResult], eos_ids: set[int]) -> list[str]:
    """Each engine's greedy ids against onnxgen's, up to onnxgen's first EOS (the peers suppress EOS
    there, onnxgen takes it). fp16 runs may part at near-ties: reported, never a failure."""
    reference = next((r for r in results if r.name in ("onnxgen", "onnxgen-eager") and r.ok), None)
    if reference is None:
        return ["tokens: no onnxgen run to compare against"]
    ours = reference.tokens
    end = next((i for i, t in enumerate(ours) if t in eos_ids), len(ours))
    lines = [] if end == len(ours) else [f"tokens: {reference.name} chose EOS at position {end}; compared before it"]
    for r in results:
        if r is reference or not r.ok:
            continue
        if not r.runs:
            lines.append(f"tokens: {r.name} not compared (its benchmark tool reports no token ids)")
            continue
        theirs = r.tokens[:end]
        differ = next((i for i, (a, b) in enumerate(zip(ours[:end], theirs)) if a != b), None)
        if differ is None and len(theirs) == end:
            lines.append(f"tokens: {r.name} = {reference.name} over all {end} greedy tokens")
        else:
            at = differ if differ is not None else len(theirs)
            lines.append(f"tokens: {r.name} differs from {reference.name} first at position {at} (of {end})")
    return lines


def report(bench: Bench, results: list[EngineResult]) -> list[str]:
    args = bench.args
    stored, read = weight_bytes(bench.package)
    copy_rate = device_copy_bytes_per_s() if args.device == "cuda" else None
    floor_ms = 1000.0 * read / copy_rate if copy_rate else None
    lines = [
        f"## decode speed: {args.label} {args.precision} on {args.device}",
        "",
        f"random weights; prompt {len(bench.ids)} tokens, {args.new_tokens} new, greedy, "
        f"median of {args.repeats} after a warm-up of at least {args.warmup_s:g} s",
        "",
        *table(results, floor_ms, args.long_prompt_tokens),
        "",
    ]
    lines.append("onnxgen / engine: ratio of decode tok/s (above 1: onnxgen is faster)")
    lines += best_forms(results)
    weights = (f"decoder weights as stored {stored / 1e6:.1f} MB, {read / 1e6:.1f} MB read per step (Gather-only "
               "tables left out" + (", routed experts at top-k of all)" if args.config.moe else ")"))  # fmt: skip
    if floor_ms:
        ours = next((r for r in results if r.name == "onnxgen" and r.ok), None)
        lines.append(
            f"bandwidth floor: {weights} / {copy_rate / 1e12:.2f} TB/s (a 1 GiB device copy here, bytes read "
            f"and written) = {floor_ms:.3f} ms/token"
            + (f"; onnxgen at {ours.ms_per_token / floor_ms:.1f}x the floor" if ours else "")
        )
    else:
        lines.append(f"{weights} (no floor on the CPU)")
    if args.precision == "int4" and any(r.name.startswith("hf") for r in results):
        dtype = "fp16" if args.device == "cuda" else "fp32"
        lines.append(f"int4: transformers has no int4 path here; its rows run the checkpoint's weights in {dtype}")
    lines += token_agreement(results, set(args.config.eos_token_id))
    if args.device == "cpu" and args.precision == "int4" and any(r.name == "ort-genai" for r in results):
        # builder_parts: MatMulNBits accuracy_level 4 on the CPU, genai's default there
        lines.append("int4 on the CPU: onnxruntime rounds MatMulNBits activations to int8 (accuracy_level 4)")
    lines += ["", f"device: {device_name(args.device)}", "versions: " + "; ".join(versions())]
    lines.append(f"date: {datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}")
    lines.append(f"command: {reproduce_line('bench.peers_decode')}")
    return lines


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        print("\n".join(plan_lines(args)), flush=True)
        return 0
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = args.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="peers-decode-")))
        problem = checkpoint_problem(args, workdir)
        if problem:
            say(f"checkpoint: not written ({problem}); onnxgen's package is built from the same RandomSource weights")
        hf_dir = None if problem else ensure_checkpoint(args, workdir)
        package = ensure_package(args, hf_dir, workdir)
        rng = np.random.default_rng(args.seed)
        ids = [int(i) for i in rng.integers(0, args.config.vocab_size, args.prompt_tokens)]
        long_ids = [int(i) for i in rng.integers(0, args.config.vocab_size, args.long_prompt_tokens)]
        bench = Bench(args, workdir, hf_dir, package, ids, long_ids)
        if args.build_only:
            built = [package] + ([ensure_genai_package(bench)] if set(args.engines) & OWN_BUILDER else [])
            if "llama-cpp" in args.engines and hf_dir is not None:
                from bench.llamacpp_peer import ensure_gguf

                gguf = ensure_gguf(
                    args.llamacpp, hf_dir, args.tokenizer_from, workdir, args.precision, converter_flags(args.config)
                )
                built.append(gguf)
            print("\n".join(str(path) for path in ([hf_dir] if hf_dir else []) + built), flush=True)
            return 0
        results = [run_engine(name, bench) for name in args.engines]
        print("\n".join(report(bench, results)), flush=True)
    failed = [r.name for r in results if r.name.startswith("onnxgen") and not r.ok]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
