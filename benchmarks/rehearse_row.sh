# Sourced by benchmarks/rehearse.sh and rehearse_refs.sh: `rehearse_row NAME CMD…` runs one
# rehearsal (CMD, under timeout ROW_TIMEOUT) with a fresh $CKPT, its JSON line appended to
# $OUT/rehearse.jsonl and its stderr in $OUT/NAME.err; prints its rc, time and last lines; keeps
# its profile's kinds.json and ops.txt as $OUT/NAME-*; removes $CKPT.
rehearse_row() {
  local name=$1; shift
  local err="$OUT/$name.err" start rc
  rm -rf "$CKPT"; mkdir -p "$CKPT"
  start=$(date +%s)
  timeout "${ROW_TIMEOUT:-420}" "$@" 2>"$err" | tee -a "$OUT/rehearse.jsonl" >/dev/null
  rc=${PIPESTATUS[0]}
  echo "   rc $rc after $(( $(date +%s) - start )) s; last lines of $err:" >&2
  tail -n 4 "$err" | cut -c1-300 >&2
  find "$CKPT" \( -name kinds.json -o -name ops.txt \) -exec sh -c 'cp "$1" "$2-${1##*/}"' _ {} "$OUT/$name" \;
  rm -rf "$CKPT"
}
