"""benchmarks/trace_overlap.py on a hand-made chrome trace with known overlap."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kernel(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_exposed_and_idle_time(tmp_path):
    # compute 0–100 and 150–250 (stream 7); all-reduce 80–180 (stream 20): 20 + 30 µs under
    # compute, 50 exposed; all-to-all 260–300 fully exposed; idle 100–150 is covered by NCCL,
    # 250–260 is idle. Two steps in the window.
    events = [
        kernel("gemm", 0, 100, 7),
        kernel("elementwise", 150, 100, 7),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 80, 100, 20),
        kernel("ncclDevKernel_SendRecv", 260, 40, 21),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/trace_overlap.py"), str(path), "--steps", "2", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    r = json.loads(out)
    ms = 1e-3 / 2
    assert r["span_ms"] == round(300 * ms, 2)
    assert r["compute_ms"] == round(200 * ms, 2)
    assert r["nccl_ms"] == round(140 * ms, 2)
    assert r["exposed_nccl_ms"] == round(90 * ms, 2)
    assert r["idle_ms"] == round(10 * ms, 2)
    assert r["collectives"]["AllReduce"]["exposed_ms"] == round(50 * ms, 2)
    assert r["collectives"]["SendRecv"]["exposed_ms"] == round(40 * ms, 2)


def test_trace_without_kernels_is_a_clear_error(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": []}))
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/trace_overlap.py"), str(path)], capture_output=True, text=True
    )
    assert res.returncode != 0 and "no GPU kernels" in res.stderr and "Traceback" not in res.stderr


def test_idle_gaps_are_charged_to_the_operator_that_launched_the_kernel_after_them(tmp_path):
    # Kernels 0–100 (launched in aten::mm), 130–150 (in _Fp8LinearBackward's aten::_scaled_mm: 30 µs
    # idle before it), 150–160 (no launch in the trace: "?", no gap), 200–220 (aten::mm again: 40 µs
    # idle). One step.
    def launched(name, ts, dur, corr):
        return {
            "ph": "X",
            "cat": "kernel",
            "name": name,
            "ts": ts,
            "dur": dur,
            "args": {"stream": 7, "correlation": corr},
        }

    def runtime(ts, corr):
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": ts,
            "dur": 1,
            "tid": 1,
            "args": {"correlation": corr},
        }

    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": 1}

    events = [
        launched("gemm_a", 0, 100, 1), runtime(-5, 1), op("aten::mm", -10, 8),
        launched("nvjet_fp8", 130, 20, 2), runtime(120, 2),
        op("_Fp8LinearBackward", 100, 40), op("aten::_scaled_mm", 115, 10),
        launched("copy", 150, 10, 3),
        launched("gemm_b", 200, 20, 4), runtime(190, 4), op("aten::mm", 185, 10),
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/trace_overlap.py"), str(path), "--steps", "1", "--json", "--gaps", "5"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    r = json.loads(out)
    assert r["idle_ms"] == round(70 * 1e-3, 2)
    assert r["idle_before"] == [
        {"op": "aten::mm", "gaps_per_step": 1.0, "idle_ms": 0.04},
        {"op": "aten::_scaled_mm", "gaps_per_step": 1.0, "idle_ms": 0.03},
    ]
