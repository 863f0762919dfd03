# Issue 54 item 1: Muon's optimizer step on rank 0 of a rehearsed dp8·ep8 bench-8e, before
# (.baseline: 745284a's src, every rank orthogonalizing every replicated matrix) and after (the
# orthogonalization divided over the data-parallel replicas), one call, one GPU; then one GPU's
# bench-8e with Muon (nothing to divide: it must be no slower).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R="--rehearse 8 --rank 0 --no-checkpoint --device cuda --parallel.ep=8 --train.micro_batch_size=8 --train.global_batch_size=8"
for tree in .baseline/src src; do
  PYTHONPATH=$PWD/$tree timeout 200 python -m moetrain bench bench-8e $R --routing learned --warmup 3 --steps 5 \
    --also-optimizer-step --optim.name=muon 2> $OUT/muon-$(basename $(dirname $tree/x)).err | tee -a $OUT/muon.jsonl \
    | python -c "import json,sys; [print('$tree', r.get('timed'), r.get('step_time_s'), r.get('share_of_training_step'), r.get('peak_mem_gib')) for r in map(json.loads, sys.stdin)]"
  tail -2 $OUT/muon-$(basename $(dirname $tree/x)).err
done
for tree in .baseline/src src; do
  PYTHONPATH=$PWD/$tree timeout 120 python -m moetrain bench bench-8e --device cuda --routing learned --warmup 2 --steps 3 \
    --also-optimizer-step --optim.name=muon 2>/dev/null | tee -a $OUT/muon-one.jsonl \
    | python -c "import json,sys; [print('one $tree', r.get('timed'), r.get('step_time_s'), r.get('share_of_training_step'), r.get('peak_mem_gib')) for r in map(json.loads, sys.stdin)]"
done
