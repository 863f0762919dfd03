# The GPU suite in two device calls (it runs longer than one call's 10 minutes on one GPU):
# HALF=1 or HALF=2 runs that half of tests/gpu's collected tests, in collection order, each
# test's outcome in $OUT/gpu-half$HALF.txt.
#   HALF=1 bash benchmarks/probes/gpu_suite_half.sh; HALF=2 bash benchmarks/probes/gpu_suite_half.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ids=$(python -m pytest tests/gpu --collect-only -q -p no:cacheprovider | grep "::")
n=$(echo "$ids" | wc -l); h=$(( (n + 1) / 2 ))
if [ "${HALF:-1}" = 1 ]; then sel=$(echo "$ids" | head -n $h); else sel=$(echo "$ids" | tail -n +$((h + 1))); fi
timeout ${LIMIT:-560} python -m pytest -v -p no:cacheprovider --durations=10 $sel > $OUT/gpu-half${HALF:-1}.txt 2>&1
echo "pytest rc $? (half ${HALF:-1} of $n tests)"
grep -E "PASSED|FAILED|ERROR|SKIPPED" $OUT/gpu-half${HALF:-1}.txt | grep -v PASSED | tail -20
grep -cE " PASSED" $OUT/gpu-half${HALF:-1}.txt; tail -3 $OUT/gpu-half${HALF:-1}.txt
