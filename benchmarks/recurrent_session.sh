#!/usr/bin/env bash
# One device call of the linear recurrent family's GPU checks and timings (issue 17; issue 18's context parallelism
# where the host has 2+ GPUs): bash benchmarks/recurrent_session.sh [PART...]  PART: tests | fla | bench | decode | cp
# (decode: the decode step's loop / call table, the fused kernels' block x warps sweep and their profile)
# Run from the repository root after the .whl install line (fla-core, flash-linear-attention, einops among the
# wheels: /work/shared/tools/gpu-wheelhouse fla-core==0.6.0 flash-linear-attention==0.6.0 einops). Logs: $OUT/rec.
set -u
log=$OUT/rec; mkdir -p "$log" bench-out
export TRITON_CACHE_DIR=$PWD/bench-out/triton-cache JAX_COMPILATION_CACHE_DIR=$PWD/bench-out/jax-cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee -a "$log/log.txt"
parts=${*:-tests fla bench decode cp}
for part in $parts; do
  case $part in
    tests) bash benchmarks/gpu_shards.sh rec-tests 240 tests/recurrent 2>&1 | tee -a "$log/log.txt" ;;
    fla) # fla autotunes its kernels on first use (minutes on a fresh host): recurrent_fla.py compiles the configs in
         # parallel, writes fla.json after every case and its autotune results to $log/fla_tuned/<GPU>/ (commit them
         # under benchmarks/fla_tuned/ and the next host skips the tuning); FLA_CASES picks a subset (--cases)
         CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/recurrent_fla.py --out "$log/fla.json" \
             ${FLA_CASES:+--cases "$FLA_CASES"} > "$log/fla.txt" 2>&1
         grep -E "ms|first call [0-9]|Error|rror:" "$log/fla.txt" | tail -30 | tee -a "$log/log.txt" ;;
    bench) fla=(); [ -f "$log/fla.json" ] && fla=(--fla "$log/fla.json")
           CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/recurrent.py "${fla[@]}" \
             --out "$log" 2>&1 | tail -40 | tee -a "$log/log.txt" ;;  # the decode table: part decode
    decode) CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/recurrent.py --decode-only --decode-sweep \
              --decode-profile --out "$log" > "$log/decode.txt" 2>&1
            grep -E "^\||decode|target|rror" "$log/decode.txt" | grep -vE "^\| [0-9.]+ \| [0-9.]+ \|" | tail -80 \
              | tee -a "$log/log.txt"
            head -60 "$log/decode_profile.md" 2>/dev/null | tee -a "$log/log.txt" ;;
    cp) EJGEN_FAILURE_LOG=$log/cp_failures.txt timeout 150 python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests/multidevice/test_recurrent_cp_gpu.py \
             2>&1 | tail -15 | tee -a "$log/log.txt"; cat "$log/cp_failures.txt" 2>/dev/null ;;
    *) echo "unknown part $part" ;;
  esac
done
