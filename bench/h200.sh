#!/usr/bin/env bash
# The usual GPU measurements and checks as named stages, for one device call on the lent H200 (or any
# CUDA machine). Run from the repo root:
#
#     bash bench/h200.sh STAGE [STAGE ...]      # logs to $OUT (the device tool's output folder) or ./h200-logs
#     bash bench/h200.sh                        # lists the stages
#
# Stages (each command under its own time limit, so one slow stage cannot eat a call's 10 minutes;
# the tail of every log is printed; Q = --shape qwen2.5-coder-0.5b-instruct, random weights):
#
#   tests      the GPU test files (pytest -m gpu ...), ~5 min
#   decode     python -m bench.capture_decode Q --context 512 --capture-only, fp16 and int4, ~1.5 min
#   verify     the same with --capture verify --verify-steps 24 (every captured step against eager), ~2 min
#   long       1,024 new tokens at --context 2048, fp16, ~1 min
#   standard   the standard flavour (default-domain attention, dynamic KV), capture on vs off, ~1 min
#   qwen15     capture_decode --shape qwen2.5-coder-1.5b-instruct, fp16 and int4, ~2.5 min
#   llamacpp   builds llama.cpp (carry .lcpp from ../shared/device/pack-llamacpp.sh) into /tmp/lc, ~5 min: its own
#              call, first; later peers stages then add the llama-cpp row (needs .gpu/qwen-tok carried too:
#              python -m bench.llamacpp_peer qwen2.5-coder-0.5b-instruct .gpu/qwen-tok, or without a model hub
#              python -m bench.llamacpp_peer --vocab qwen2 .gpu/qwen-tok)
#   peers      python -m bench.peers_decode Q, fp16 and int4 (needs the peer wheels; also builds the peer's own package), ~9 min: one stage per call
#   peers15    peers_decode for the 1.5B shape, fp16 (needs the peer wheels), ~4 min
#   table      issue 18's table: both shapes, fp16 and int4, onnxgen beside onnxruntime-genai on its own
#              packages (graph and not) and llama.cpp when the llamacpp stage built it (needs the peer
#              wheels), ~6 min (docs/benchmarks/2026-12-04-h200-int4-table.md)
#   generator  peers_decode --engines onnxgen, fp16 and int4 (the Generator alone; needs only gguf), ~2 min
#   anatomy    python -m bench.step_anatomy Q --kernels: where the step's time goes, per kernel, ~2 min
#   profile    python -m bench.profile_decode Q --capture: kernels per token, top kernels, ~1 min
#   micro      python -m bench.gemv_micro --quick: the one-row GEMVs alone, ~2 min
#   int4       the 4-bit kernels on the packed codes against the fp16 copy: gemv_micro with prompt rows, the step
#              (step_sweep, and the fp16 package's), prefill per prompt path, the step's kernels (anatomy), ~9 min
#   prefill    python -m bench.prefill Q --lengths 16,1024 --profile, fp16 and int4: TTFT and where it goes, ~2 min
#   hybrid     the hybrid decoders' GPU tests (their Triton kernels for steps and prompts against the torch path,
#              the MoE experts and routing on the 35B-A3B layer, the rotary kernel against onnxruntime, captured
#              = eager over 256 tokens, dense and MoE, captured prompt chunks), ~5 min
#   fold       the Gated DeltaNet q / k norms and gate folded into the step kernel (FusedLinearAttention)
#              against ONNXGEN_FUSE_SKIP=delta_prologues: capture_decode on the qwen3.5-0.8b shape, ~3 min
#   q4prompt   issue 18's short prompt on the 1.5B shape: the 4-bit GEMM split along K (the default up to 16 rows;
#              ONNXGEN_Q4_PROMPT=split up to 64) against the default policy, dequantize-then-cuBLAS, the tiled
#              GEMM and cuBLAS fp16: its GPU tests, then the layers
#              alone (gemv_micro --prompt-only, split configurations swept), ~5 min
#   q4ttft     the same prompt paths in the prompt: TTFT per variant in one process (bench.prefill --variant)
#              beside the fp16 package, captured = eager (--capture verify), and the 0.5B shape, ~5 min
#   ttftgap    the decode engine's TTFT (bench.prefill's path) against the Generator's (bench.peers_decode's), each
#              after 1- and 128-token generations, interleaved in one process (python -m bench.ttft_paths), caches
#              of 2,048 and 256 rows, qwen3.5-0.8b fp16; on 2026-12-06 they agreed within 0.02 ms
#              (docs/benchmarks/2026-12-06-h100-ttft-paths.md), ~2 min
#   moe        the MoE expert kernels: their GPU tests, then python -m bench.moe_prompt, one 35B-A3B expert layer per
#              prompt length, per-pair against grouped kernels at several moe_pairs_per_expert bounds (no package
#              build), then the grouped kernels' tiles swept (ONNXGEN_MOE_GROUPED variants), ~5 min
#   moedecode  the 35B-A3B decode step's products: the per-pair expert kernels' tiles swept on its expert layer
#              (ONNXGEN_MOE_PER_PAIR variants, bench.moe_prompt at 1 and 8 tokens: a decode step, and the pairs of
#              a short prompt), then its one-row 4-bit GEMVs swept (bench.gemv_micro --quick, lm_head aside), ~6 min
#   ttft08     the qwen3.5-0.8b fp16 prompt: the hybrid kernel GPU tests (and the strided-row kernels'); TTFT at
#              16 and 64 tokens; then the copies and fills an eager 16-token prompt issues, by onnxgen line
#              (bench.prefill --copies), ~3 min
#   pieces     options prefill_pieces and prefill_sizes: a hybrid prompt chunk padded, its states stopping at the
#              last real row (pad, the default), against unpadded pieces (split: 56 = 32 + 16 + 8), each with
#              power-of-two sizes and with 1.5x ones too (fine: 40 padded to 48; 56 split as 48 + 8):
#              bench.prefill at 24-100 tokens, qwen3.5-0.8b fp16, and the 35B-A3B int4 package where
#              bench/hybrid_peers_device.sh build-35b has built it; then Q's dense chunks under both sizes, ~7 min
#   cutoffs    bench/prompt_cutoffs.sh: TTFT at 64, 100 and 128 tokens with the prompt-length cutoffs of the
#              sequential Gated DeltaNet kernel and the split-K 4-bit GEMM at 128 (the default) and at 64, the
#              1.5B int4 and 0.8B fp16 / int4 shapes and the 35B-A3B int4 package where build-35b made it, ~6 min
#   gdnchunk   the Gated DeltaNet prompt paths: the chunked kernels' GPU tests (gpu/gated_delta_chunked.py, the
#              default from 17 tokens, with no upper bound since 2026-12-06 late), then bench/gdn_prompt_variants.sh
#              (the qwen3.5-0.8b fp16 TTFT at 16-1,024 tokens: the sequential kernel folded and unfolded, the
#              chunked kernels under several chunk lengths and product precisions), and the 35B-A3B package
#              where build-35b made it: the chunked kernels past 128 tokens against the torch path there, ~9 min
#   memory     python -m bench.memory_peak on the 1.5B and 0.5B int4 packages: the device memory issue 18 compares
#              with onnxruntime-genai's, taken apart at its peak by the onnxgen line of each live block, ~2 min
#   q4sym      the 1.5B int4 package with symmetric blocks (--int4-zero-points none) against packed zero points:
#              TTFT at 16 / 64 tokens and the decode step of each, the fp16 package's TTFT beside them, then
#              the one-row kernels of each layer alone with and without zero points (gemv_micro), ~10 min
#   zerobytes  packed 4-bit zero points widened to a byte per block at load (e159038): the 4-bit GPU parity tests,
#              the 16-row prompt GEMMs of the 1.5B shape with packed / byte / no zero points (gemv_micro), then the
#              1.5B int4 package (packed zero points) with ONNXGEN_Q4_ZERO_BYTES=1 and =0 beside fp16: TTFT at 16
#              and 64 tokens and the decode step, ~8 min
#   q4long     long prompts' 4-bit products: dequantize-then-cuBLAS (the default past 128 rows) with the byte
#              and the block dequantization kernels (option q4_dequant, blocks by default since 2026-12-07), the
#              tiled GEMMs (SWAP 1 lost to the default on 2026-12-07: docs/benchmarks/2026-12-07-h100-table.md)
#              and cuBLAS fp16: the GPU parity tests, the 1.5B layers at 1,024 rows (gemv_micro: each path, and each
#              dequantization kernel alone), then the 1.5B int4 TTFT at 256 / 1,024 tokens per form beside fp16, ~6 min
#   moezero    option moe_zero_bytes (on since 2026-12-07): QMoE's block-wise 4-bit expert zero points a byte per
#              block against packed: the MoE GPU tests, then bench.moe_prompt on the 35B-A3B expert layer with
#              each form (1-256 tokens, the per-pair and grouped kernels); where build-35b made the 35B-A3B int4
#              package, its decode step and TTFT at 16 / 64 tokens with ONNXGEN_MOE_ZERO_BYTES=1 / 0 / 1, ~4 min
#              (+ ~8 with the package)
#   q4rows     the int4 step with qkv / o_proj and down_proj in other rows per program than the table's: the dense
#              fp16 kernel runs them 4 rows per program, the 4-bit table 16 / 8 (down: 8 on the 0.5B shape since
#              2026-12-07, 16 on 1.5B); bench.step_sweep variants beside the default on both shapes, ~4 min
#   q4ready    option q4_row_ready (off: +2% / -1.4% on the 0.5B / 1.5B int4 steps on an H100, 2026-12-07): the
#              one-row byte kernels (qkv, o_proj, down; the 1.5B lm_head) make their weights before the PDL
#              wait: the GPU parity tests and the int4 capture proofs with it on, then bench.step_sweep on both
#              shapes (default, ready, ready with gate_up on the byte kernel too, default again) and the fp16 step
#              beside them, ~6 min
#   q4half     option q4_half: the one-row 4-bit products in fp16 pair arithmetic (gpu/linear_q4_half.py,
#              built 2026-12-07 without a GPU after bench.q4_ceiling found the byte kernel bound by its arithmetic:
#              docs/benchmarks/2026-12-07-h100-q4-ceiling.md): the kernel against its lane model, the lm_head and
#              gate_up alone (bench.q4_ceiling: kernel, codes from cache, loads only, each form), the 1.5B step
#              (bench.step_sweep: off, auto (the default since 2026-12-07), all, the lm_head or gate_up alone,
#              again; docs/benchmarks/2026-12-07-h100-q4-half.md), ~7 min;
#              q4halfcheck: the int4 GPU parity tests (auto and all) and capture proofs, then the 0.5B step the
#              same way, ~9 min; q4half05: the fp16 steps of both shapes, the 1.5B step's kernels (step_anatomy) with
#              and without it, and the 1.5B qkv, o_proj and down_proj alone with each kernel's configurations
#              swept (gemv_micro --words --half), ~7 min
#   q4stream   option q4_stream (off; built 2026-12-07 without a GPU): the fp16 pair kernel's one-tile products as P
#              programs per SM, each making the activation pairs once and loading its next row block while it sums
#              this one: the kernel's GPU tests (lane model, prologues over three parts), the int4 parity tests with
#              it on, then both shapes' steps at 1, 2 and 4 programs per SM against the default (also: the 0.5B
#              lm_head on the pair kernel streaming, the 1.5B down_proj in the pair kernel's best tile alone, 64 x
#              1,024 on 4 warps, and option q4_row_ready once more: it lost on the 1.5B step when the byte kernels
#              still ran there), ~9 min
#   q4streamlayers  the streaming form layer by layer (gemv_q4's fifth value, 2026-12-07, after q4stream ran: 4
#              programs per SM for every layer won 1.12x on the 1.5B step, lost on the 0.5B): the kernel's GPU
#              tests, then both shapes' int4 steps streaming the gate_up or lm_head alone at 2, 4 and 8
#              programs per SM, and fp16's steps in the same call, ~6 min
#   q4streamauto  q4_stream=auto (the default since 2026-12-07) timed as the default: both shapes' int4 steps,
#              auto against q4_stream=0 (the pair kernel's tile form everywhere; 0.5B also its gate_up in 8-row
#              blocks, 1,216 of them, which the rule then streams), ~4 min
#   q4anatomy05  where the 0.5B int4 step's time goes with the streamed default (2026-12-07 evening): the pair
#              kernel's GPU tests and the int4 parity tests (the launcher that plans streaming once per shape), the
#              step's kernels int4 (default, every layer on the pair kernel) and fp16, and the 0.5B qkv, o_proj and
#              down_proj alone with each 4-bit kernel swept (gemv_micro --words --half), ~9 min
#   q4postwait  the one-row 4-bit kernels' path after the PDL wait, restructured 2026-12-07 without a GPU (every
#              part's activations loaded at once; a norm's statistics and the pair kernel's scale from one
#              reduction over the row): their GPU tests, then both shapes' int4 steps under the code before
#              (.trees/base), with the loads alone (.trees/loads) and now (head), alternating, on one package per
#              shape, and fp16 beside them; carry .trees, made here by
#              bash bench/tree_ab.sh export base 6f0596a; bash bench/tree_ab.sh export loads 1cc3f83; the 0.5B
#              shape, ~7 min; q4postwait15: the 1.5B shape's steps, ~7 min
#   q4onewarp  one-warp programs for the one-row 4-bit products (never swept before 2026-12-07: compiled for sm_90
#              their reductions need no barrier between warps, with about as many instructions after the wait):
#              the 0.5B short-row layers alone with every kernel (gemv_micro --half --one-warp), then both
#              shapes' int4 steps with qkv and o_proj, gate_up or down_proj in one-warp programs, ~8 min
#   q4chunk    option q4_dequant_chunk_rows (built 2026-12-07 without a GPU): the 1.5B int4 TTFT at 256 and 1,024
#              tokens with each layer's weight dequantized whole (the default) and in chunks of 2,048-8,960 rows
#              (3-26 MiB of gate_up), each product written into its columns in place, beside fp16's; the chunk
#              tests on CUDA first, ~6 min
#   q4overlap  can a long prompt's dequantization hide behind cuBLAS? option q4_dequant_ahead's GPU tests, then
#              bench.dequant_overlap (the 1.5B layers' four products at 1,024 and 256 rows, fp16 against
#              dequantize-then-cuBLAS in series and under the option, through the runtime's own calls), then the
#              1.5B int4 TTFT at 256 and 1,024 tokens with and without the option beside fp16's, ~7 min;
#              q4overlapcheck: the same prompts captured with the option, each recorded chunk checked against
#              eager (--capture verify), ~2 min
#   q8         8-bit MatMulNBits on the packed byte kernels (2026-12-07): their GPU parity tests, then each layer of
#              both shapes alone (gemv_micro --quick --bits 8: the one-row kernel swept beside cuBLAS over the fp16
#              copy, which is what 8-bit weights ran over before, and the 16-row prompt paths), ~5 min
#   memorypeers issue 18's memory bound in one run: peers_decode int4 on both shapes, onnxgen beside onnxruntime-genai
#              on the same package (graph and not; needs the peer wheels), device MB the same way for all, ~4 min
#              (docs/benchmarks/2026-12-06-h100-memory-and-chunked.md)
#   sampled    the sampling GPU tests, then python -m bench.sampled_decode Q, fp16 and int4: sampled decode
#              in the graph vs greedy and vs between the steps, same tokens as eager, ~4 min
#
# The environment passes through (README's table of ONNXGEN_* switches), e.g.
#     ONNXGEN_TRITON_LINEAR=0 bash bench/h200.sh decode      # the same stage with cuBLAS GEMVs
# For many settings in one process use python -m bench.step_sweep / bench.step_anatomy --variant.
#
# Set-up (bench/README.md): the peer wheels and gguf are carried into /tmp/site by earlier calls; this
# script puts /tmp/site first on PYTHONPATH and sources /tmp/site-env.sh when it is there.
set -u
out=${OUT:-$PWD/h200-logs}
export PYTHONPATH=/tmp/site:$PWD
# onnxgen's package builder needs gguf (its tokenizer module), which that machine lacks: where no gguf was
# carried, the gguf-py of the llama.cpp tree the llamacpp stage unpacked serves
python3 -c "import gguf" 2>/dev/null || { [ -d /tmp/lc/gguf-py ] && export PYTHONPATH=$PYTHONPATH:/tmp/lc/gguf-py; }
[ -f /tmp/site-env.sh ] && source /tmp/site-env.sh

Q="--shape qwen2.5-coder-0.5b-instruct"
Q15="--shape qwen2.5-coder-1.5b-instruct"
PY=python3
GPU_TESTS="tests/test_fusion.py tests/test_decode_tail.py tests/test_gpu_capture_models.py tests/test_capture_runtime.py
  tests/test_pipelined_decode.py tests/test_model_parity.py tests/test_ops_contrib.py tests/test_ops_tensor.py
  tests/test_session_contract.py tests/test_sampling_inputs.py tests/test_captured_prefill.py tests/test_sampled_decoding.py"

# run NAME LIMIT COMMAND...: one command, its log in $out/NAME.log, its exit status and last lines printed
run() {
  local name=$1 limit=$2
  shift 2
  echo "### $name ($(date +%T), limit ${limit}s): $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "### $name rc=$?"
  grep -v '^\s*$' "$out/$name.log" | tail -n 14
}

# the 35B-A3B int4 package bench/hybrid_peers_device.sh build-35b writes, or nothing
package35() {
  compgen -G "/tmp/peers-qwen3.5-35b-a3b/pkg-qwen3.5-35b-a3b-int4-cuda-gqa-seed*[0-9]" | head -1
}

stage_tests() {
  # shellcheck disable=SC2086
  run tests 420 $PY -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS
}
stage_decode() {
  for p in fp16 int4; do run "decode-$p" 60 $PY -m bench.capture_decode $Q --precision $p --context 512 --capture-only; done
}
stage_verify() {
  for p in fp16 int4; do
    run "verify-$p" 90 $PY -m bench.capture_decode $Q --precision $p --context 512 --capture verify --verify-steps 24 --repeats 1
  done
}
stage_long() {
  run long 60 $PY -m bench.capture_decode $Q --precision fp16 --context 2048 --new-tokens 1024 --repeats 1 --capture-only
}
stage_standard() {
  run standard 80 $PY -m bench.capture_decode $Q --precision fp16 --attention standard --kv dynamic --repeats 2
}
stage_qwen15() {
  for p in fp16 int4; do run "qwen15-$p" 90 $PY -m bench.capture_decode $Q15 --precision $p --context 512 --capture-only; done
}
# the llama-cpp row where the llamacpp stage has built it and a real tokenizer was carried
LLAMACPP=()
[ -x /tmp/lc/build/bin/llama-bench ] && [ -f .gpu/qwen-tok/tokenizer.json ] && LLAMACPP=(--llamacpp /tmp/lc --tokenizer-from .gpu/qwen-tok)
stage_llamacpp() {
  run llamacpp-build 420 bash .lcpp/llamacpp-build.sh llama-bench llama-quantize
}
stage_peers() {
  run peers-fp16 290 $PY -m bench.peers_decode $Q --precision fp16 --workdir /tmp/peers --long-prompt-tokens 1024 "${LLAMACPP[@]}"
  run peers-int4 290 $PY -m bench.peers_decode $Q --precision int4 --workdir /tmp/peers --long-prompt-tokens 1024 "${LLAMACPP[@]}"
}
stage_peers15() {
  run peers15-fp16 250 $PY -m bench.peers_decode $Q15 --precision fp16 --workdir /tmp/peers15 --long-prompt-tokens 1024 \
    "${LLAMACPP[@]}"
}
stage_table() {
  local engines=onnxgen,ort-genai-own-graph,ort-genai-own
  [ ${#LLAMACPP[@]} -gt 0 ] && engines+=,llama-cpp
  for s in qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct; do
    for p in fp16 int4; do
      run "table-$s-$p" 200 $PY -m bench.peers_decode --shape "$s" --precision $p --workdir "/tmp/table-$s" \
        --engines "$engines" --long-prompt-tokens 1024 "${LLAMACPP[@]}"
    done
  done
}
stage_generator() {
  for p in fp16 int4; do run "generator-$p" 120 $PY -m bench.peers_decode $Q --precision $p --workdir /tmp/peers --engines onnxgen; done
}
stage_anatomy() {
  run anatomy 200 $PY -m bench.step_anatomy $Q --precision fp16 --context 512 --kernels --variant "default:"
}
stage_profile() {
  run profile 60 $PY -m bench.profile_decode $Q --precision fp16 --context 512 --capture --steps 16 --top 15
}
stage_prefill() {
  for p in fp16 int4; do run "prefill-$p" 120 $PY -m bench.prefill $Q --precision $p --context 2048 --lengths 16,1024 --profile --top 12; done
}
stage_moe() {
  run moe-tests 200 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_moe_kernels.py
  run moe-prompt 120 $PY -m bench.moe_prompt --tokens 1,8,16,24,32,48,64,128,256 --bounds 4,0.5,0.25,0
  # the grouped kernels' tiles (ONNXGEN_MOE_GROUPED=BLOCK_M,BLOCK_N1,BLOCK_N2,K_STEP,WARPS[,SWAP[,STAGES]]; BLOCK_M
  # 0: the rule, which is 0,64,128,64,4,1 since 2026-12-06 (docs/benchmarks/2026-12-06-h100-grouped-swap-ttft.md);
  # old: the rule before, pairs as the products' rows; STAGES: the pipeline's depth)
  run moe-tiles 240 $PY -m bench.moe_prompt --tokens 16,32,64,100,256 --bounds 0 --variant rule: \
    --variant old:ONNXGEN_MOE_GROUPED=0,32,64,32,4,0 --variant s64k32:ONNXGEN_MOE_GROUPED=0,64,128,32,4,1 \
    --variant s64k128:ONNXGEN_MOE_GROUPED=0,64,128,128,4,1 --variant s128k64:ONNXGEN_MOE_GROUPED=0,128,128,64,4,1 \
    --variant s64k64n256:ONNXGEN_MOE_GROUPED=0,64,256,64,4,1 --variant s64k64st4:ONNXGEN_MOE_GROUPED=0,64,128,64,4,1,4 \
    --variant s32k64:ONNXGEN_MOE_GROUPED=0,32,128,64,4,1 --variant rule-again:
}
stage_moedecode() {
  # FC1_ROWS,FC1_BYTES,FC2_ROWS,FC2_BYTES,WARPS; the rule is 16,16384,0,8192,8 for 4-bit experts
  local v=(--variant rule:)
  for t in r8:8,16384,0,8192,8 r32:32,16384,0,8192,8 b8k:16,8192,0,8192,8 b32k:16,32768,0,8192,8 \
    w4:16,16384,0,8192,4 w16:16,16384,0,8192,16 n2:16,16384,2,8192,8 n8:16,16384,8,8192,8 \
    n16:16,16384,16,16384,8 f4k:16,16384,0,4096,8 f16k:16,16384,0,16384,8; do
    v+=(--variant "${t%%:*}:ONNXGEN_MOE_PER_PAIR=${t#*:}")
  done
  run moedecode 300 $PY -m bench.moe_prompt --tokens 1,8 --bounds 4 "${v[@]}" --variant rule-again:
  run gemv-35b 240 $PY -m bench.gemv_micro --shape qwen3.5-35b-a3b --quick \
    --layers qkv,o_proj,gdn_in,gdn_out,moe_in,shared_down
}
stage_ttft08() {
  run ttft08-tests 200 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_hybrid_kernels.py \
    tests/test_strided_row_kernels.py
  local H="--shape qwen3.5-0.8b --precision fp16"
  run ttft08-prefill 120 $PY -m bench.prefill $H --context 2048 --lengths 16,64 --repeats 7
  run ttft08-copies 120 $PY -m bench.prefill $H --context 2048 --lengths 16 --repeats 1 --capture off --profile \
    --copies --top 20
}
stage_pieces() {
  local v=(--variant pad: --variant pad-fine:ONNXGEN_PREFILL_SIZES=fine --variant split:ONNXGEN_PREFILL_PIECES=split
    --variant split-fine:ONNXGEN_PREFILL_PIECES=split,ONNXGEN_PREFILL_SIZES=fine --variant pad-again:
    --variant pad-fine-again:ONNXGEN_PREFILL_SIZES=fine)
  run pieces-08 150 $PY -m bench.prefill --shape qwen3.5-0.8b --precision fp16 --context 2048 \
    --lengths 24,32,48,56,64,100 --repeats 5 "${v[@]}"
  local p35
  p35=$(package35)
  [ -n "$p35" ] && run pieces-35b 240 $PY -m bench.prefill --package "$p35" --context 2048 \
    --lengths 24,32,48,56,64,100 --repeats 5 "${v[@]}"
  # a dense graph's padded chunks under both size rules
  run pieces-dense 150 $PY -m bench.prefill $Q --precision fp16 --context 2048 --lengths 24,48,96,100,384,700 \
    --repeats 5 --variant pow2: --variant fine:ONNXGEN_PREFILL_SIZES=fine --variant pow2-again: \
    --variant fine-again:ONNXGEN_PREFILL_SIZES=fine
}
stage_sampled() {
  run sampled-tests 240 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_sampled_decoding.py tests/test_decode_tail.py tests/test_sampling_inputs.py
  for p in fp16 int4; do run "sampled-$p" 150 $PY -m bench.sampled_decode $Q --precision $p --context 512; done
}
stage_int4() {
  # the 4-bit kernels on the packed codes (ONNXGEN_TRITON_Q4=1) against the fp16 copy and the fp16 package
  run int4-micro 300 $PY -m bench.gemv_micro --quick --prompt-rows 16,1024
  run int4-step 150 $PY -m bench.step_sweep $Q --precision int4 --context 512 --repeats 2 \
    --variant "packed:ONNXGEN_TRITON_Q4=1" --variant "copy:ONNXGEN_TRITON_Q4=0"
  run fp16-step 90 $PY -m bench.step_sweep $Q --precision fp16 --context 512 --repeats 2 --variant "fp16:"
  for v in "1 dequant" "1 gemm" "0 dequant"; do
    # shellcheck disable=SC2086
    set -- $v
    run "int4-prefill-q4$1-$2" 100 env ONNXGEN_TRITON_Q4="$1" ONNXGEN_Q4_PROMPT="$2" $PY -m bench.prefill $Q --precision int4 \
      --context 2048 --lengths 16,1024 --repeats 3
  done
  run int4-anatomy 150 $PY -m bench.step_anatomy $Q --precision int4 --context 512 --kernels --variant "packed:ONNXGEN_TRITON_Q4=1"
}
stage_hybrid() {
  run hybrid-tests 480 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_hybrid_kernels.py \
    tests/test_hybrid_small_kernels.py tests/test_gpu_hybrid.py tests/test_moe_kernels.py tests/test_captured_prefill.py \
    tests/test_ops_mrope.py
}
stage_gdnchunk() {
  run gdnchunk-tests 240 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_hybrid_kernels.py \
    -k "chunked or long or fold"
  LENGTHS=16,64,128,300,1024 VARIANTS="32:ieee:16 32:tf32x3:16 64:ieee:16" run gdnchunk-08 360 \
    bash bench/gdn_prompt_variants.sh
  local p35
  p35=$(package35)
  [ -n "$p35" ] && run gdnchunk-35b 150 $PY -m bench.prefill --package "$p35" --context 2048 --lengths 64,128,300 \
    --repeats 5 --variant default: --variant torch-past-128:ONNXGEN_GDN_CHUNKED_TO=128 \
    --variant sequential:ONNXGEN_GDN_CHUNKED_FROM=0 --variant default-again:
}
stage_fold() {
  # the Gated DeltaNet prologues folded into the step kernel (FusedLinearAttention) against the graph without
  # that rewrite, one process each (a session-time switch): decode and TTFT of the 0.8B hybrid shape
  for skip in "" delta_prologues; do
    run "fold-skip-${skip:-none}" 150 env ONNXGEN_FUSE_SKIP="$skip" $PY -m bench.capture_decode --shape qwen3.5-0.8b \
      --precision fp16 --context 512 --capture-only --repeats 3
  done
}
stage_q4prompt() {
  run q4prompt-tests 240 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py -k "matmul_nbits"
  run q4prompt-micro 300 $PY -m bench.gemv_micro $Q15 --prompt-rows 16,64 --prompt-only
}
stage_q4ttft() {
  local variants=(--variant auto: --variant split:ONNXGEN_Q4_PROMPT=split --variant dequant:ONNXGEN_Q4_PROMPT=dequant
    --variant gemm:ONNXGEN_Q4_PROMPT=gemm --variant auto-again:)
  run q4prompt-fp16 120 $PY -m bench.prefill $Q15 --precision fp16 --context 2048 --lengths 16,64,1024 --repeats 5
  run q4prompt-int4 200 $PY -m bench.prefill $Q15 --precision int4 --context 2048 --lengths 16,64,1024 --repeats 5 \
    "${variants[@]}"
  run q4prompt-verify 120 $PY -m bench.prefill $Q15 --precision int4 --context 2048 --lengths 16,64 --repeats 1 \
    --capture verify --variant split:ONNXGEN_Q4_PROMPT=split
  run q4prompt-05b 150 $PY -m bench.prefill $Q --precision int4 --context 2048 --lengths 16,64 --repeats 5 "${variants[@]}"
}
stage_q4chunk() {
  # option q4_dequant_chunk_rows (2026-12-07, built without a GPU): a long prompt's weight dequantized in chunks
  # small enough to stay in L2 for the GEMM that reads them, each product written in place; on the 1.5B shape
  # only gate_up (17,920 rows) and the lm_head have more than 2,048 rows
  run q4chunk-parity 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py -k "prompt_chunks"
  run q4chunk-fp16 120 $PY -m bench.prefill $Q15 --precision fp16 --context 2048 --lengths 256,1024 --repeats 5
  run q4chunk-int4 240 $PY -m bench.prefill $Q15 --precision int4 --context 2048 --lengths 256,1024 --repeats 5 \
    --variant whole: --variant rows2048:ONNXGEN_Q4_DEQUANT_CHUNK_ROWS=2048 \
    --variant rows3072:ONNXGEN_Q4_DEQUANT_CHUNK_ROWS=3072 --variant rows4096:ONNXGEN_Q4_DEQUANT_CHUNK_ROWS=4096 \
    --variant rows6144:ONNXGEN_Q4_DEQUANT_CHUNK_ROWS=6144 --variant rows8960:ONNXGEN_Q4_DEQUANT_CHUNK_ROWS=8960 \
    --variant whole-again:
}
stage_q4overlap() {
  # a long prompt's dequantization on a second stream, a chunk ahead of cuBLAS (2026-12-08, built without a GPU)
  run q4overlap-tests 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_dequant_ahead.py
  run q4overlap-micro 120 $PY -m bench.dequant_overlap $Q15 --rows 1024,256 --layers 8
  run q4overlap-fp16 100 $PY -m bench.prefill $Q15 --precision fp16 --context 2048 --lengths 256,1024 --repeats 5
  run q4overlap-int4 200 $PY -m bench.prefill $Q15 --precision int4 --context 2048 --lengths 256,1024 --repeats 5 \
    --variant serial: --variant ahead:ONNXGEN_Q4_DEQUANT_AHEAD=1 --variant serial-again: \
    --variant ahead-again:ONNXGEN_Q4_DEQUANT_AHEAD=1
}
stage_q4overlapcheck() {
  # captured prompts with the option against eager ones, every recorded chunk checked (--capture verify)
  ONNXGEN_Q4_DEQUANT_AHEAD=1 run q4overlapcheck 150 $PY -m bench.prefill $Q15 --precision int4 --context 2048 \
    --lengths 256,1024 --repeats 2 --capture verify
}
stage_ttftgap() {
  # the engine and the Generator, with 1 and with 128 new tokens, interleaved in one process
  local H="--shape qwen3.5-0.8b --precision fp16 --lengths 16,64 --repeats 7"
  run ttftgap-2048 200 $PY -m bench.ttft_paths $H --context 2048
  run ttftgap-256 150 $PY -m bench.ttft_paths $H --context 256
}
stage_cutoffs() {
  # the prompt-length cutoffs of the sequential Gated DeltaNet kernel and the split-K 4-bit GEMM (128 since
  # 2026-12-06) against the earlier 64, each in its own process (module constants): bench/prompt_cutoffs.sh
  run cutoffs 560 bash bench/prompt_cutoffs.sh
}
stage_memory() {
  run memory-15b 120 $PY -m bench.memory_peak $Q15 --precision int4 --top 20
  run memory-05b 90 $PY -m bench.memory_peak $Q --precision int4 --top 20
}
stage_q4sym() {
  local z
  for z in none packed; do
    run "q4sym-build-$z" 120 $PY -c "from onnxgen.models.builder import build_package
from onnxgen.models.random_source import MODEL_SHAPES, RandomSource
build_package(RandomSource(MODEL_SHAPES['qwen2.5-coder-1.5b-instruct']), '/tmp/p15$z', precision='int4', device='cuda',
              attention='gqa', context_length=2048, int4_zero_points='$z')"
  done
  # shellcheck disable=SC2086
  run q4sym-ttft-fp16 150 $PY -m bench.prefill $Q15 --precision fp16 --lengths 16,64 --repeats 5
  for z in none packed; do
    # shellcheck disable=SC2086
    run "q4sym-ttft-$z" 90 $PY -m bench.prefill $Q15 --precision int4 --package /tmp/p15$z --lengths 16,64 --repeats 5
    # shellcheck disable=SC2086
    run "q4sym-step-$z" 90 $PY -m bench.step_sweep $Q15 --precision int4 --package /tmp/p15$z --context 2048 \
      --repeats 3 --variant "$z:"
  done
  # the one-row (decode) kernels alone, symmetric against packed zero points
  # shellcheck disable=SC2086
  run q4sym-rows-none 150 $PY -m bench.gemv_micro $Q15 --quick --layers qkv,gate_up,down
  # shellcheck disable=SC2086
  run q4sym-rows-packed 150 $PY -m bench.gemv_micro $Q15 --quick --layers qkv,gate_up,down --zero-points
}
stage_zerobytes() {
  local z
  run zerobytes-parity 200 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py tests/test_fusion.py \
    -k "(matmul_nbits or int4_group) and cuda"
  for z in packed bytes none; do
    # shellcheck disable=SC2086
    run "zerobytes-micro-$z" 100 $PY -m bench.gemv_micro $Q15 --prompt-rows 16 --prompt-only \
      --layers qkv,o_proj,gate_up,down $([ $z = none ] || echo --zero-points $z)
  done
  # shellcheck disable=SC2086
  run zerobytes-ttft-fp16 120 $PY -m bench.prefill $Q15 --precision fp16 --lengths 16,64 --repeats 5
  for z in 1 0; do
    # shellcheck disable=SC2086
    run "zerobytes-ttft-$z" 120 env ONNXGEN_Q4_ZERO_BYTES=$z $PY -m bench.prefill $Q15 --precision int4 \
      --int4-zero-points packed --lengths 16,64 --repeats 5
    # shellcheck disable=SC2086
    run "zerobytes-step-$z" 120 env ONNXGEN_Q4_ZERO_BYTES=$z $PY -m bench.step_sweep $Q15 --precision int4 \
      --int4-zero-points packed --context 2048 --repeats 3 --variant "zero-bytes-$z:"
  done
}
stage_q4long() {
  run q4long-parity 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py \
    -k "(prompt_gemm or dequant_forms or session_scratch) and cuda"
  # shellcheck disable=SC2086
  run q4long-micro 200 $PY -m bench.gemv_micro $Q15 --prompt-rows 1024 --prompt-only --layers qkv,o_proj,gate_up,down
  # shellcheck disable=SC2086
  run q4long-ttft-fp16 90 $PY -m bench.prefill $Q15 --precision fp16 --lengths 256,1024 --repeats 5
  # shellcheck disable=SC2086
  run q4long-ttft-int4 150 $PY -m bench.prefill $Q15 --precision int4 --lengths 256,1024 --repeats 5 --variant blocks: \
    --variant bytes:ONNXGEN_Q4_DEQUANT=bytes --variant blocks-again: --variant bytes-again:ONNXGEN_Q4_DEQUANT=bytes
}
stage_moezero() {
  run moezero-tests 200 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_moe_kernels.py
  local z
  for z in packed bytes packed-again; do
    run "moezero-$z" 100 $PY -m bench.moe_prompt --tokens 1,16,64,256 --bounds 4,0 --zero-points "${z%-again}"
  done
  # the whole 35B-A3B step and prompt with each form (a session-lifetime option: one process each), where
  # bench/hybrid_peers_device.sh build-35b made the package
  local p35
  p35=$(package35)
  [ -n "$p35" ] || return 0
  for z in 1 0 1; do
    ONNXGEN_MOE_ZERO_BYTES=$z run "moezero-35b-step-$z" 150 $PY -m bench.capture_decode --package "$p35" \
      --context 512 --capture-only --repeats 3
    ONNXGEN_MOE_ZERO_BYTES=$z run "moezero-35b-ttft-$z" 150 $PY -m bench.prefill --package "$p35" --context 2048 \
      --lengths 16,64 --repeats 5
  done
}
stage_q4rows() {
  # shellcheck disable=SC2086
  run q4rows 200 $PY -m bench.step_sweep $Q --precision int4 --context 512 --repeats 3 --variant "default:" \
    --variant "qkv-o-4x4:ONNXGEN_GEMV_Q4_1152x896=4,1024,4,0,ONNXGEN_GEMV_Q4_896x896=4,1024,4,0" \
    --variant "qkv-o-4x2:ONNXGEN_GEMV_Q4_1152x896=4,1024,2,0,ONNXGEN_GEMV_Q4_896x896=4,1024,2,0" \
    --variant "down-16:ONNXGEN_GEMV_Q4_896x4864=16,512,4,0" --variant "down-8x2:ONNXGEN_GEMV_Q4_896x4864=8,512,2,0" \
    --variant "down-4:ONNXGEN_GEMV_Q4_896x4864=4,512,4,0" --variant "default-again:"
  # shellcheck disable=SC2086
  run q4rows15 200 $PY -m bench.step_sweep $Q15 --precision int4 --context 512 --repeats 3 --variant "default:" \
    --variant "down-8:ONNXGEN_GEMV_Q4_1536x8960=8,512,4,0" --variant "down-8x2:ONNXGEN_GEMV_Q4_1536x8960=8,512,2,0" \
    --variant "default-again:"
}
stage_q4ready() {
  ONNXGEN_Q4_ROW_READY=1 run q4ready-parity 200 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py \
    tests/test_fusion.py -k "(matmul_nbits or int4_group or int8_group) and cuda"
  ONNXGEN_Q4_ROW_READY=1 run q4ready-capture 150 $PY -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu_capture_models.py -k int4
  # shellcheck disable=SC2086
  run q4ready-05b 200 $PY -m bench.step_sweep $Q --precision int4 --context 512 --repeats 3 --variant "default:" \
    --variant "ready:ONNXGEN_Q4_ROW_READY=1" \
    --variant "ready-gate-up-bytes:ONNXGEN_Q4_ROW_READY=1,ONNXGEN_GEMV_Q4_9728x896=16,1024,4,0" \
    --variant "default-again:" --variant "ready-again:ONNXGEN_Q4_ROW_READY=1"
  # shellcheck disable=SC2086
  run q4ready-15b 200 $PY -m bench.step_sweep $Q15 --precision int4 --context 512 --repeats 3 --variant "default:" \
    --variant "ready:ONNXGEN_Q4_ROW_READY=1" \
    --variant "ready-gate-up-bytes:ONNXGEN_Q4_ROW_READY=1,ONNXGEN_GEMV_Q4_17920x1536=16,2048,4,0" \
    --variant "default-again:" --variant "ready-again:ONNXGEN_Q4_ROW_READY=1"
  for s in "$Q" "$Q15"; do
    # shellcheck disable=SC2086
    run "q4ready-fp16-${s##*-coder-}" 100 $PY -m bench.step_sweep $s --precision fp16 --context 512 --repeats 3 \
      --variant "fp16:"
  done
}
stage_q4half() {
  run q4half-model 90 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_q4_half_kernel.py
  # shellcheck disable=SC2086
  run q4half-layers 90 $PY -m bench.q4_ceiling $Q15 --layer lm_head --layer gate_up --config 16,4 --config 32,8
  # shellcheck disable=SC2086
  run q4half-15b 240 $PY -m bench.step_sweep $Q15 --precision int4 --context 512 --repeats 3 \
    --variant "off:ONNXGEN_Q4_HALF=off" --variant "auto:" --variant "all:ONNXGEN_Q4_HALF=all" \
    --variant "off-again:ONNXGEN_Q4_HALF=off" --variant "auto-again:"
}
stage_q4halfcheck() {
  run q4half-parity 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py \
    tests/test_fusion.py -k "(matmul_nbits_4bit or int4_group) and cuda and not prompt"
  ONNXGEN_Q4_HALF=all run q4half-parity-all 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py \
    tests/test_fusion.py -k "(matmul_nbits_4bit or int4_group) and cuda and not prompt"
  run q4half-capture 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_capture_models.py -k int4
  # shellcheck disable=SC2086
  run q4half-05b 200 $PY -m bench.step_sweep $Q --precision int4 --context 512 --repeats 3 \
    --variant "off:ONNXGEN_Q4_HALF=off" --variant "auto:" --variant "all:ONNXGEN_Q4_HALF=all" \
    --variant "off-again:ONNXGEN_Q4_HALF=off" --variant "auto-again:"
}
stage_q4half05() {
  for s in "$Q" "$Q15"; do
    # shellcheck disable=SC2086
    run "q4half-fp16-${s##*-coder-}" 100 $PY -m bench.step_sweep $s --precision fp16 --context 512 --repeats 3 \
      --variant "fp16:"
  done
  # shellcheck disable=SC2086
  run q4half-anatomy 150 $PY -m bench.step_anatomy $Q15 --precision int4 --context 512 --kernels \
    --variant "off:ONNXGEN_Q4_HALF=off" --variant "auto:" --variant "half:ONNXGEN_Q4_HALF=all"
  # shellcheck disable=SC2086
  run q4half-micro 150 $PY -m bench.gemv_micro $Q15 --quick --words --half --layers qkv,o_proj,down
}
stage_q4stream() {
  run q4stream-model 90 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_q4_half_kernel.py
  ONNXGEN_Q4_STREAM=2 run q4stream-parity 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py \
    tests/test_fusion.py -k "(matmul_nbits_4bit or int4_group) and cuda and not prompt"
  for s in "$Q" "$Q15"; do
    # shellcheck disable=SC2086
    run "q4stream-${s##*-coder-}" 200 $PY -m bench.step_sweep $s --precision int4 --context 512 --repeats 3 \
      --variant "auto:" --variant "stream1:ONNXGEN_Q4_STREAM=1" --variant "stream2:ONNXGEN_Q4_STREAM=2" \
      --variant "stream4:ONNXGEN_Q4_STREAM=4" --variant "all-stream2:ONNXGEN_Q4_HALF=all,ONNXGEN_Q4_STREAM=2" \
      --variant "lm-head-stream2:ONNXGEN_GEMV_Q4_151936x896=16,1024,2,2,ONNXGEN_Q4_STREAM=2" \
      --variant "down64:ONNXGEN_GEMV_Q4_1536x8960=64,1024,4,2" --variant "ready:ONNXGEN_Q4_ROW_READY=1" \
      --variant "auto-again:" --variant "stream2-again:ONNXGEN_Q4_STREAM=2"
  done
}
stage_q4streamlayers() {
  run q4streamlayers-model 90 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_q4_half_kernel.py
  local g15=ONNXGEN_GEMV_Q4_17920x1536=8,2048,2,2 l15=ONNXGEN_GEMV_Q4_151936x1536=16,2048,4,2
  local l05=ONNXGEN_GEMV_Q4_151936x896=16,1024,2,2
  run q4streamlayers-1.5b 240 $PY -m bench.step_sweep $Q15 --precision int4 --context 512 --repeats 3 \
    --variant "auto:" --variant "stream4:ONNXGEN_Q4_STREAM=4" --variant "stream8:ONNXGEN_Q4_STREAM=8" \
    --variant "gate-up-s2:$g15,2" --variant "gate-up-s4:$g15,4" --variant "gate-up-s8:$g15,8" \
    --variant "lm-head-s2:$l15,2" --variant "lm-head-s4:$l15,4" --variant "lm-head-2w-s4:${l15%,4,2},2,2,4" \
    --variant "both-s4:$g15,4,$l15,4" --variant "half-off:ONNXGEN_Q4_HALF=off" --variant "auto-again:" --variant "stream4-again:ONNXGEN_Q4_STREAM=4"
  run q4streamlayers-0.5b 200 $PY -m bench.step_sweep $Q --precision int4 --context 512 --repeats 3 \
    --variant "auto:" --variant "stream8:ONNXGEN_Q4_STREAM=8" --variant "lm-head-pair:$l05,0" \
    --variant "lm-head-s2:$l05,2" --variant "lm-head-s4:$l05,4" --variant "lm-head-s6:$l05,6" \
    --variant "lm-head-8r-s4:${l05/16,/8,},4" --variant "half-off:ONNXGEN_Q4_HALF=off" --variant "auto-again:"
  for s in "$Q15" "$Q"; do
    # shellcheck disable=SC2086
    run "q4streamlayers-fp16-${s##*-coder-}" 150 $PY -m bench.step_sweep $s --precision fp16 --context 512 \
      --repeats 3 --variant "fp16:"
  done
}
stage_q4streamauto() {
  # shellcheck disable=SC2086
  run q4streamauto-0.5b 110 $PY -m bench.step_sweep $Q --precision int4 --context 512 --repeats 3 \
    --variant "auto:" --variant "tile:ONNXGEN_Q4_STREAM=0" --variant "gate-up-8r:ONNXGEN_GEMV_Q4_9728x896=8,1024,2,2" \
    --variant "auto-again:" --variant "tile-again:ONNXGEN_Q4_STREAM=0"
  # shellcheck disable=SC2086
  run q4streamauto-1.5b 150 $PY -m bench.step_sweep $Q15 --precision int4 --context 512 --repeats 3 \
    --variant "auto:" --variant "tile:ONNXGEN_Q4_STREAM=0" --variant "auto-again:" --variant "tile-again:ONNXGEN_Q4_STREAM=0"
}
stage_q4anatomy05() {
  run q4anatomy05-model 90 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_q4_half_kernel.py
  run q4anatomy05-parity 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py \
    tests/test_fusion.py -k "(matmul_nbits_4bit or int4_group) and cuda and not prompt"
  # shellcheck disable=SC2086
  run q4anatomy05-int4 130 $PY -m bench.step_anatomy $Q --precision int4 --context 512 --kernels \
    --variant "default:" --variant "half-all:ONNXGEN_Q4_HALF=all"
  # shellcheck disable=SC2086
  run q4anatomy05-fp16 90 $PY -m bench.step_anatomy $Q --precision fp16 --context 512 --kernels --variant "fp16:"
  # shellcheck disable=SC2086
  run q4anatomy05-micro 120 $PY -m bench.gemv_micro $Q --quick --words --half --layers qkv,o_proj,down
}
stage_q4postwait() {
  run q4postwait-model 90 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_q4_half_kernel.py
  run q4postwait-parity 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py \
    tests/test_fusion.py -k "(matmul_nbits_4bit or int4_group) and cuda and not prompt"
  postwait_steps qwen2.5-coder-0.5b-instruct 200
}
stage_q4postwait15() {
  postwait_steps qwen2.5-coder-1.5b-instruct 330
}
# postwait_steps SHAPE LIMIT: the int4 step under .trees/base, .trees/loads and this tree in turn, twice, on
# one package; then fp16's step
postwait_steps() {
  local s=$1 limit=$2
  run "q4postwait-build-${s##*-coder-}" 120 $PY -m bench.random_package --shape "$s" --precision int4 \
    --context 512 --out "/tmp/pw-$s"
  run "q4postwait-${s##*-coder-}" "$limit" bash bench/tree_ab.sh run 2 base,loads,head -- $PY -m bench.step_sweep \
    --package "/tmp/pw-$s" --context 512 --repeats 3 --variant "default:"
  run "q4postwait-fp16-${s##*-coder-}" 90 $PY -m bench.step_sweep --shape "$s" --precision fp16 --context 512 \
    --repeats 3 --variant "fp16:"
}
stage_q4onewarp() {
  # shellcheck disable=SC2086
  run q4onewarp-micro 150 $PY -m bench.gemv_micro $Q --quick --half --one-warp --layers qkv,o_proj,down
  local q05=ONNXGEN_GEMV_Q4_1152x896 o05=ONNXGEN_GEMV_Q4_896x896 g05=ONNXGEN_GEMV_Q4_9728x896
  local d05=ONNXGEN_GEMV_Q4_896x4864
  # shellcheck disable=SC2086
  run q4onewarp-0.5b 200 $PY -m bench.step_sweep $Q --precision int4 --context 512 --repeats 3 \
    --variant "auto:" --variant "short-pair-4x1:$q05=4,1024,1,2,$o05=4,1024,1,2" \
    --variant "short-pair-8x1:$q05=8,1024,1,2,$o05=8,1024,1,2" \
    --variant "short-byte-4x1:$q05=4,1024,1,0,$o05=4,1024,1,0" --variant "gate-up-8x1:$g05=8,1024,1,2" \
    --variant "down-8x1:$d05=8,512,1,0" --variant "down-4x1:$d05=4,512,1,0" --variant "auto-again:"
  local q15=ONNXGEN_GEMV_Q4_2048x1536 o15=ONNXGEN_GEMV_Q4_1536x1536 d15=ONNXGEN_GEMV_Q4_1536x8960
  # shellcheck disable=SC2086
  run q4onewarp-1.5b 240 $PY -m bench.step_sweep $Q15 --precision int4 --context 512 --repeats 3 \
    --variant "auto:" --variant "short-pair-4x1:$q15=4,2048,1,2,$o15=4,2048,1,2" \
    --variant "short-pair-8x1:$q15=8,2048,1,2,$o15=8,2048,1,2" --variant "down-8x1:$d15=8,1024,1,2" \
    --variant "auto-again:"
}
stage_q8() {
  run q8-parity 200 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_contrib.py tests/test_fusion.py \
    -k "(8bit or int8_group or 2bit or no_dequantized or prompt_gemm) and cuda"
  run q8-micro-05b 150 $PY -m bench.gemv_micro $Q --quick --bits 8 --prompt-rows 16
  run q8-micro-15b 150 $PY -m bench.gemv_micro $Q15 --quick --bits 8 --prompt-rows 16
}
stage_memorypeers() {
  run memorypeers-15b 200 $PY -m bench.peers_decode $Q15 --precision int4 --workdir /tmp/w15 \
    --engines onnxgen,ort-genai-graph,ort-genai
  run memorypeers-05b 150 $PY -m bench.peers_decode $Q --precision int4 --workdir /tmp/w05 \
    --engines onnxgen,ort-genai-graph,ort-genai
}
stage_micro() {
  run micro 150 $PY -m bench.gemv_micro --quick
}

STAGES="tests decode verify long standard qwen15 llamacpp peers peers15 table generator anatomy profile micro int4 prefill hybrid fold q4prompt q4ttft ttftgap moe moedecode ttft08 pieces cutoffs gdnchunk memory memorypeers q4sym zerobytes q4long moezero q4rows q4half q4half05 q4halfcheck q4stream q4streamlayers q4streamauto q4anatomy05 q4postwait q4postwait15 q4onewarp q4chunk q4overlap q4overlapcheck q8 sampled"
if [ $# -eq 0 ]; then
  echo "usage: bash bench/h200.sh STAGE [STAGE ...]   (stages: $STAGES; the header of bench/h200.sh says what each runs)"
  exit 2
fi
for name in "$@"; do
  [[ " $STAGES " == *" $name "* ]] || { echo "unknown stage $name (stages: $STAGES)" >&2; exit 2; }
done
mkdir -p "$out"
for name in "$@"; do "stage_$name"; done
echo "logs in $out"
