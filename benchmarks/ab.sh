#!/usr/bin/env bash
# One bench command on two commits of this repository in one call, alternated (REF, then the
# working tree, ROUNDS times), one process each: a change's effect without the spread between
# calls (up to 4%). REF is checked out into a temporary git worktree and run from this directory
# (its data/), with PYTHONPATH pointing at REF's src/; the working tree's src/ runs the other side.
# Each line: the side, the round, the window, tokens/s, ms a step, peak GiB; the JSON lines go to
# $OUT/ab.jsonl, each with "ab": "REF" or "HEAD".
# Usage: [ROUNDS=2] [DEVICE=cuda] bash benchmarks/ab.sh REF PRESET [bench arguments...]
#   e.g. bash benchmarks/ab.sh f812b07 bench-small32e --warmup 5 --steps 15 --routing learned
set -u
if [ $# -lt 2 ]; then echo "usage: bash benchmarks/ab.sh REF PRESET [bench arguments...]" >&2; exit 2; fi
ref=$1 preset=$2; shift 2
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
tree=$(mktemp -d /tmp/ab-XXXXXX)
git worktree add -q --detach "$tree" "$ref" || { rmdir "$tree"; echo "ab.sh: no commit $ref here" >&2; exit 2; }
trap 'git worktree remove --force "$tree"' EXIT
for round in $(seq "${ROUNDS:-2}"); do
  for side in REF HEAD; do
    src=$PWD/src; [ "$side" = REF ] && src=$tree/src
    PYTHONPATH=$src timeout "${BT:-300}" python -m moetrain bench "$preset" --device "${DEVICE:-cuda}" "$@" \
        2>"$OUT/ab-$side-$round.err" \
      | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); r['ab'] = '$side'
    print(json.dumps(r), file=open('$OUT/ab.jsonl', 'a'))
    print('$side' if '$side' == 'HEAD' else '$ref', 'round $round', r['timed'], round(r['tokens_per_sec_per_device']),
          round(1000 * r['step_time_s'], 2), 'ms', round(r['peak_mem_gib'], 2), 'GiB')"
    grep -m3 -i "error\|Traceback" "$OUT/ab-$side-$round.err"
  done
done
