#!/usr/bin/env bash
# One GPU session: tests on the GPU, kernel rooflines, decode profile, serving benchmark.
# Usage: OUT=results_dir bash benchmarks/gpu_session.sh [tests] [kernels] [profile] [bench]
set -u
OUT=${OUT:-./gpu-results}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
STEPS=${*:-tests kernels profile bench}
# The server tests' packages, where a wheel directory came along (machines without internet)
[ -d .whl ] && python3 -m pip install -q --no-index --find-links .whl openai fastapi uvicorn 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for step in $STEPS; do
  echo "=== $step"
  case $step in
    tests)
      LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=bfloat16 timeout 570 python3 -m pytest -x -q \
        -p no:cacheprovider 2>&1 | tail -25 > "$OUT/tests-bf16.log"; tail -5 "$OUT/tests-bf16.log" ;;
    tests32)
      LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=float32 timeout 400 python3 -m pytest -x -q \
        -p no:cacheprovider 2>&1 | tail -25 > "$OUT/tests-fp32.log"; tail -5 "$OUT/tests-fp32.log" ;;
    kernels)
      timeout 300 python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt" | tail -60 ;;
    profile)
      timeout 300 python3 benchmarks/profile_decode.py --cache-dir /tmp/lp 2>&1 | grep -v "it/s" > "$OUT/profile.txt"; grep -E "engine step|Self CUDA" "$OUT/profile.txt" ;;
    probe)  # adapter kernels of a decode step, isolated: MoE experts and Llama projections
      timeout 300 python3 benchmarks/decode_lora_probe.py --out "$OUT/probe.json" 2>&1 | grep -v -i warn \
        | tee "$OUT/probe.txt" | grep -v "^ " ;;
    breakdown)  # one decode step op by op, per model (the bench's MoE shapes; routing stats on, as there)
      timeout 200 python3 benchmarks/decode_breakdown.py --model qwen3-30b-a3b --batch 16 --prompt-len 1600 \
        --adapters 16 --expert-adapters --routing-stats ${BD_ARGS:-} --cache-dir /tmp/lp \
        --out "$OUT/breakdown-qwen3.json" 2>&1 | grep -v -i warn | tee "$OUT/breakdown-qwen3.txt" | tail -70
      timeout 150 python3 benchmarks/decode_breakdown.py --model gpt-oss-20b --batch 16 --prompt-len 1600 \
        --adapters 16 --expert-adapters --routing-stats ${BD_ARGS:-} --cache-dir /tmp/lp \
        --out "$OUT/breakdown-gpt-oss.json" 2>&1 | grep -v -i warn | tee "$OUT/breakdown-gpt-oss.txt" | tail -70
      timeout 150 python3 benchmarks/decode_breakdown.py --model llama-3.1-8b --batch 32 --prompt-len 512 \
        --adapters 32 ${BD_ARGS:-} --cache-dir /tmp/lp --out "$OUT/breakdown-llama.json" 2>&1 \
        | grep -v -i warn | tee "$OUT/breakdown-llama.txt" | tail -50 ;;
    attention)  # decode attention configs on the benchmarked models' shapes
      timeout 400 python3 benchmarks/attention_sweep.py --out "$OUT/attention.json" 2>&1 | grep -v -i warn \
        | tee "$OUT/attention.txt" ;;
    variants)
      timeout 400 python3 benchmarks/decode_variants.py 2>&1 | grep -v "it/s" | grep -v "^loraplex" | tee "$OUT/variants.txt" ;;
    bench)
      timeout 500 python3 -m loraplex.entrypoints.cli bench --model llama-3.1-8b --num-adapters 0 32 \
        --max-num-batched-tokens ${CHUNK:-2048} \
        --num-prompts ${PROMPTS:-512} --max-concurrency 32 --input-len 512 --output-len 128 \
        --cache-dir /tmp/lp --result-json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 \
        | grep -v "it/s" > "$OUT/bench.txt"; tail -6 "$OUT/bench.txt" ;;
    moe-tests)
      LORAPLEX_TEST_DEVICE=cuda LORAPLEX_TEST_DTYPE=bfloat16 timeout 570 python3 -m pytest -x -q \
        -p no:cacheprovider tests/test_moe_ops.py tests/test_moe.py tests/test_gpt_oss.py \
        2>&1 | tail -25 > "$OUT/moe-tests.log"; tail -5 "$OUT/moe-tests.log" ;;
    qwen3-moe)  # issue targets: 16 in flight, 1600 in / 600 out, 16 adapters on attention + experts
      timeout 560 python3 -m loraplex.entrypoints.cli bench --model qwen3-30b-a3b --num-adapters 0 16 \
        --lora-targets q_proj k_proj v_proj o_proj experts --num-prompts ${PROMPTS:-32} \
        --max-concurrency 16 --input-len 1600 --output-len 600 --cache-dir /tmp/lp \
        --result-json "$OUT/qwen3-moe.json" 2>&1 | grep -v "it/s" > "$OUT/qwen3-moe.txt"; tail -8 "$OUT/qwen3-moe.txt" ;;
    gpt-oss)
      timeout 560 python3 -m loraplex.entrypoints.cli bench --model gpt-oss-20b --num-adapters 0 16 \
        --lora-targets q_proj k_proj v_proj o_proj experts --num-prompts ${PROMPTS:-32} \
        --max-concurrency 16 --input-len 1600 --output-len 600 --cache-dir /tmp/lp \
        --result-json "$OUT/gpt-oss.json" 2>&1 | grep -v "it/s" > "$OUT/gpt-oss.txt"; tail -8 "$OUT/gpt-oss.txt" ;;
    train-moe)  # issue 7: one training step, Qwen3-30B-A3B-shaped MoE layers, vs transformers + PEFT
      timeout 200 python3 benchmarks/train_moe.py --layers 2 --seq-lens 1024 4096 16384 2>&1 \
        | grep -v -i warn | tee "$OUT/train-moe.txt" | tail -8
      timeout 200 python3 benchmarks/train_moe.py --layers 2 --seq-lens 1024 4096 16384 --moe-only 2>&1 \
        | grep -v -i warn | tee "$OUT/train-moe-only.txt" | tail -8 ;;
    train-breakdown)  # issue 7: one MoE layer's primitives at 16K tokens, eager vs fused kernels
      timeout 200 python3 benchmarks/train_moe.py --breakdown --seq-lens ${SEQ:-16384} 2>&1 | grep -v -i warn \
        | tee "$OUT/train-breakdown.txt" | tail -30 ;;
    train-profile)  # issue 7: kernel tables of the MoE-only step at 16K tokens, loraplex and PEFT
      timeout 300 python3 benchmarks/train_moe.py --layers 2 --seq-lens ${SEQ:-16384} --profile 2>&1 \
        | grep -v -i warn > "$OUT/train-profile.txt"; grep -A 14 "===" "$OUT/train-profile.txt" ;;
    cold)  # issue 6: 1,000 cold adapters from a registry; the step profile says where time goes
      # (COLD_ARGS=--sample-stacks adds where the engine thread is, at a cost: its sampler
      # thread takes the GIL, and the run slows by ~10%)
      timeout 560 python3 -m loraplex.entrypoints.cli bench --model llama-3.1-8b --num-adapters 0 1000 \
        --adapter-dist uniform zipf --cold-adapters --adapter-registry --max-loras 32 --max-cpu-loras 128 \
        --max-cpu-lora-memory 16 --num-prompts 512 --max-concurrency 32 --input-len 512 --output-len 128 \
        --max-num-batched-tokens 2048 ${COLD_ARGS:-} --cache-dir /tmp/lp --result-json "$OUT/cold.json" 2>&1 \
        | grep -v "it/s" > "$OUT/cold.txt"; tail -40 "$OUT/cold.txt" ;;
    interference)  # issue 6: how much each kind of loader work slows a host-bound engine thread
      timeout 200 python3 benchmarks/loader_interference.py --threads 1 2 8 2>&1 | tee "$OUT/interference.txt" | tail -12 ;;
    slot-load)
      timeout 100 python3 benchmarks/slot_load.py 2>&1 | tee "$OUT/slot-load.txt" ;;
  esac
done
