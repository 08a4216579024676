#!/usr/bin/env bash
# Native stacks of every thread (py-spy) during the issue-6 cold-adapter run, to see
# where the engine thread's host time goes in steps that load adapters.
# Usage: OUT=dir bash benchmarks/spy_cold.sh   (py-spy: pip install py-spy, or a wheel in .whl/)
set -u
OUT=${OUT:-./gpu-results}; mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
SPY=$(command -v py-spy || true)
if [ -z "$SPY" ]; then pip install -q --no-index --no-deps --target /tmp/spy .whl/py_spy*.whl && SPY=/tmp/spy/bin/py-spy; fi
python3 -m loraplex.entrypoints.cli bench --model llama-3.1-8b --num-adapters 1000 --adapter-dist uniform \
  --cold-adapters --adapter-registry --max-loras 32 --max-cpu-loras 128 --max-cpu-lora-memory 16 \
  --num-prompts 512 --max-concurrency 32 --input-len 512 --output-len 128 --max-num-batched-tokens 2048 \
  --cache-dir /tmp/lp --result-json "$OUT/cold.json" ${COLD_ARGS:-} > "$OUT/cold.txt" 2>&1 &
PID=$!
until grep -q "warm-up done" "$OUT/cold.txt" 2>/dev/null || ! kill -0 $PID 2>/dev/null; do sleep 1; done
sleep 3
timeout 60 "$SPY" record --native --threads -r ${RATE:-100} -d ${SECONDS_SPY:-15} -f raw -o "$OUT/spy.txt" --pid $PID \
  > "$OUT/spy.log" 2>&1
wait $PID
tail -3 "$OUT/spy.log"; grep -v "it/s" "$OUT/cold.txt" | tail -6
