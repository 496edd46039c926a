#!/usr/bin/env bash
# The fine-tuning benchmark on real text, on a GPU: LoRA and full fine-tuning of the built-in ~1B Qwen3-MoE
# (qwen3-moe-1b) with the Qwen3 tokenizer on the shared English text, each through moe8 and through plain
# transformers (--no-moe8: transformers' experts, and PEFT's LoRA for lora), then bench/finetune_compare.py
# writes the side-by-side finetune_1b_<gpu>.json + .md (bench/results/finetune_1b_h200.md). Run directories go
# to $RUNS (checkpoints are large); metrics.jsonl, report.html and each run's log are copied to $OUT.
#   MOE8_SHARED_DATA=/path/to/shared/data OUT=/tmp/out STEPS=80 bash scripts/gpu_finetune.sh
# METHODS (default "lora full"), RUN_TIMEOUT (seconds per run, default 150).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/moe8-finetune-out}
RUNS=${RUNS:-/tmp/moe8-finetune}
STEPS=${STEPS:-100}
DATA=${MOE8_SHARED_DATA:-../shared/data}
PY=$(command -v python3)
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH=${PYTHONPATH:-python}
for method in ${METHODS:-lora full}; do
  for impl in moe8 no-moe8; do
    name=$method-$impl
    rm -rf "${RUNS:?}/$name"
    t0=$(date +%s)
    timeout "${RUN_TIMEOUT:-150}" $PY -m moe8.cli finetune --model qwen3-moe-1b --tokenizer "$DATA/tokenizers/qwen3" \
      --data "$DATA/text/sentences.txt" --method $method --$impl --steps "$STEPS" --micro_batch 8 --seq_len 1024 \
      --eval_every 25 --eval_batches 4 --log_every 5 --save_every 0 --no-progress --output_dir "$RUNS/$name" \
      >"$OUT/$name.log" 2>&1
    echo "$name: rc $? in $(($(date +%s) - t0)) s: $(tail -2 "$OUT/$name.log" | head -1)"
    mkdir -p "$OUT/$name"
    cp "$RUNS/$name"/{metrics.jsonl,report.html,finetune.toml} "$OUT/$name/" 2>/dev/null
  done
done
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | sed 's/^NVIDIA //' | tr ' ' '\n' |
  grep -m1 '[0-9]' | cut -d- -f1 | tr 'A-Z' 'a-z' | tr -cd 'a-z0-9')
GPU=${GPU:-gpu}  # "NVIDIA H200" -> h200
$PY bench/finetune_compare.py "$OUT" --json "$OUT/finetune_1b_$GPU.json" --md "$OUT/finetune_1b_$GPU.md"
