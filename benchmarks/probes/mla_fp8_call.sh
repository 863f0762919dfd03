# Issue 56: MLA with row-wise FP8 beside GQA with FP8 at bench-small32e's shape and equal active
# parameters (the MLA widths of the benchmarks.md table mla-one-gpu), one GPU, one call; each run
# bounded so the whole stays under BUDGET seconds. JSON lines in $OUT/mla_fp8.jsonl.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
MLA="--model.attention=mla --model.n_kv_heads=8 --model.qk_norm=false --model.q_lora_rank=0 --model.kv_lora_rank=192 --model.qk_nope_head_dim=64 --model.qk_rope_head_dim=64 --model.v_head_dim=128"
start=$SECONDS
for v in "gqa:" "mla:$MLA" "gqa-all:--precision.fp8_select=all" "mla-all:$MLA --precision.fp8_select=all"; do
  left=$(( ${BUDGET:-200} - (SECONDS - start) )); [ $left -lt 30 ] && { echo "skip ${v%%:*}: ${left}s left"; continue; }
  echo "== ${v%%:*}"
  timeout $left python -m moetrain bench bench-small32e --device cuda --warmup 5 --steps 15 --routing learned \
    --precision.fp8=rowwise ${v#*:} 2>&1 | tee $OUT/mla_fp8-${v%%:*}.log | grep -E '^\{' | sed "s/^{/{\"variant\": \"${v%%:*}\", /" >> $OUT/mla_fp8.jsonl
  grep -E "Error|error:" $OUT/mla_fp8-${v%%:*}.log | head -3
done
python -c "
import json
for r in map(json.loads, open('$OUT/mla_fp8.jsonl')):
    print(r['variant'], r['shape']['active_params'], r['precision'], r.get('tokens_per_sec_per_device'), r.get('mfu'), r.get('peak_mem_gib'))"
