"""An expert-parallel rank's compute per token against one GPU's, by kind of kernel (issue 53).

Each row is one `moetrain bench` (one GPU, or one rank rehearsed with --rehearse N) with a
profile of its timed steps; per row it prints tokens/s per GPU, device ms per step by kernel
kind, and the operators that launched the most device time, and appends the bench's JSON line to
OUT/ep.jsonl. Rows are NAME=ARGS, ARGS the bench's arguments after the preset:

    python benchmarks/ep_parity.py OUT \\
        "one=sweep-8l-8 --model.n_layers=4 --train.micro_batch_size=1" \\
        "ep8=sweep-8l-8 --model.n_layers=4 --parallel.ep=8 --rehearse 8 --rank 0 --no-checkpoint"

Compute per token compares the rows' device totals over the tokens each GPU runs a step.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_row(name: str, args: list[str], out: Path) -> dict | None:
    run_dir = Path(tempfile.mkdtemp(prefix=f"ep-{name}-"))
    cmd = [sys.executable, "-m", "moetrain", "bench", *args, "--device", "cuda", "--routing", "random"]
    cmd += ["--no-sync-check", "--run-dir", str(run_dir), "--train.profile=true", "--train.profile_steps=2"]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=int(os.environ.get("ROW_TIMEOUT", 400)))
    (out / f"{name}.err").write_text(proc.stderr[-20000:])
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    print(f"== {name}: rc {proc.returncode}, {time.time() - started:.0f} s: {shlex.join(args)}", flush=True)
    if not records:
        print(proc.stderr[-2000:])
        subprocess.run(["rm", "-rf", str(run_dir)])
        return None
    record = records[0]
    record["row"] = name
    ops = sorted(run_dir.rglob("ops.txt"))
    record["top_ops"] = ops[0].read_text().splitlines()[:40] if ops else []
    traces = sorted(run_dir.rglob("trace.json"))
    try:
        record["launchers"] = launchers(traces[0]) if traces else []
    except (OSError, ValueError, KeyError) as e:
        record["launchers"] = [f"trace not read: {e!r}"]
    kinds = sorted(run_dir.rglob("kinds.json"))
    if kinds:
        record["kinds_file"] = json.loads(kinds[0].read_text())
    with open(out / "ep.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    subprocess.run(["rm", "-rf", str(run_dir)])
    return record


WATCHED = re.compile(os.environ.get("WATCH", r"bfloat16_copy|Memcpy DtoD|index_copy|direct_copy|CUDAFunctor_add"))


def launchers(trace: Path, n: int = 14) -> list[str]:
    """Device ms of the kernels `WATCHED` matches, by the operator that launched them and its
    input shapes (the trace's External id ties a kernel to its operator)."""
    events = json.loads(trace.read_text())["traceEvents"]
    ops = {
        e["args"]["External id"]: (e["name"], str(e["args"].get("Input Dims", ""))[:70])
        for e in events
        if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
    }
    totals: dict[tuple, float] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy") and WATCHED.search(e["name"]):
            op = ops.get(e.get("args", {}).get("External id"), ("?", ""))
            key = (WATCHED.search(e["name"]).group(0), *op)
            totals[key] = totals.get(key, 0.0) + e.get("dur", 0) / 1000
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:n]
    return [f"{ms:8.2f} ms  {kernel} <- {op} {dims}" for (kernel, op, dims), ms in top]


def summary(record: dict) -> str:
    kinds = record.get("kinds_file", {}).get("ms_per_step") or record.get("kinds") or {}
    total = kinds.get("total")
    tokens = record["batch"]["tokens_per_step"] / record["layout"]["dp"]
    per_token = f", {1e6 * total / tokens:.2f} device µs/token" if total else ""
    lines = [
        f"-- {record['row']}: {record.get('tokens_per_sec_per_device', 0):,.0f} tok/s/GPU, peak "
        f"{record.get('peak_mem_gib')} GiB, {tokens:,.0f} tokens/step/GPU{per_token}",
        "   kinds ms/step: " + ", ".join(f"{k} {v:.1f}" for k, v in kinds.items() if isinstance(v, float)),
    ]
    top = record.get("kinds_file", {}).get("everything_else_top_ms") or {}
    for kernel, ms in list(top.items())[:12]:
        lines.append(f"   {ms:8.2f}  {kernel[:110]}")
    lines += ["   launched by: " + line for line in record.get("launchers", [])]
    lines += ["   " + re.sub(r"\s+", " ", line)[:160] for line in record.get("top_ops", [])[:30]]
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for row in sys.argv[2:]:
        name, _, args = row.partition("=")
        record = run_row(name, shlex.split(args), out)
        if record is not None:
            print(summary(record), flush=True)


if __name__ == "__main__":
    main()
