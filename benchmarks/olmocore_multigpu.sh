#!/usr/bin/env bash
# Olmo-core 3.0.0's DDP-stack MoE step on N GPUs of one host (torchrun + NCCL), expert parallel
# through Olmo-core's own TransformerExpertParallelConfig + ExpertParallelConfig(path=sync_1d).
# The multi-GPU sibling of .anchor/run_on_gpu.sh; the runner is benchmarks/olmocore_multigpu.py.
#
# Needs .anchor/ set up as shared/anchor/README.md says (bench_olmocore.py + whl/), carried:
#   run(kind="nvidia-h200-x2", carry=[".anchor"], command="bash benchmarks/olmocore_multigpu.sh")
# Usage (from the repository root; every variable is optional):
#   N=2 CFG=ddp-8e EP=2 bash benchmarks/olmocore_multigpu.sh            # one run
#   RUNS="ddp-8e:2 ddp-8e:1" bash benchmarks/olmocore_multigpu.sh       # CONFIG:EP pairs, in order
#   EXTRA="--steps 10 --routing random" ...                            # more runner/anchor flags
#   BENCH_EXTRA_ARGS=--cpu-smoke PY=.venv/bin/python ...               # dry run on a CPU box (gloo)
# Results: $OUT/olmocore-multigpu.jsonl (rank 0 writes one JSON line per routing mode), logs in
# $OUT/logs/. The whole script stops itself before BUDGET_S seconds (default 540).
set -uo pipefail
cd "$(dirname "$0")/.."

T0=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
N=${N:-2}
CFG=${CFG:-ddp-8e}
EP=${EP:-$N}
RUNS=${RUNS:-"$CFG:$EP"}
PY=${PY:-python3}              # the GPU image's python3 holds torch 2.11
SITE=${SITE:-/tmp/site}
WHL_DIR=${WHL_DIR:-.anchor/whl}
EXTRA="${EXTRA:-} ${BENCH_EXTRA_ARGS:-}"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/logs"
JSONL="$OUT/olmocore-multigpu.jsonl"
: > "$JSONL"

# Workplace rule on multi-GPU hosts: NVLink multicast stays off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/olmo_anchor_inductor_cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/olmo_anchor_triton_cache}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

[[ -f .anchor/bench_olmocore.py ]] || { echo "[mg] .anchor/bench_olmocore.py missing: see shared/anchor/README.md, carry [\".anchor\"]"; exit 2; }

# 1) the carried wheels (olmo-core + deps the image lacks), no network
#    (skipped when $SITE already holds them, e.g. a second call on a warm machine)
if [[ -n "${FORCE_INSTALL:-}" ]] || ! PYTHONPATH="$SITE" "$PY" -c "import olmo_core" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL_DIR"/*.whl
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
echo "[mg] wheels ready after $(( $(date +%s) - T0 ))s; N=$N RUNS=$RUNS EXTRA=$EXTRA"
"$PY" -c "import torch, olmo_core.version as v; print('[env] torch', torch.__version__, 'olmo_core', v.VERSION, 'gpus', torch.cuda.device_count())" 2>&1 | grep '^\[env\]'

# 2) runs: CONFIG:EP. An OOM is retried once with 6 layers, a failure that names dynamo/inductor/
#    triton once eagerly (--no-compile), as the single-GPU runner does; such rows say so in their JSON.
run() {  # run CONFIG EP
  local cfg=$1 ep=$2 name="$1-ep$2" extra="" attempt rc t log remaining
  for attempt in 1 2; do
    remaining=$(( BUDGET_S - ($(date +%s) - T0) ))
    if (( remaining < 60 )); then
      echo "[mg] SKIP $name (${remaining}s of budget left)"
      printf '{"framework":"olmo-core","config":"%s","ep":%s,"world_size":%s,"error":"skipped","detail":"time budget exhausted"}\n' "$cfg" "$ep" "$N" >> "$JSONL"
      return
    fi
    t=$(( remaining - 10 < ${CAP_S:-300} ? remaining - 10 : ${CAP_S:-300} ))
    log="$OUT/logs/$name.a$attempt.log"
    echo "[mg] $name attempt $attempt (timeout ${t}s) $extra"
    timeout -k 15 "${t}s" "$PY" -m torch.distributed.run --standalone --nproc-per-node="$N" \
      benchmarks/olmocore_multigpu.py --config "$cfg" --ep "$ep" --out "$JSONL" $extra $EXTRA > "$log" 2>&1
    rc=$?
    grep -h '^RESULT ' "$log" | cut -c8- | "$PY" -c 'import json,sys
for r in map(json.loads, sys.stdin):
    print("[mg]  ", r.get("routing", r.get("kind")), "error=%s" % r["error"] if "error" in r else
          "tok/s/GPU=%.0f mfu=%.1f%% peak=%s GiB experts/rank=%s" % (r["tokens_per_s"], r["mfu_pct"],
          r["peak_mem_gib_per_rank"], r["local_routed_experts_per_rank"]) if "tokens_per_s" in r else "")'
    if (( rc == 0 )); then return; fi
    if (( rc == 124 || rc == 137 )); then
      echo "[mg] TIMEOUT $name after ${t}s"; tail -n 5 "$log"
      printf '{"framework":"olmo-core","config":"%s","ep":%s,"world_size":%s,"error":"timeout","detail":"killed after %ss"}\n' "$cfg" "$ep" "$N" "$t" >> "$JSONL"
      return
    fi
    echo "[mg] $name rc=$rc; last log lines:"; grep -v '^ - ' "$log" | tail -n 30
    grep -q '"tokens_per_s"' "$log" && return           # it measured something; don't retry
    if ! grep -q '^RESULT ' "$log"; then                # died before the runner could say why
      printf '{"framework":"olmo-core","config":"%s","ep":%s,"world_size":%s,"error":"exit %s","detail":%s}\n' "$cfg" "$ep" "$N" "$rc" \
        "$(grep -v '^ - ' "$log" | grep -E 'Error|Exception|must|missing' | grep -v ChildFailedError | tail -n 1 | "$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()[:300]))')" >> "$JSONL"
    fi
    if grep -q '"error": "OOM"' "$log"; then extra="--layers 6"
    elif grep -qE 'torch\._dynamo|torch\._inductor|triton' "$log"; then extra="--no-compile"
    else return; fi                                     # not a compile problem: a retry won't help
  done
}
for r in $RUNS; do run "${r%%:*}" "${r##*:}"; done

# 3) table
"$PY" - "$JSONL" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
hdr = (f"{'config':14} {'W':>2} {'ep':>2} {'routing':7} {'L':>2} {'exp/rank':>8} {'glob_tok':>8} {'tok/s/GPU':>9} "
       f"{'TFLOP/s':>7} {'MFU%':>5} {'peakGiB':>7} {'step_s':>6}  per-rank peak GiB / note")
print(hdr); print("-" * len(hdr))
for r in rows:
    if r.get("kind") == "shim_microbench":
        continue
    if "error" in r:
        print(f"{r.get('config','?'):14} {r.get('world_size','?'):>2} {r.get('ep','?'):>2} ERROR {r['error']} "
              f"(rank {r.get('rank','?')}): {str(r.get('detail',''))[:100]}")
        continue
    per = ",".join("-" if p is None else f"{p:.1f}" for p in r["peak_mem_gib_per_rank"])
    exp = "/".join(str(e) for e in sorted(set(r["local_routed_experts_per_rank"])))
    pk = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
    note = ("" if r.get("compile", True) else "EAGER ") + ("RECOMPILED " if r.get("recompiled_during_timing") else "")
    print(f"{r['config']:14} {r['world_size']:>2} {r['ep']:>2} {r['routing']:7} {r['n_layers']:>2} {exp:>8} "
          f"{r['global_batch_tokens']:>8} {r['tokens_per_s']:>9.0f} {r['tflops_per_s']:>7.1f} {r['mfu_pct']:>5.1f} "
          f"{pk:>7} {r['step_time_s_mean']:>6.3f}  [{per}] {note}")
print("tok/s/GPU = tokens over all ranks / slowest rank's time / W; TFLOP/s and MFU per GPU with the anchor's "
      "formula (6*N_active_nonemb + 12*L*d_attn*seq per token, vs 989.4 TFLOP/s); peak = max over ranks")
EOF
echo "[mg] total wall time $(( $(date +%s) - T0 ))s"
