#!/usr/bin/env bash
# Reproduce the demo adapters served with the default model (Gemma 3 270M):
#   src/loraplex/demo_adapters/terse  answers in a few words
#   src/loraplex/demo_adapters/json   answers with one single-line JSON object
# Usage: examples/demo_adapters/train.sh [terse] [json]   (CPU: a few minutes each)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
MODEL=$($PY -c "from loraplex.entrypoints.default_model import default_model_dir; print(default_model_dir())")
OUT=src/loraplex/demo_adapters

$PY examples/demo_adapters/make_data.py
names=("$@"); [ $# -gt 0 ] || names=(terse json)
for n in "${names[@]}"; do
  rm -rf "$OUT/$n"
  $PY -m loraplex.entrypoints.cli train --model "$MODEL" --data "examples/demo_adapters/data/$n.jsonl" \
    --out "$OUT/$n" --rank 8 --alpha 16 --epochs "${EPOCHS:-3}" --lr "${LR:-5e-4}" --warmup-steps 5 \
    --max-seq-len 128 --batch-size 8 --seed 0 --save-steps 0
  # Ship it small: bf16 weights (loraplex casts adapters to the model's dtype), the
  # config naming the model by its name rather than this machine's path.
  $PY - "$OUT/$n" <<'EOF'
import json, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
d = Path(sys.argv[1])
w = d / "adapter_model.safetensors"
save_file({k: v.bfloat16() for k, v in load_file(w).items()}, w, metadata={"format": "pt"})
c = json.loads((d / "adapter_config.json").read_text())
c["base_model_name_or_path"] = "gemma-3-270m"
(d / "adapter_config.json").write_text(json.dumps(c, indent=2) + "\n")
EOF
done
