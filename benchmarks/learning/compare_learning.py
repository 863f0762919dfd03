#!/usr/bin/env python3
"""Print Olmo-core's and moetrain's learning curves side by side (benchmarks/learning/README.md).

    python benchmarks/learning/compare_learning.py OUT/olmocore.jsonl OUT/moetrain-run [--window 10]

Reads olmocore_learn.py's JSON lines and moetrain's run directory (metrics.jsonl: one record per
logged step, val_loss on evaluation steps; summary.json: initial_val_loss, the step-0 evaluation).
Training losses are averaged over the `--window` steps ending at each row on both sides (only the
steps each side logged); validation losses are compared as they are (the same windows of
val.bin on both sides). Also writes the table as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a run killed mid-write leaves a truncated last line
            pass
    return rows


def mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def fmt(v, spec=".4f", width=8):
    return format(v, spec).rjust(width) if isinstance(v, (int, float)) and v is not None else "-".rjust(width)


def window_mean(by_step: dict, key: str, step: int, window: int):
    return mean([by_step[s].get(key) for s in range(step - window + 1, step + 1) if s in by_step])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("olmocore", type=Path)
    ap.add_argument("moetrain_run", type=Path)
    ap.add_argument("--window", type=int, default=10, help="training-loss rows: mean over this many steps")
    ap.add_argument("--every", type=int, default=None, help="a training row every N steps (default: eval_every or 50)")
    ap.add_argument("--json", type=Path, default=None, help="also write the comparison here")
    args = ap.parse_args(argv)

    olmo = read_jsonl(args.olmocore)
    cfg = next((r for r in olmo if r.get("kind") == "config"), {})
    o_train = {r["step"]: r for r in olmo if r.get("kind") == "train"}
    o_eval = {r["step"]: r["val_loss"] for r in olmo if r.get("kind") == "eval"}
    o_load = next((r for r in olmo if r.get("kind") == "expert_load"), None)
    o_done = next((r for r in olmo if r.get("kind") == "done"), None)
    o_err = [r for r in olmo if r.get("kind") == "error"]

    m_rows = read_jsonl(args.moetrain_run / "metrics.jsonl")
    m_train = {r["step"]: r for r in m_rows if "lm_loss" in r}
    m_eval = {r["step"]: r["val_loss"] for r in m_rows if r.get("val_loss") is not None}
    summary_path = args.moetrain_run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if summary.get("initial_val_loss") is not None:
        m_eval.setdefault(0, summary["initial_val_loss"])

    out = {
        "settings": {
            k: cfg.get(k)
            for k in (
                "shape",
                "n_layers",
                "device",
                "steps",
                "seq_len",
                "global_batch",
                "micro_batch",
                "tokens_per_step",
                "lr",
                "warmup",
                "min_lr_ratio",
                "schedule",
                "lb_weight",
                "z_weight",
                "init_std",
                "embedding",
                "eval_tokens_used",
            )
        }
    }
    print("settings:", json.dumps(out["settings"]))
    if o_err:
        print("OLMO-CORE ERROR:", json.dumps(o_err[-1])[:600])
    if not m_rows:
        print(f"moetrain: no records in {args.moetrain_run / 'metrics.jsonl'}")
    print(
        f"steps logged: olmo-core {len(o_train)} (last {max(o_train, default=0)}), "
        f"moetrain {len(m_train)} (last {max(m_train, default=0)})"
    )

    # validation
    print("\nvalidation loss (the same val.bin windows on both sides)")
    print(f"{'step':>6} {'olmo-core':>10} {'moetrain':>10} {'mt - olmo':>10}")
    val_rows = []
    for step in sorted(set(o_eval) | set(m_eval)):
        o, m = o_eval.get(step), m_eval.get(step)
        d = m - o if o is not None and m is not None else None
        val_rows.append({"step": step, "olmocore": o, "moetrain": m, "diff": d})
        print(f"{step:>6} {fmt(o, '.4f', 10)} {fmt(m, '.4f', 10)} {fmt(d, '+.4f', 10)}")
    out["val"] = val_rows

    # training
    every = args.every or cfg.get("eval_every") or 50
    last = max(max(o_train, default=0), max(m_train, default=0))
    steps = sorted({s for s in range(every, last + 1, every)} | ({1} if last else set()) | ({last} if last else set()))
    print(f"\ntraining LM loss, mean over the {args.window} steps ending at each step (lr: that step's)")
    print(
        f"{'step':>6} {'olmo-core':>10} {'moetrain':>10} {'mt - olmo':>10} {'lr olmo':>10} {'lr mt':>10} "
        f"{'lb olmo':>8} {'lb mt':>8} {'load olmo':>9} {'load mt':>8}"
    )
    train_rows = []
    for step in steps:
        o = window_mean(o_train, "lm_loss", step, args.window)
        m = window_mean(m_train, "lm_loss", step, args.window)
        d = m - o if o is not None and m is not None else None
        row = {
            "step": step,
            "olmocore": o,
            "moetrain": m,
            "diff": d,
            "lr_olmocore": o_train.get(step, {}).get("lr"),
            "lr_moetrain": m_train.get(step, {}).get("lr"),
            "lb_olmocore": window_mean(o_train, "lb_loss", step, args.window),
            "lb_moetrain": window_mean(m_train, "lb_loss", step, args.window),
            "load_olmocore": window_mean(o_train, "expert_load_max_over_mean", step, args.window),
            "load_moetrain": window_mean(m_train, "expert_load_max_over_mean", step, args.window),
        }
        train_rows.append(row)
        print(
            f"{step:>6} {fmt(o, '.4f', 10)} {fmt(m, '.4f', 10)} {fmt(d, '+.4f', 10)} "
            f"{fmt(row['lr_olmocore'], '.3e', 10)} {fmt(row['lr_moetrain'], '.3e', 10)} "
            f"{fmt(row['lb_olmocore'], '.3f', 8)} {fmt(row['lb_moetrain'], '.3f', 8)} "
            f"{fmt(row['load_olmocore'], '.2f', 9)} {fmt(row['load_moetrain'], '.2f', 8)}"
        )
    out["train"] = train_rows

    # end of run
    common = sorted(set(o_train) & set(m_train))
    tail = common[-100:]
    end = {
        "common_steps": len(common),
        "train_loss_last100_olmocore": mean([o_train[s]["lm_loss"] for s in tail]),
        "train_loss_last100_moetrain": mean([m_train[s]["lm_loss"] for s in tail]),
        "skipped_olmocore": sum(int(r.get("skipped", 0)) for r in o_train.values()),
        "skipped_moetrain": max((int(r.get("skipped_steps", 0)) for r in m_train.values()), default=None),
        "grad_norm_last100_olmocore": mean([o_train[s].get("grad_norm") for s in tail]),
        "grad_norm_last100_moetrain": mean([m_train[s].get("grad_norm") for s in tail]),
        "expert_load_olmocore_window": (o_load or {}).get("max_over_mean_max"),
        "olmocore_tokens_per_s": (o_done or {}).get("tokens_per_s"),
        "moetrain_tokens_per_s_last": m_train[max(m_train)].get("tokens_per_sec") if m_train else None,
    }
    both_val = [s for s in sorted(o_eval) if s in m_eval]
    if both_val:
        s = both_val[-1]
        end.update(
            final_val_step=s,
            final_val_olmocore=o_eval[s],
            final_val_moetrain=m_eval[s],
            final_val_diff=m_eval[s] - o_eval[s],
        )
    out["end"] = end
    print("\nend:", json.dumps(end))
    if o_load and o_load.get("layers"):
        per = {k: round(v["max_over_mean"], 3) for k, v in o_load["layers"].items()}
        print(
            f"olmo-core expert load (max/mean tokens per expert over its last {o_load.get('steps')} steps), "
            f"per layer: {per}"
        )
    by_layer = [m_train[s]["expert_load_by_layer"] for s in tail if m_train[s].get("expert_load_by_layer")]
    if by_layer:
        per = [round(mean(list(layer)), 3) for layer in zip(*by_layer)]
        end["expert_load_by_layer_moetrain"] = per
        print(f"moetrain expert load (each step's max/mean, mean of its last {len(by_layer)} steps), per layer: {per}")
    if "final_val_diff" in end:
        print(
            f"\nVERDICT: at step {end['final_val_step']} moetrain's validation loss is "
            f"{end['final_val_diff']:+.4f} nats from Olmo-core's ({end['final_val_moetrain']:.4f} vs "
            f"{end['final_val_olmocore']:.4f}); negative = moetrain lower."
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
