#!/usr/bin/env bash
# One device call of the multi-GPU ring checks and timings (issue 18 item 6, issue 19), on a host of N GPUs:
#   bash benchmarks/ring_session.sh N PART...      PART: tests | check | time16 | time32 | mesh | scaling
# Run from the repository root after the .whl install line (carry .whl). Logs go to $OUT/ring-N.
set -u
n=$1; shift
log=$OUT/ring-$n; mkdir -p "$log" bench-out
export TRITON_CACHE_DIR=$PWD/bench-out/triton-cache JAX_COMPILATION_CACHE_DIR=$PWD/bench-out/jax-cache
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a "$log/log.txt"
for part in "$@"; do
  case $part in
    tests) timeout 300 python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests/multidevice/test_ring_gpu.py 2>&1 \
             | tail -30 | tee -a "$log/log.txt" ;;
    check) timeout 300 python3 benchmarks/ring.py --devices "$n" --parts check --out "$log/check" 2>&1 \
             | tail -25 | tee -a "$log/log.txt" ;;
    time16) timeout 400 python3 benchmarks/ring.py --devices "$n" --parts time --heads 16/16 --budget-s 330 \
             --out "$log/time16" 2>&1 | tail -40 | tee -a "$log/log.txt" ;;
    time32) timeout 400 python3 benchmarks/ring.py --devices "$n" --parts time --heads 32/8 --reps 3 --budget-s 330 \
             --out "$log/time32" 2>&1 | tail -40 | tee -a "$log/log.txt" ;;
    mesh) timeout 300 python3 benchmarks/ring.py --devices "$n" --parts mesh --heads 16/16 --out "$log/mesh" 2>&1 \
             | tail -20 | tee -a "$log/log.txt" ;;
    scaling) timeout 560 python3 benchmarks/ring.py --devices "$n" --scaling --parts mesh --heads 16/16 \
             --budget-s 480 --out "$log/scaling" 2>&1 | tail -40 | tee -a "$log/log.txt" ;;
    *) echo "unknown part $part" ;;
  esac
done
