#!/usr/bin/env bash
# One device call of the zoo benchmark (benchmarks/zoo.py and flex_zoo.py on the same cases, the same machine):
#   bash benchmarks/zoo_session.sh CASES [--first]
# CASES: a comma-separated list of zoo_cases keys. --first starts a fresh bench-out/zoo (else the rows of earlier
# calls on this machine are kept: --merge). Logs and the JSON go to $OUT/zoo. Triton and JAX caches live under
# bench-out/ (ignored by git, kept on a warm machine between calls).
set -u
cases=$1
merge=--merge
[ "${2:-}" = "--first" ] && merge= && rm -rf bench-out/zoo
mkdir -p bench-out/zoo "$OUT/zoo"
export TRITON_CACHE_DIR=$PWD/bench-out/triton-cache JAX_COMPILATION_CACHE_DIR=$PWD/bench-out/jax-cache
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a "$OUT/zoo/log.txt"
python3 benchmarks/zoo.py --out bench-out/zoo --cases "$cases" $merge --reps 4 --rounds 2 2>&1 | tail -40 \
  | tee -a "$OUT/zoo/log.txt"
env -u PYTHONPATH python3 benchmarks/flex_zoo.py --out bench-out/zoo --cases "$cases" $merge --reps 6 2>&1 \
  | tail -30 | tee -a "$OUT/zoo/log.txt"
python3 benchmarks/zoo.py --out bench-out/zoo --table 2>&1 | tee "$OUT/zoo/table.md"
cp bench-out/zoo/*.json bench-out/zoo/*.npz "$OUT/zoo/" 2>/dev/null
