#!/usr/bin/env bash
# One GPU session: tests on the GPU, then the benchmark suite's steps; each step writes
# its log and JSON (figures with the run's environment) under $OUT. Run from the
# repository root. Figures go to benchmarks/RESULTS.md (the step named beside each).
#
# Usage: OUT=results_dir bash benchmarks/gpu_session.sh [STEP ...]   (default: tests kernels profile bench)
# Steps: tests tests32 moe-tests quant-tests | kernels gemms moe-kernels attention prefill-lora |
#        profile breakdown prefill mixed | bench qwen3-moe gpt-oss cold |
#        adapter-load interference slot-load | train-moe train-quant train-gpt-oss train-breakdown train-profile |
#        prefix structured | gpt-oss-mxfp4 qwen3-fp8 qwen3-w8a8 llama-awq breakdown-quant quant-launches |
#        tune-int4 tune-fp8 gemms-int4 |
#        spec-cost | pdl | down-terms | mxfp4-scales int4-scales e2m1-words gate-up-beside router rotate-store align |
#        routing (CPU only: the routing simulation) | replicas-one replicas-ray (ray[serve] installed) |
#        tp (two GPUs or more) | deepseek breakdown-deepseek prefill-deepseek spec-deepseek
# Model directories and random adapters are kept in $LORAPLEX_BENCH_CACHE
# (default ~/.cache/loraplex/bench), shared by the scripts and `loraplex bench`.
set -u
OUT=${OUT:-./gpu-results}; mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export LORAPLEX_BENCH_CACHE=${LORAPLEX_BENCH_CACHE:-$HOME/.cache/loraplex/bench}
CACHE=$LORAPLEX_BENCH_CACHE
STEPS=${*:-tests kernels profile bench}
# The test suite's packages the machine lacks (fastapi, uvicorn, openai, schemathesis, ...),
# where a wheel directory came along (machines without internet)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl 2>&1 | tail -2 && export PYTHONPATH=src:/tmp/site
fi
# Test workers: pytest-xdist where it is installed.
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run() {  # run LOG SECONDS NAME ARGS...: python3 -m benchmarks.NAME ARGS..., its output (no warnings) in $OUT/LOG.txt
  local log=$1 secs=$2 name=$3; shift 3
  timeout "$secs" python3 -m "benchmarks.$name" "$@" 2>&1 | grep -v -i warn | grep -v "it/s" | tee "$OUT/$log.txt"
}
for step in $STEPS; do
  echo "=== $step"
  case $step in
    tests)
      LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=bfloat16 timeout 570 python3 -m pytest -q $XDIST \
        -p no:cacheprovider 2>&1 | tail -60 > "$OUT/tests-bf16.log"; tail -25 "$OUT/tests-bf16.log" ;;
    tests32)
      LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=float32 timeout 400 python3 -m pytest -x -q \
        -p no:cacheprovider 2>&1 | tail -25 > "$OUT/tests-fp32.log"; tail -5 "$OUT/tests-fp32.log" ;;
    moe-tests)
      LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=bfloat16 timeout 570 python3 -m pytest -x -q \
        -p no:cacheprovider tests/test_moe_ops.py tests/test_moe.py tests/test_gpt_oss.py \
        2>&1 | tail -25 > "$OUT/moe-tests.log"; tail -5 "$OUT/moe-tests.log" ;;
    quant-tests)  # quantized bases and the request surface (prefix cache, sampling, structured, tools)
      LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=bfloat16 timeout 400 python3 -m pytest -q $XDIST \
        -p no:cacheprovider tests/test_quant_fp8.py tests/test_quant_w8a8.py tests/test_quant_int4.py tests/test_quant_mxfp4.py \
        tests/test_quant_moe_kernels.py tests/test_quantized.py tests/test_prefix_cache.py \
        tests/test_sampling_surface.py tests/test_structured_outputs.py tests/test_tools.py -k "not gemma" \
        --tb=short > "$OUT/quant-tests.log" 2>&1; grep -E "^(FAILED|ERROR|E  )" "$OUT/quant-tests.log" | head -30
      tail -1 "$OUT/quant-tests.log" ;;
    kernels)  # RESULTS: "LoRA kernels against their floors", "Adapter kernels in a decode step"
      run kernels 300 kernels --out "$OUT/kernels.json" | tail -60 ;;
    gemms)  # RESULTS: "Base GEMMs"
      run gemms 300 base_gemms --out "$OUT/gemms.json" ;;
    gemms-int4)  # RESULTS: "Llama-3.1-8B AWQ int4" (the int4 GEMMs: this GPU's configs against the defaults)
      run gemms-int4 300 base_gemms --quantization awq --tokens 1 16 32 64 --out "$OUT/gemms-int4.json" ;;
    moe-kernels)  # RESULTS: "One MoE layer", "Expert adapters in decode"
      run moe-kernels 400 moe_kernels --tokens 1 16 64 2048 8192 --out "$OUT/moe-kernels.json" \
        | grep -v "^ " ;;
    prefill-quant)  # RESULTS: "Prefill of quantized experts" (the quantized GEMM against dequantized + bf16)
      run prefill-quant 300 moe_kernels --sections prefill-quant --tokens 256 512 1024 2048 4096 8192 \
        --out "$OUT/prefill-quant.json" ;;
    pdl)  # RESULTS: "Programmatic dependent launch" (the probe, then decode graphs without and with it)
      run pdl-probe 120 pdl_probe --out "$OUT/pdl-probe.json"
      for pdl in 0 1; do
        export LORAPLEX_PDL=$pdl
        run pdl-qwen3-w8a8-$pdl 200 decode_breakdown --model qwen3-30b-a3b --quantization fp8 \
          --fp8-activations dynamic --batch 16 --prompt-len 1600 --adapters 0 \
          --out "$OUT/pdl-qwen3-w8a8-$pdl.json" | grep -E "decode graph"
        run pdl-gpt-oss-$pdl 200 decode_breakdown --model gpt-oss-20b --quantization mxfp4 --batch 16 \
          --prompt-len 1600 --adapters 16 --expert-adapters --lora-targets q_proj k_proj v_proj o_proj experts \
          --out "$OUT/pdl-gpt-oss-$pdl.json" | grep -E "decode graph"
        run pdl-llama-awq-$pdl 150 decode_breakdown --model llama-3.1-8b --quantization awq --batch 32 \
          --prompt-len 512 --adapters 32 --out "$OUT/pdl-llama-awq-$pdl.json" | grep -E "decode graph"
      done
      unset LORAPLEX_PDL ;;
    attention)  # RESULTS: "Decode attention"
      run attention 400 attention_sweep --out "$OUT/attention.json" ;;
    prefill-lora)  # RESULTS: "LoRA kernels in a step with prefill tokens"
      run prefill-lora 300 prefill_lora --out "$OUT/prefill-lora.json" | tail -3
      run prefill-lora-act 200 prefill_lora --act-only --tokens 1536 --chunks 3 --decodes 28 \
        --out "$OUT/prefill-lora-act.json" ;;
    profile)  # RESULTS: "One decode step"
      run profile 300 profile_decode --out "$OUT/profile.json" | grep -E "engine step|by part|Self CUDA" ;;
    breakdown)  # RESULTS: "A decode step op by op" (the bench's MoE shapes; routing stats on, as there)
      run breakdown-qwen3 200 decode_breakdown --model qwen3-30b-a3b --batch 16 --prompt-len 1600 \
        --adapters 16 --expert-adapters --routing-stats ${BD_ARGS:-} --out "$OUT/breakdown-qwen3.json" | tail -70
      run breakdown-gpt-oss 150 decode_breakdown --model gpt-oss-20b --batch 16 --prompt-len 1600 \
        --adapters 16 --expert-adapters --routing-stats ${BD_ARGS:-} --out "$OUT/breakdown-gpt-oss.json" | tail -70
      run breakdown-llama 150 decode_breakdown --model llama-3.1-8b --batch 32 --prompt-len 512 \
        --adapters 32 ${BD_ARGS:-} --out "$OUT/breakdown-llama.json" | tail -50 ;;
    breakdown-deepseek)  # DeepSeek-V2-Lite's decode op by op, the bench's adapters (attention, MLPs, experts)
      run breakdown-deepseek 200 decode_breakdown --model deepseek-v2-lite --batch 16 --prompt-len 1600 \
        --adapters 16 --expert-adapters --routing-stats --random-prompts --lora-targets q_proj kv_a_proj_with_mqa kv_b_proj \
        o_proj gate_proj up_proj down_proj ${BD_ARGS:-} --out "$OUT/breakdown-deepseek.json" | tail -70 ;;
    prefill-deepseek)  # the kernels of one 6,400-token prompt step of DeepSeek-V2-Lite, base and 16 adapters
      run prefill-deepseek 200 prefill_kernels --model deepseek-v2-lite --batch 4 --prompt-len 1600 \
        --adapters 16 --expert-adapters --lora-targets q_proj kv_a_proj_with_mqa kv_b_proj o_proj gate_proj \
        up_proj down_proj --out "$OUT/prefill-deepseek.json" | tail -60 ;;
    breakdown-quant)  # quantized experts' decode op by op: gpt-oss-20b MXFP4; Qwen3-30B-A3B FP8 with the
      # GEMV form (its default at 16 tokens: 128 pairs on 128 experts) and with the grouped GEMM
      for spec in "gpt-oss-20b mxfp4 1" "qwen3-30b-a3b fp8 1" "qwen3-30b-a3b fp8 0.5"; do
        set -- $spec
        run breakdown-$2-g$3 150 decode_breakdown --model $1 --quantization $2 --batch 16 --prompt-len 1600 \
          --adapters 0 --gemv-pairs-per-expert $3 --out "$OUT/breakdown-$2-g$3.json" \
          | grep -E "decode graph|moe\.|fused_experts|paged_att|linear\." | head -12
      done ;;
    quant-launches)  # Qwen3-30B-A3B W8A8's decode step with and without its activations' quantization
      # launches (--without-activation-quant: the bound of fusing them into the kernels that write them)
      for flag in "" --without-activation-quant; do
        run quant-launches${flag:+-without} 200 decode_breakdown --model qwen3-30b-a3b --quantization fp8 \
          --fp8-activations dynamic --batch 16 --prompt-len 1600 --adapters 0 $flag \
          --out "$OUT/quant-launches${flag:+-without}.json" | grep -E "decode graph|moe\.|linear\." | head -8
      done ;;
    down-terms)  # RESULTS: "The expert adapters' down deltas beside the down GEMM" (decode graphs with
      # 16 adapters, the down deltas as terms of the sum and in the GEMM's epilogue; Qwen3 W8A8, gpt-oss MXFP4)
      for flag in "" --down-delta-in-epilogue; do
        run down-terms-qwen3${flag:+-epilogue} 200 decode_breakdown --model qwen3-30b-a3b --quantization fp8 \
          --fp8-activations dynamic --batch 16 --prompt-len 1600 --adapters 16 --expert-adapters \
          --lora-targets q_proj k_proj v_proj o_proj experts $flag \
          --out "$OUT/down-terms-qwen3${flag:+-epilogue}.json" | grep -E "decode graph"
        run down-terms-gpt-oss${flag:+-epilogue} 200 decode_breakdown --model gpt-oss-20b --quantization mxfp4 \
          --batch 16 --prompt-len 1600 --adapters 16 --expert-adapters \
          --lora-targets q_proj k_proj v_proj o_proj experts $flag \
          --out "$OUT/down-terms-gpt-oss${flag:+-epilogue}.json" | grep -E "decode graph"
      done ;;
    mxfp4-scales)  # RESULTS: "Scales in the K loop's pipeline" (gpt-oss's decode graphs, base and 16
      # adapters, scale rows padded (whole steps, pipelined) and unpadded (masked byte loads))
      for flag in "" --unpadded-scales; do
        run mxfp4-scales${flag:+-unpadded} 200 decode_breakdown --model gpt-oss-20b --quantization mxfp4 \
          --batch 16 --prompt-len 1600 --adapters 16 --expert-adapters \
          --lora-targets q_proj k_proj v_proj o_proj experts $flag \
          --out "$OUT/mxfp4-scales${flag:+-unpadded}.json" | grep -E "decode graph|moe_gemm_quant"
      done ;;
    e2m1-words)  # RESULTS: "e2m1 words" (gpt-oss's decode graphs, base and 16 adapters; with
      # BEFORE_SRC=<an older checkout's src>, also on that source: the A/B on one machine)
      for src in src ${BEFORE_SRC:-}; do
        tag=$([ "$src" = src ] && echo words || echo before)
        PYTHONPATH=$src:.:${PYTHONPATH#src:} run e2m1-$tag 200 decode_breakdown --model gpt-oss-20b \
          --quantization mxfp4 --batch 16 --prompt-len 1600 --adapters 16 --expert-adapters \
          --lora-targets q_proj k_proj v_proj o_proj experts --out "$OUT/e2m1-$tag.json" \
          | grep -E "decode graph|moe_gemm_quant"
      done ;;
    gate-up-beside)  # RESULTS: "The gate/up delta beside the gate/up GEMM" (decode graphs with 16
      # adapters, the delta's kernel beside the GEMM where gate_up_delta_beside says, and before it)
      for flag in "" --gate-up-delta-first; do
        run gate-up-qwen3${flag:+-first} 200 decode_breakdown --model qwen3-30b-a3b --quantization fp8 \
          --fp8-activations dynamic --batch 16 --prompt-len 1600 --adapters 16 --expert-adapters $flag \
          --out "$OUT/gate-up-qwen3${flag:+-first}.json" | grep -E "decode graph|moe_lora"
      done
      # gpt-oss-20b MXFP4 (delta first by default), beside with the default and a lighter
      # expert-LoRA program (4 warps, 4,096-element tiles: room beside 3 GEMM programs an SM)
      for flags in "" "--gate-up-delta-beside" "--gate-up-delta-beside --expert-lora-gemv 4 4096 4096"; do
        tag=$(echo "$flags" | tr -d ' -' | cut -c1-40)
        run gate-up-gpt-oss${tag:+-$tag} 200 decode_breakdown --model gpt-oss-20b --quantization mxfp4 \
          --batch 16 --prompt-len 1600 --adapters 16 --expert-adapters \
          --lora-targets q_proj k_proj v_proj o_proj experts $flags \
          --out "$OUT/gate-up-gpt-oss${tag:+-$tag}.json" | grep -E "decode graph|moe_lora"
      done ;;
    router)  # RESULTS: "The router in one launch" (the kernel's configs against the GEMM and
      # route_experts, then gpt-oss-20b MXFP4's base decode graph both ways)
      run router 300 moe_kernels --sections router --tokens 16 64 --out "$OUT/router.json" | grep -E "GEMM|config"
      for flag in "" --router-gemm; do
        run router-graph${flag:+-gemm} 200 decode_breakdown --model gpt-oss-20b --quantization mxfp4 --batch 16 \
          --prompt-len 1600 --adapters 0 $flag --out "$OUT/router-graph${flag:+-gemm}.json" | grep -E "decode graph|rout"
      done ;;
    align)  # RESULTS: "The alignment in parallel" (both forms alone, then gpt-oss-20b MXFP4's
      # prompt step's kernels with 8 adapters)
      run align 300 moe_kernels --sections align --tokens 16 64 256 512 1024 2048 8000 \
        --out "$OUT/align.json" | grep -E "align by"
      run align-prefill 200 prefill_kernels --model gpt-oss-20b --quantization mxfp4 --batch 5 --prompt-len 1600 \
        --adapters 8 --expert-adapters --lora-targets q_proj k_proj v_proj o_proj experts \
        --out "$OUT/align-prefill.json" | grep -E "kernels|align|_moe_gemm_kernel" ;;
    rotate-store)  # RESULTS: "Rotary and the KV write in one launch" (gpt-oss-20b MXFP4's decode
      # graphs, base and 16 adapters, one launch and two)
      for flag in "" --unfused-rotary; do
        run rotate-store${flag:+-unfused} 200 decode_breakdown --model gpt-oss-20b --quantization mxfp4 \
          --batch 16 --prompt-len 1600 --adapters 16 --expert-adapters \
          --lora-targets q_proj k_proj v_proj o_proj experts $flag \
          --out "$OUT/rotate-store${flag:+-unfused}.json" | grep -E "decode graph"
      done ;;
    int4-scales)  # RESULTS: "Scales in the K loop's pipeline" (Llama-3.1-8B AWQ's decode graphs, 32 in
      # flight, base and 32 adapters: (scale, zero) words copied ahead, and 2-byte loads in the loop)
      for flag in "" --unpaired-int4-scales; do
        run int4-scales${flag:+-unpaired} 200 decode_breakdown --model llama-3.1-8b --quantization awq \
          --batch 32 --prompt-len 512 --adapters 32 $flag \
          --out "$OUT/int4-scales${flag:+-unpaired}.json" | grep -E "decode graph|linear\."
      done ;;
    prefill)  # RESULTS: "Steps with prefill tokens"
      run prefill 300 profile_prefill --out "$OUT/prefill.json" | grep -E "^\[|host us" ;;
    mixed)  # RESULTS: "Mixed steps"
      run mixed 400 mixed_steps --tokens 512 1024 1488 1536 2048 --out "$OUT/mixed.json" ;;
    bench)  # RESULTS: "Llama-3.1-8B, 32 adapters"
      timeout 500 python3 -m loraplex.entrypoints.cli bench --model llama-3.1-8b --num-adapters 0 32 \
        --max-num-batched-tokens ${CHUNK:-2048} \
        --num-prompts ${PROMPTS:-512} --max-concurrency 32 --input-len 512 --output-len 128 \
        --cache-dir "$CACHE" --result-json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 \
        | grep -v "it/s" > "$OUT/bench.txt"; tail -6 "$OUT/bench.txt" ;;
    qwen3-moe)  # RESULTS: "Qwen3-30B-A3B, 16 adapters" (16 in flight, 1600 in / 600 out, adapters on attention + experts)
      timeout 560 python3 -m loraplex.entrypoints.cli bench --model qwen3-30b-a3b --num-adapters 0 16 \
        --lora-targets q_proj k_proj v_proj o_proj experts --num-prompts ${PROMPTS:-32} \
        --max-concurrency 16 --input-len 1600 --output-len 600 --cache-dir "$CACHE" \
        --result-json "$OUT/qwen3-moe.json" 2>&1 | grep -v "it/s" > "$OUT/qwen3-moe.txt"; tail -8 "$OUT/qwen3-moe.txt" ;;
    gpt-oss)  # RESULTS: "gpt-oss-20b, 16 adapters"
      timeout 560 python3 -m loraplex.entrypoints.cli bench --model gpt-oss-20b --num-adapters 0 16 \
        --lora-targets q_proj k_proj v_proj o_proj experts --num-prompts ${PROMPTS:-32} \
        --max-concurrency 16 --input-len 1600 --output-len 600 --cache-dir "$CACHE" \
        --result-json "$OUT/gpt-oss.json" 2>&1 | grep -v "it/s" > "$OUT/gpt-oss.txt"; tail -8 "$OUT/gpt-oss.txt" ;;
    deepseek)  # RESULTS: "DeepSeek-V2-Lite, 16 adapters" (the latent-attention tests in bf16 first; the
      # bench reports distinct experts per decode step; the cache holds 27 x 576 values a token)
      LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=bfloat16 timeout 200 python3 -m pytest -q -p no:cacheprovider \
        tests/test_mla_ops.py tests/test_deepseek.py --tb=short > "$OUT/deepseek-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|E  )" "$OUT/deepseek-tests.log" | head -20; tail -1 "$OUT/deepseek-tests.log"
      # (TARGETS=1: then with slots on the adapters' modules alone, --lora-target-modules)
      T=(q_proj kv_a_proj_with_mqa kv_b_proj o_proj gate_proj up_proj down_proj experts)
      VARIANTS=("")
      [ -n "${TARGETS:-}" ] && VARIANTS+=("--lora-target-modules ${T[*]}")
      for only in "${VARIANTS[@]}"; do
        name=deepseek${only:+-targets}
        timeout 280 python3 -m loraplex.entrypoints.cli bench --model deepseek-v2-lite --num-adapters 0 16 \
          --lora-targets "${T[@]}" $only --num-prompts ${PROMPTS:-32} --max-concurrency 16 --input-len 1600 \
          --output-len 600 --cache-dir "$CACHE" --result-json "$OUT/$name.json" 2>&1 | grep -v "it/s" > "$OUT/$name.txt"
        grep -E "^\| deepseek|distinct|TPOT median" "$OUT/$name.txt" | tail -5
      done ;;
    spec-deepseek)  # LOG.md "DeepSeek V3's speculation test on a GPU": speculation against plain
      # decoding on the V3 variants, Triton kernels in float32 and bf16, the torch ops in bf16
      for mode in "float32 auto" "bfloat16 auto" "bfloat16 torch"; do
        set -- $mode
        LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=$1 LORAPLEX_TEST_BACKEND=$2 timeout 200 python3 -m pytest \
          -p no:cacheprovider -rfE --tb=short tests/test_deepseek.py -k "speculation and v3" \
          > "$OUT/spec-deepseek-$1-$2.log" 2>&1
        echo "$1 $2: $(grep -E "^(FAILED|ERROR)" "$OUT/spec-deepseek-$1-$2.log" | head -3) $(tail -1 "$OUT/spec-deepseek-$1-$2.log")"
      done ;;
    cold)  # RESULTS: "1,000 cold adapters" (registry; the step profile says where time goes)
      # (COLD_ARGS=--sample-stacks adds where the engine thread is, at a cost: its sampler
      # thread takes the GIL, and the run slows by ~10%)
      timeout 560 python3 -m loraplex.entrypoints.cli bench --model llama-3.1-8b --num-adapters 0 1000 \
        --adapter-dist uniform zipf --cold-adapters --adapter-registry --max-loras 32 --max-cpu-loras 128 \
        --max-cpu-lora-memory 16 --num-prompts 512 --max-concurrency 32 --input-len 512 --output-len 128 \
        --max-num-batched-tokens 2048 ${COLD_ARGS:-} --cache-dir "$CACHE" --result-json "$OUT/cold.json" 2>&1 \
        | grep -v "it/s" > "$OUT/cold.txt"; tail -40 "$OUT/cold.txt" ;;
    replicas-one|replicas-ray)  # RESULTS: "Replicas on one GPU" (Llama-3.1-8B, 32 adapters, over HTTP)
      M=$CACHE/llama-3.1-8b
      ls -d "$CACHE"/llama-3.1-8b-adapters-r16-*/adapter-31 >/dev/null 2>&1 || \
        timeout 300 python3 -m loraplex.entrypoints.cli bench --model llama-3.1-8b --num-adapters 32 \
          --num-prompts 64 --max-concurrency 32 --input-len 512 --output-len 128 \
          --max-num-batched-tokens 2048 --cache-dir "$CACHE" 2>&1 | grep -v "it/s" | tail -3
      MODS=(); NAMES=()
      for i in $(seq 0 31); do
        MODS+=("a$i=$(ls -d "$CACHE"/llama-3.1-8b-adapters-r16-*/adapter-$i | head -1)"); NAMES+=("a$i")
      done
      if [ "$step" = replicas-one ]; then NAME=one PORT=8100 EXTRA=()
      else  # REPLICAS=1 GPUS=1 UTIL=0.9: one replica on the whole GPU, behind the ingress
        NAME=ray${REPLICAS:-2} PORT=8200
        EXTRA=(--replicas ${REPLICAS:-2} --gpus-per-replica ${GPUS:-0.5} --gpu-memory-utilization ${UTIL:-0.42})
      fi
      python3 -m loraplex.entrypoints.cli serve "$M" --load-format dummy --max-loras 32 --max-cpu-loras 64 \
        --max-num-batched-tokens 2048 --max-model-len 2048 --port $PORT --lora-modules "${MODS[@]}" \
        "${EXTRA[@]}" > "$OUT/replicas-$NAME-server.txt" 2>&1 &
      SERVER=$!
      for _ in $(seq 400); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
      for adapters in 0 32; do
        LORAS=(); [ $adapters = 32 ] && LORAS=(--lora-modules "${NAMES[@]}")
        timeout 300 python3 -m loraplex.entrypoints.cli bench --model "$M" --base-url http://127.0.0.1:$PORT \
          "${LORAS[@]}" --num-prompts ${PROMPTS:-512} --max-concurrency 32 --input-len 512 --output-len 128 \
          --result-json "$OUT/replicas-$NAME-$adapters.json" 2>&1 | grep -v "it/s" | tail -8 \
          | tee "$OUT/replicas-$NAME-$adapters.txt"
      done
      kill -INT $SERVER; wait $SERVER ;;
    routing)  # RESULTS: "Replica routing (simulated)" (CPU: loraplex's router over simulated engines)
      run routing 900 replica_routing --out "$OUT/routing.json" ;;
    adapter-load)  # RESULTS: "Adapter loads" (96 random Llama-3.1-8B adapters, no engine)
      run adapter-load 300 adapter_load --generate 96 --out "$OUT/adapter-load.json" ;;
    interference)  # RESULTS: "Loader threads beside the engine thread"
      run interference 200 loader_interference --threads 1 2 8 --out "$OUT/interference.json" | tail -12 ;;
    slot-load)  # RESULTS: "Slot loads"
      run slot-load 100 slot_load --out "$OUT/slot-load.json" ;;
    train-moe)  # RESULTS: "Training: LoRA on MoE experts" (one step, Qwen3-30B-A3B-shaped layers, vs PEFT)
      run train-moe 400 train_moe --layers 2 --seq-lens 1024 4096 16384 --repeats 10 \
        --sides loraplex loraplex-graph peft --out "$OUT/train-moe.json" | tail -14
      run train-moe-only 200 train_moe --layers 2 --seq-lens 1024 4096 16384 --moe-only --repeats 15 \
        --sides loraplex peft \
        --out "$OUT/train-moe-only.json" | tail -8 ;;
    train-quant)  # RESULTS: "Training whole models" (gpt-oss-20b from MXFP4: peak memory, step time)
      run train-quant 400 train_model --model gpt-oss-20b --quantization mxfp4 --seq-lens ${SEQ:-1024 4096} \
        --rank ${RANK:-16} --out "$OUT/train-quant.json"
      LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=bfloat16 timeout 300 python3 -m pytest -q -p no:cacheprovider \
        tests/test_train_quantized.py --tb=short > "$OUT/train-quant-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|E  )" "$OUT/train-quant-tests.log" | head -20; tail -1 "$OUT/train-quant-tests.log" ;;
    train-gpt-oss)  # RESULTS: "Training whole models" (gpt-oss-20b bf16, loraplex vs transformers + PEFT)
      run train-gpt-oss 500 train_model --model gpt-oss-20b --quantization none --peft --repeats 2 \
        --seq-lens ${SEQ:-4096 16384} --out "$OUT/train-gpt-oss.json" ;;
    train-breakdown)  # one MoE layer's primitives at 16K tokens, eager vs fused kernels
      run train-breakdown 200 train_moe --breakdown --seq-lens ${SEQ:-16384} | tail -30 ;;
    train-profile)  # kernel tables of the MoE-only step at 16K tokens, loraplex and PEFT
      run train-profile 300 train_moe --layers 2 --seq-lens ${SEQ:-16384} --profile > /dev/null
      grep -A 14 "===" "$OUT/train-profile.txt" ;;
    prefix)  # RESULTS: "Prefix caching" (32 adapters, each with its own 2,000-token prefix)
      for mode in enable no-enable; do
        timeout ${PREFIX_TIMEOUT:-280} python3 -m loraplex.entrypoints.cli bench --model llama-3.1-8b --num-adapters 32 \
          --dataset-name prefix_repetition --prefix-repetition-prefix-len 2000 \
          --prefix-repetition-suffix-len 200 --prefix-repetition-output-len 128 --num-prompts 256 \
          --max-concurrency 32 --max-num-batched-tokens 8192 --$mode-prefix-caching --cache-dir "$CACHE" \
          --result-json "$OUT/prefix-$mode.json" 2>&1 | grep -v "it/s" > "$OUT/prefix-$mode.txt"
        grep -E "^\| llama|prefix cache" "$OUT/prefix-$mode.txt" | tail -2
      done ;;
    structured)  # RESULTS: "Structured outputs" (a real 262K vocabulary: Gemma 3's tokenizer)
      mkdir -p /tmp/gemma-tok && cp .assets/gemma-tokenizer/* /tmp/gemma-tok/ && gunzip -f /tmp/gemma-tok/*.gz
      run structured 300 structured_outputs --tokenizer /tmp/gemma-tok --cache-dir "$CACHE" \
        --out "$OUT/structured.json" | tail -3 ;;
    gpt-oss-mxfp4)  # RESULTS: "gpt-oss-20b MXFP4" (the published format; 16 adapters of rank 16, then
      # the reference workload: 8 adapters of rank 32)
      timeout 300 python3 -m loraplex.entrypoints.cli bench --model gpt-oss-20b --quantization mxfp4 \
        --num-adapters 0 16 --lora-targets q_proj k_proj v_proj o_proj experts --num-prompts ${PROMPTS:-64} \
        --max-concurrency 16 --input-len 1600 --output-len 600 --cache-dir "$CACHE" \
        --result-json "$OUT/gpt-oss-mxfp4.json" 2>&1 | grep -v "it/s" > "$OUT/gpt-oss-mxfp4.txt"
      grep -E "^\| gpt|GiB|distinct" "$OUT/gpt-oss-mxfp4.txt" | tail -6
      timeout 200 python3 -m loraplex.entrypoints.cli bench --model gpt-oss-20b --quantization mxfp4 \
        --num-adapters 8 --lora-rank 32 --lora-targets q_proj k_proj v_proj o_proj experts \
        --num-prompts ${PROMPTS:-64} --max-concurrency 16 --input-len 1600 --output-len 600 --cache-dir "$CACHE" \
        --result-json "$OUT/gpt-oss-mxfp4-ref.json" 2>&1 | grep -v "it/s" > "$OUT/gpt-oss-mxfp4-ref.txt"
      grep -E "^\| gpt" "$OUT/gpt-oss-mxfp4-ref.txt" | tail -1 ;;
    qwen3-fp8)  # RESULTS: "Qwen3-30B-A3B FP8" (bf16 base in the same run, then FP8 base + 16 adapters)
      for q in "" fp8; do
        timeout 280 python3 -m loraplex.entrypoints.cli bench --model qwen3-30b-a3b ${q:+--quantization $q} \
          --num-adapters 0 ${q:+16} --lora-targets q_proj k_proj v_proj o_proj experts \
          --num-prompts ${PROMPTS:-32} --max-concurrency 16 --input-len 1600 --output-len 600 --cache-dir "$CACHE" \
          --result-json "$OUT/qwen3-${q:-bf16}.json" 2>&1 | grep -v "it/s" > "$OUT/qwen3-${q:-bf16}.txt"
        grep -E "^\| qwen|GiB" "$OUT/qwen3-${q:-bf16}.txt" | tail -4
      done ;;
    qwen3-w8a8)  # RESULTS: "Qwen3-30B-A3B FP8": W8A8 (--fp8-activations ${ACTS:-dynamic}), base + 16 adapters
      timeout 280 python3 -m loraplex.entrypoints.cli bench --model qwen3-30b-a3b --quantization fp8 \
        --fp8-activations ${ACTS:-dynamic} --num-adapters 0 16 --lora-targets q_proj k_proj v_proj o_proj experts \
        --num-prompts ${PROMPTS:-32} --max-concurrency 16 --input-len 1600 --output-len 600 --cache-dir "$CACHE" \
        --result-json "$OUT/qwen3-w8a8-${ACTS:-dynamic}.json" 2>&1 | grep -v "it/s" > "$OUT/qwen3-w8a8-${ACTS:-dynamic}.txt"
      grep -E "^\| qwen|GiB" "$OUT/qwen3-w8a8-${ACTS:-dynamic}.txt" | tail -3 ;;
    llama-awq)  # RESULTS: "Llama-3.1-8B AWQ int4" (bf16 base in the same run, then int4 base + 32 adapters)
      for q in "" awq; do
        timeout 250 python3 -m loraplex.entrypoints.cli bench --model llama-3.1-8b ${q:+--quantization $q} \
          --num-adapters 0 ${q:+32} --num-prompts ${PROMPTS:-256} --max-concurrency 32 --input-len 512 \
          --output-len 128 --cache-dir "$CACHE" --result-json "$OUT/llama-${q:-bf16}.json" 2>&1 \
          | grep -v "it/s" > "$OUT/llama-${q:-bf16}.txt"
        grep -E "^\| llama|GiB" "$OUT/llama-${q:-bf16}.txt" | tail -4
      done ;;
    tune-int4)  # the W4A16 GEMM's configs for this GPU at Llama-3.1-8B's projections, into $OUT/configs
      # (TUNE_SIZES token counts; ~2-3 min each); `LORAPLEX_MOE_CONFIG_DIR=$OUT/configs` then benches with them
      timeout 570 python3 -m loraplex.entrypoints.cli tune --model llama-3.1-8b --quantization awq \
        --batch-sizes ${TUNE_SIZES:-32} --out "$OUT/configs" --cache-dir "$CACHE" 2>&1 \
        | grep -E "wrote|N=" | tail -20 ;;
    tune-fp8)  # the FP8 dense GEMM's configs (split K tried at decode sizes) at Qwen3-30B-A3B's o and
      # q/k/v, weight-only, into $OUT/configs (TUNE_SIZES token counts); then LORAPLEX_MOE_CONFIG_DIR=$OUT/configs
      timeout 570 python3 -c "import sys, torch; from loraplex.bench import tune_fp8
tune_fp8.tune([(2048, 4096), (5120, 2048)], 128, torch.bfloat16, [int(t) for t in sys.argv[1:]], '$OUT/configs')" \
        ${TUNE_SIZES:-8 16 32 64} 2>&1 | grep -E "wrote|N=" | tail -20 ;;
    tp)  # RESULTS: "Tensor parallel" (two GPUs or more; TP_PARTS picks): the TP tests in bf16, Llama-3.1-8B
      # TP=1 vs TP=2 at 64 in flight, Llama-3.1-70B TP=2 base and 32 adapters of rank 16 at 32 in flight
      for part in ${TP_PARTS:-tests 8b 70b}; do case $part in
      tests) LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=bfloat16 timeout 300 python3 -m pytest -q \
          -p no:cacheprovider tests/test_tensor_parallel.py --tb=short > "$OUT/tp-tests.log" 2>&1
        grep -E "^(FAILED|ERROR|E  )" "$OUT/tp-tests.log" | head -20; tail -1 "$OUT/tp-tests.log" ;;
      8b) for tp in 1 2; do
          timeout 300 python3 -m loraplex.entrypoints.cli bench --model llama-3.1-8b --tensor-parallel-size $tp \
            --num-adapters 0 32 --max-loras 32 --max-lora-rank 16 --num-prompts ${PROMPTS:-256} \
            --max-concurrency 64 --input-len 512 --output-len 128 --max-model-len 1024 --cache-dir "$CACHE" \
            --result-json "$OUT/tp-8b-tp$tp.json" 2>&1 | grep -v "it/s" > "$OUT/tp-8b-tp$tp.txt"
          grep -E "^\| |GiB|Error|error" "$OUT/tp-8b-tp$tp.txt" | tail -6
        done ;;
      70b) timeout 500 python3 -m loraplex.entrypoints.cli bench --model llama-3.1-70b --tensor-parallel-size 2 \
          --num-adapters 0 32 --max-loras 32 --max-lora-rank 16 --num-prompts ${PROMPTS70:-96} \
          --max-concurrency 32 --input-len 512 --output-len 128 --max-model-len 1024 \
          --gpu-memory-utilization 0.95 --cache-dir "$CACHE" --result-json "$OUT/tp-70b.json" 2>&1 \
          | grep -v "it/s" > "$OUT/tp-70b.txt"; grep -E "^\| |GiB|Error|error" "$OUT/tp-70b.txt" | tail -8 ;;
      esac; done ;;
    spec-cost)  # RESULTS: "Speculative decoding" (dummy weights: a k = 4 verify step against a decode
      # step, 16 in flight; a run with proposals that are never kept against speculation off)
      run spec-cost-llama 250 speculative --workload cost --model llama-3.1-8b --batch 16 --k 4 \
        --cache-dir "$CACHE" --out "$OUT/spec-cost-llama.json" | tail -7
      run spec-cost-gpt-oss 250 speculative --workload cost --model gpt-oss-20b --batch 16 --k 4 \
        --cache-dir "$CACHE" --out "$OUT/spec-cost-gpt-oss.json" | tail -7 ;;
    spec-quote)  # RESULTS: "Speculative decoding" (real weights: the default model, Gemma 3 270M, and its
      # demo adapters quoting standard-library source; built in $LORAPLEX_CACHE beforehand)
      run spec-quote 400 speculative --workload quote --concurrency 1 2 4 8 --profile-host --out "$OUT/spec-quote.json" \
        | tail -6 ;;
    *) echo "unknown step $step" ;;
  esac
done
