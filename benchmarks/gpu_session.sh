#!/bin/bash
# One device call's work on the GPU host, logs under $OUT (or ./gpu-out). Steps, in the order given:
#   check    the Triton test files (they run natively there) and `pytest -m gpu` over the triton backend
#   full     EJGEN_FULL_SUITE=1 pytest -m gpu (every shape on every accelerator backend; the plain `pytest -m gpu` took
#            9 min on an H200 with -n 14 in session 9, so this step may need FULL_K="..." to split it over two calls)
#   sparse   the block-sparse tests natively (tests/blocksparse, gpu or not) and `pytest -m gpu -k "$SPARSE_K"` (default:
#            the segment-id, mask and Hopper cases of the conformance suite)
#   sparse_bench  benchmarks/blocksparse.py (SPARSE_ARGS) and benchmarks/flex_blocksparse.py (FlexAttention, own process)
#   bench    benchmarks/attention.py --quick (triton, cuDNN, Pallas-Triton mha), BENCH_RUNS times (default 1)
#   kernels  per-kernel times under Nsight Compute (benchmarks/kernel_times.py): KERNEL_CASES, KERNEL_CONFIGS
#   sweep    benchmarks/tune_triton.py --configs SWEEP_CONFIGS --cases SWEEP_CASES (whole configs vs cuDNN)
#   autotune benchmarks/gpu_check.py bfloat16 --autotune
#   ring_tests  pytest -m gpu tests/multidevice/test_ring_gpu.py (ring attention over every GPU of the host, 2+)
#   ring     benchmarks/ring.py RING_ARGS (e.g. "--devices 2"; "--devices 4 --scaling --parts check,time,mesh")
#   ptx      PTX digests of every Triton and Gluon kernel (benchmarks/ptx_digest.py) of this tree and of the tree
#            in $PTX_BASE (a copy of an earlier commit, e.g. `git archive REV | tar -x -C .old`), compared
# e.g.  bash benchmarks/gpu_session.sh check bench
#       KERNEL_CONFIGS="cudnn||dkdv=64,64,4,2,merged,band" bash benchmarks/gpu_session.sh kernels
# Each step has its own time limit; a summary of every step goes to $OUT/session.log and stdout.
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LOG=$OUT/session.log
note() { echo "$@" | tee -a "$LOG"; }
note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
METRICS=gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__occupancy_limit_registers
METRICS=$METRICS,launch__occupancy_limit_shared_mem,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active

for step in "$@"; do
  case $step in
    check)
      export XLA_PYTHON_CLIENT_PREALLOCATE=false  # many pytest processes share the GPU
      timeout 300 python3 -m pytest -q -n 10 -p no:cacheprovider tests/attention/test_triton_band.py tests/attention/test_triton_merged.py \
        tests/attention/test_triton_tma.py tests/attention/test_triton_aot.py > "$OUT/check-files.log" 2>&1
      note "check files rc $?: $(grep -E '[0-9]+ (passed|failed)' "$OUT/check-files.log" | tail -1)"
      EJGEN_FULL_SUITE=1 timeout 300 python3 -m pytest -m gpu -q -n 12 -p no:cacheprovider -k triton tests \
        > "$OUT/check-gpu.log" 2>&1
      note "check gpu rc $?: $(grep -E '[0-9]+ (passed|failed)' "$OUT/check-gpu.log" | tail -1)"
      grep FAILED "$OUT"/check-*.log | tee -a "$LOG" ;;
    full)
      export XLA_PYTHON_CLIENT_PREALLOCATE=false
      EJGEN_FULL_SUITE=1 timeout 560 python3 -m pytest -m gpu -q -n 14 -rf -p no:cacheprovider ${FULL_K:+-k "$FULL_K"} tests \
        > "$OUT/full.log" 2>&1
      note "full rc $?: $(grep -E '[0-9]+ (passed|failed)' "$OUT/full.log" | tail -1)"
      grep FAILED "$OUT/full.log" | tee -a "$LOG" ;;
    sparse)
      export XLA_PYTHON_CLIENT_PREALLOCATE=false
      timeout 400 python3 -m pytest -m "gpu or not gpu" -q -n 12 -rf -p no:cacheprovider tests/blocksparse \
        > "$OUT/sparse-tests.log" 2>&1
      note "sparse tests rc $?: $(grep -E '[0-9]+ (passed|failed)' "$OUT/sparse-tests.log" | tail -1)"
      timeout 400 python3 -m pytest -m gpu -q -n 14 -rf -p no:cacheprovider -k "${SPARSE_K:-seg_ or mask_ or hopper}" \
        tests/attention > "$OUT/sparse-gpu.log" 2>&1
      note "sparse gpu rc $?: $(grep -E '[0-9]+ (passed|failed)' "$OUT/sparse-gpu.log" | tail -1)"
      grep FAILED "$OUT"/sparse-*.log | tee -a "$LOG" ;;
    sparse_bench)
      timeout 500 python3 benchmarks/blocksparse.py --out "$OUT/bs" ${SPARSE_ARGS:-} > "$OUT/bs.log" 2>&1
      note "blocksparse bench rc $?"; cat "$OUT/bs/ejgen.md" >> "$LOG" 2>/dev/null
      env -u PYTHONPATH timeout 400 python3 benchmarks/flex_blocksparse.py --out "$OUT/bs" > "$OUT/flex.log" 2>&1
      note "flex bench rc $?"; cat "$OUT/bs/flex.md" >> "$LOG" 2>/dev/null ;;
    bench)
      for r in $(seq 1 "${BENCH_RUNS:-1}"); do
        timeout 290 python3 benchmarks/attention.py --quick --impls ejgen-triton,cudnn,pallas-mha --out "$OUT/bench$r" \
          > "$OUT/bench$r.log" 2>&1
        note "bench $r rc $?"
        grep -E "^\| (4096|16384) " "$OUT/bench$r/results.md" 2>/dev/null | grep -E "triton|cudnn" | tee -a "$LOG"
      done ;;
    kernels)
      EJGEN_KERNEL_TIMES_ORDER=$OUT/order.txt timeout 300 ncu --clock-control none --cache-control none \
        --profile-from-start off --print-kernel-base demangled --csv --log-file "$OUT/kernels.csv" --metrics "$METRICS" \
        python3 benchmarks/kernel_times.py --cases "${KERNEL_CASES:-16384:1:1024,4096:1}" \
        --configs "${KERNEL_CONFIGS:-cudnn|}" > "$OUT/kernels.out" 2>&1
      note "kernels rc $?"
      python3 benchmarks/kernel_times.py --parse "$OUT/kernels.csv" --order "$OUT/order.txt" | tee -a "$LOG" ;;
    sweep)
      timeout 300 python3 benchmarks/tune_triton.py --jobs 12 --timeout 150 --cases "${SWEEP_CASES:-16384:1:1024,4096:1}" \
        --configs "${SWEEP_CONFIGS:-cudnn|}" > "$OUT/sweep.log" 2>&1
      note "sweep rc $?"
      sed -n '/In order/,$p' "$OUT/sweep.log" | tee -a "$LOG" ;;
    autotune)
      timeout 300 python3 benchmarks/gpu_check.py bfloat16 --autotune > "$OUT/autotune.log" 2>&1
      note "autotune rc $?"
      tail -n 6 "$OUT/autotune.log" | tee -a "$LOG" ;;
    ptx)
      env -u TRITON_INTERPRET timeout 400 python3 benchmarks/ptx_digest.py --jobs 14 > "$OUT/ptx-new.json" 2> "$OUT/ptx.err"
      (cd "${PTX_BASE:-.old}" && ln -sfn ../generated ejgen/generated && env -u TRITON_INTERPRET PYTHONPATH=$PWD:$PYTHONPATH \
        timeout 400 python3 ../benchmarks/ptx_digest.py --jobs 14) > "$OUT/ptx-old.json" 2>> "$OUT/ptx.err"
      python3 benchmarks/ptx_digest.py --compare "$OUT/ptx-old.json" "$OUT/ptx-new.json" | tee -a "$LOG" | head -40 ;;
    ring_tests)
      timeout 400 python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests/multidevice/test_ring_gpu.py \
        > "$OUT/ring-tests.log" 2>&1
      note "ring tests rc $?: $(grep -E '[0-9]+ (passed|failed|skipped)' "$OUT/ring-tests.log" | tail -1)"
      grep FAILED "$OUT/ring-tests.log" | tee -a "$LOG" ;;
    ring)
      timeout 560 python3 benchmarks/ring.py ${RING_ARGS:-} --out "$OUT/ring" > "$OUT/ring.log" 2>&1
      note "ring bench rc $?"; cat "$OUT/ring/ring.md" >> "$LOG" 2>/dev/null ;;
    *)
      note "unknown step '$step' (check, full, sparse, sparse_bench, bench, kernels, sweep, autotune, ptx, ring_tests, ring)"
      exit 2 ;;
  esac
done
