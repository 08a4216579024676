#!/usr/bin/env bash
# One GPU session: tests on the GPU, then the benchmark suite's steps; each step writes
# its log and JSON (figures with the run's environment) under $OUT. Run from the
# repository root. Figures go to benchmarks/RESULTS.md (the step named beside each).
#
# Usage: OUT=results_dir bash benchmarks/gpu_session.sh [STEP ...]   (default: tests kernels profile bench)
# Steps: tests tests32 moe-tests | kernels gemms moe-kernels attention prefill-lora |
#        profile breakdown prefill mixed | bench qwen3-moe gpt-oss cold |
#        adapter-load interference slot-load | train-moe train-breakdown train-profile
# Model directories and random adapters are kept in $LORAPLEX_BENCH_CACHE
# (default ~/.cache/loraplex/bench), shared by the scripts and `loraplex bench`.
set -u
OUT=${OUT:-./gpu-results}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
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
    kernels)  # RESULTS: "LoRA kernels against their floors", "Adapter kernels in a decode step"
      run kernels 300 kernels --out "$OUT/kernels.json" | tail -60 ;;
    gemms)  # RESULTS: "Base GEMMs"
      run gemms 300 base_gemms --out "$OUT/gemms.json" ;;
    moe-kernels)  # RESULTS: "One MoE layer", "Expert adapters in decode"
      run moe-kernels 400 moe_kernels --tokens 1 16 64 2048 8192 --out "$OUT/moe-kernels.json" \
        | grep -v "^ " ;;
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
    cold)  # RESULTS: "1,000 cold adapters" (registry; the step profile says where time goes)
      # (COLD_ARGS=--sample-stacks adds where the engine thread is, at a cost: its sampler
      # thread takes the GIL, and the run slows by ~10%)
      timeout 560 python3 -m loraplex.entrypoints.cli bench --model llama-3.1-8b --num-adapters 0 1000 \
        --adapter-dist uniform zipf --cold-adapters --adapter-registry --max-loras 32 --max-cpu-loras 128 \
        --max-cpu-lora-memory 16 --num-prompts 512 --max-concurrency 32 --input-len 512 --output-len 128 \
        --max-num-batched-tokens 2048 ${COLD_ARGS:-} --cache-dir "$CACHE" --result-json "$OUT/cold.json" 2>&1 \
        | grep -v "it/s" > "$OUT/cold.txt"; tail -40 "$OUT/cold.txt" ;;
    adapter-load)  # RESULTS: "Adapter loads" (96 random Llama-3.1-8B adapters, no engine)
      run adapter-load 300 adapter_load --generate 96 --out "$OUT/adapter-load.json" ;;
    interference)  # RESULTS: "Loader threads beside the engine thread"
      run interference 200 loader_interference --threads 1 2 8 --out "$OUT/interference.json" | tail -12 ;;
    slot-load)  # RESULTS: "Slot loads"
      run slot-load 100 slot_load --out "$OUT/slot-load.json" ;;
    train-moe)  # RESULTS: "Training: LoRA on MoE experts" (one step, Qwen3-30B-A3B-shaped layers, vs PEFT)
      run train-moe 200 train_moe --layers 2 --seq-lens 1024 4096 16384 --repeats 10 --out "$OUT/train-moe.json" | tail -8
      run train-moe-only 200 train_moe --layers 2 --seq-lens 1024 4096 16384 --moe-only --repeats 15 \
        --out "$OUT/train-moe-only.json" | tail -8 ;;
    train-breakdown)  # one MoE layer's primitives at 16K tokens, eager vs fused kernels
      run train-breakdown 200 train_moe --breakdown --seq-lens ${SEQ:-16384} | tail -30 ;;
    train-profile)  # kernel tables of the MoE-only step at 16K tokens, loraplex and PEFT
      run train-profile 300 train_moe --layers 2 --seq-lens ${SEQ:-16384} --profile > /dev/null
      grep -A 14 "===" "$OUT/train-profile.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
