#!/usr/bin/env bash
# A GPU test selection spread over every GPU of the host, one pytest per GPU (tests round-robin), each failure's
# message logged the moment it happens (EJGEN_FAILURE_LOG, tests/conftest.py), so a shard cut short by its limit
# still says what failed and by how much:
#   bash benchmarks/gpu_shards.sh NAME SECONDS PYTEST-ARGS...    e.g.  bash benchmarks/gpu_shards.sh rec 240 tests/recurrent
# Logs: $OUT/NAME/shardI.txt (pytest -v), $OUT/NAME/failures.txt; prints the outcome counts and the failures.
# GPUS="0 1 2" picks the GPUs (default: all); PER_GPU=N runs N pytest processes on each (compiling is CPU-bound:
# the GPU host's 16 cores a GPU keep several busy). PART="i/n" keeps the i-th of n interleaved parts of the selection
# (0-based): a suite longer than one call split over several.
set -u
name=$1; limit=$2; shift 2
log=$OUT/$name; mkdir -p "$log"
read -ra gpu_list <<< "${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | tr '\n' ' ')}"
shards=$(( ${#gpu_list[@]} * ${PER_GPU:-1} ))
python3 -m pytest --co -q -m gpu -p no:cacheprovider "$@" 2>/dev/null | grep "::" \
  | awk -v part="${PART:-0/1}" 'BEGIN { split(part, p, "/") } NR % p[2] == p[1]' > "$log/ids.txt"
echo "$(wc -l < "$log/ids.txt") tests over GPUs ${gpu_list[*]} in $shards processes, ${limit}s each"
for ((i = 0; i < shards; i++)); do
  awk -v i=$i -v n=$shards 'NR % n == i' "$log/ids.txt" > "$log/ids$i.txt"
  [ -s "$log/ids$i.txt" ] || continue
  CUDA_VISIBLE_DEVICES=${gpu_list[$((i % ${#gpu_list[@]}))]} EJGEN_FAILURE_LOG=$log/failures.txt \
    EJGEN_SHARD_SELECTION=$log/ids.txt timeout "$limit" \
    python3 -m pytest -m gpu -v --tb=no -p no:cacheprovider $(cat "$log/ids$i.txt") > "$log/shard$i.txt" 2>&1 &
done
wait
failed=$(cat "$log"/shard*.txt | grep -cE ' (FAILED|ERROR)')
unreached=$(( $(wc -l < "$log/ids.txt") - $(cat "$log"/shard*.txt | grep -cE ' (PASSED|FAILED|SKIPPED|ERROR)') ))
echo "passed $(cat "$log"/shard*.txt | grep -c ' PASSED') failed $failed not reached $unreached"
[ -f "$log/failures.txt" ] && cut -c1-300 "$log/failures.txt"
(( failed == 0 && unreached == 0 ))  # the status: 0 only where every test ran and passed
