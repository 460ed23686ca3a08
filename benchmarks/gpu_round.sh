#!/usr/bin/env bash
# One device call that checks and times what landed since the last GPU run, one lane of jobs per GPU of a 4-GPU host
# (fewer GPUs: lanes share them), every job under a timeout and the whole call under DEADLINE seconds (default 560):
#
#   bash benchmarks/gpu_round.sh [LANE...]   LANE: verify | zoo | intra | rec | fla | gtests | layouts | dispatch (default verify;
#                                            several run in parallel)
#
#   rec    GPUs 0-1: the recurrent GPU suite (3 pytest processes a GPU), then each chunked launch alone
#          (recurrent_kernels.py) on GPU 0, and on GPU 1 the decode table, then (time allowing) every kernel of one
#          call of the zoo's masked cases (trace_table.py: the XLA prologue before the kernel; issues 14, 15)
#                                                                                    (issue 17: the rewritten kernels)
#   fla    GPU 3: flash-linear-attention's times (recurrent_fla.py, its autotune), then ejgen's table with fla's
#          column (recurrent.py --fla)                                               (issue 17's target)
#   gtests GPUs 0-1: the Gluon GPU file sharded (2 processes a GPU; one process takes over 200 s), then the 2-GPU
#          ring's per-device kernel timeline at 32k (ring.py --parts profile)           (issues 14, 18)
#   layouts GPU 2: block layouts vs FlexAttention, 8k first, each case printed as it ends   (issue 14)
#   verify what session 16 landed without a GPU run (4 GPUs, one call):
#          GPU 0: the zoo's spec masks on the Hopper kernels (GPU tests), then the mask variants vs Flex with them on
#          and off (EJGEN_GLUON_SPEC_MASKS A/B); GPU 1: gla's chunked kernels alone, the recurrent Triton GPU tests,
#          then the launch-settings sweep; GPUs 2-3: the ring's GPU tests, the ring timed and profiled, then GPU 2:
#          dispatch.py and documents vs Flex, GPU 3: fla's times and ejgen's recurrent table against them
#   final  session 17's third call (lane_final's comment); last: its fourth, on two GPUs (lane_last's)
#   zoo    GPUs 0 and 3: every zoo case against FlexAttention, half on each (ejgen, then Flex in its own process).
#          Not beside a lane that runs test shards: short kernels are host-bound, and gpt-oss's 80-88 us forward
#          timed 0.586 ms a call beside them (session 17 call 2, H200) against 0.129 alone (call 5, H100); the
#          likely cause, pytest processes compiling on every core, is not proven
#   intra  GPU 1: gla's kernels, the intra-chunk kernels' settings and their Nsight Compute counters; GPU 2: fla and
#          ejgen's recurrent table; then the recurrent Triton GPU tests on both                    (issue 17)
#   dispatch GPU 3: how much of a short call is not its kernels (dispatch.py), with XLA's command buffers on and
#          off, then the zoo's GPU tests                                               (issues 14, 15)
#
# Run from the repository root after the .whl install line (carry .whl). Everything comes back as $OUT/round.txt
# (each job's log, its rc and seconds; the device's file limit is 8 files) and $OUT/fla_tuned.tgz (fla's autotune
# results: `tar xzf` it into benchmarks/fla_tuned/ and commit, so later hosts skip the tuning).
set -u
T0=$(date +%s)
DEADLINE=${DEADLINE:-560}
log=bench-out/round
rm -rf "$log"; mkdir -p "$log" bench-out
export TRITON_CACHE_DIR=$PWD/bench-out/triton-cache JAX_COMPILATION_CACHE_DIR=$PWD/bench-out/jax-cache
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | wc -l)
gpu() { echo $(( $1 % gpus )); }

left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }

job() {  # job NAME SECONDS CMD...: the command under min(SECONDS, time left - 15 s), its output in $log/NAME.txt
  local name=$1 secs=$2 l s rc
  shift 2
  l=$(left)
  if (( l < 45 )); then echo "$name: skipped (deadline)" >> "$log/summary.txt"; return; fi
  (( secs > l - 15 )) && secs=$(( l - 15 ))
  s=$(date +%s)
  timeout "$secs" "$@" > "$log/$name.txt" 2>&1
  rc=$?
  echo "$name: rc $rc in $(( $(date +%s) - s )) s (limit $secs)" >> "$log/summary.txt"
  { cat "$log/summary.txt"; tail -40 "$log/$name.txt"; } >> "$OUT/progress.txt" 2>/dev/null  # a call cut short
}

lane_rec() {
  OUT=$PWD/$log GPUS="$(gpu 0) $(gpu 1)" PER_GPU=3 job rec-tests 300 bash benchmarks/gpu_shards.sh rec-shards 285 \
    tests/recurrent
  CUDA_VISIBLE_DEVICES=$(gpu 0) job rec-kernels 170 python3 benchmarks/recurrent_kernels.py &
  (
    export CUDA_VISIBLE_DEVICES=$(gpu 1)
    job rec-decode 150 python3 benchmarks/recurrent.py --decode-only --out "$log/dec"
    job trace 120 python3 benchmarks/trace_table.py --cases causal,documents,chunked,flamingo --out "$log/trace"
  ) &
  wait
}

lane_fla() {
  export CUDA_VISIBLE_DEVICES=$(gpu 3)
  job fla 330 python3 benchmarks/recurrent_fla.py --out "$log/fla/fla.json"
  local fla=()
  [ -f "$log/fla/fla.json" ] && fla=(--fla "$log/fla/fla.json")
  job rec-bench 180 python3 benchmarks/recurrent.py "${fla[@]}" --out "$log/recb"
}

lane_gtests() {
  OUT=$PWD/$log GPUS="$(gpu 0) $(gpu 1)" PER_GPU=2 job gluon-tests 290 bash benchmarks/gpu_shards.sh gluon-shards 275 \
    tests/attention/test_gluon.py
  CUDA_VISIBLE_DEVICES=$(gpu 0),$(gpu 1) job ring-profile 200 python3 benchmarks/ring.py --devices 2 --parts profile \
    --seqs 32768 --heads 16/16 --passes fwd,fwdbwd --out "$log/ring"
}

lane_layouts() {
  export CUDA_VISIBLE_DEVICES=$(gpu 2)
  job layouts 230 python3 benchmarks/blocksparse.py --layouts-only --layout-tokens 8192 --rounds 2 --reps 4 \
    --out "$log/bs"
  job layouts-flex 120 env -u PYTHONPATH python3 benchmarks/flex_blocksparse.py --reps 6 --out "$log/bs"
  job layouts-32k 200 python3 benchmarks/blocksparse.py --layouts-only --layout-tokens 32768 --rounds 2 --reps 4 \
    --out "$log/bs32"
}

lane_dispatch() {
  export CUDA_VISIBLE_DEVICES=$(gpu 3)
  job dispatch 150 python3 benchmarks/dispatch.py --out "$log/disp"
  job dispatch-nocb 150 env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 benchmarks/dispatch.py \
    --out "$log/disp2"
  EJGEN_FAILURE_LOG=$PWD/$log/zoo-failures.txt job zoo-tests 220 python3 -m pytest -m gpu -q -rf \
    -p no:cacheprovider tests/zoo
}

lane_last() {  # two GPUs, under 4 minutes: the ring timed as the project times (4 calls a sample) with its one-GPU row;
  # then gla's kernels (GPU 0) beside gpt-oss and Gemma 3 alone in zoo.py and gpt-oss's sinks as an argument in
  # dispatch.py (GPU 1); then the recurrent Triton GPU tests with gk (the rewritten kernels)
  CUDA_VISIBLE_DEVICES=$(gpu 0),$(gpu 1) job ring-profile 60 python3 benchmarks/ring.py --devices 2 --parts time \
    --seqs 32768 --heads 16/16 --orders zigzag --passes fwd,fwdbwd --batch 4 --out "$log/ring"
  CUDA_VISIBLE_DEVICES=$(gpu 0) job rec-kernels 70 python3 benchmarks/recurrent_kernels.py --ops gla --no-check \
    --rounds 2 &
  (
    export CUDA_VISIBLE_DEVICES=$(gpu 1)
    job zoo-ejgen-1 60 python3 benchmarks/zoo.py --out "$log/zoo1" --cases gpt_oss,gemma3 --reps 4 --rounds 2
    job dispatch 40 python3 benchmarks/dispatch.py --cases gpt_oss --passes fwd,fwd-args,fwdbwd-args --out "$log/disp"
  ) &
  wait
  OUT=$PWD/$log GPUS="$(gpu 0) $(gpu 1)" PER_GPU=3 job rec-tests 90 bash benchmarks/gpu_shards.sh rec-shards 80 \
    -k "triton and gk" tests/recurrent
}

lane_final() {  # session 17's last call: gla's rewritten intra kernels (GPU 0, then their counters and the zoo's
  # slow gpt-oss case traced), fla and ejgen's recurrent table (GPU 1), the ring after its glue changes with two NCCL
  # settings (GPUs 2-3); then the recurrent Triton GPU tests on GPUs 1-3
  (
    export CUDA_VISIBLE_DEVICES=$(gpu 0)
    job rec-kernels 120 python3 benchmarks/recurrent_kernels.py --ops gla --sweep \
      --sweep-kernels chunk_intra,chunk_grads_intra
    job trace 100 python3 benchmarks/trace_table.py --cases gpt_oss,gemma3,sliding_window --out "$log/trace"
    job ncu 90 ncu --clock-control none -k regex:'chunk_(grads_)?intra' --launch-count 3 --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section LaunchStats \
      python3 benchmarks/recurrent_kernels.py --ops gla --no-check --reps 1 --rounds 1
  ) &
  (
    export CUDA_VISIBLE_DEVICES=$(gpu 1)
    job fla 100 python3 benchmarks/recurrent_fla.py --out "$log/fla/fla.json"
    local fla=()
    [ -f "$log/fla/fla.json" ] && fla=(--fla "$log/fla/fla.json")
    job rec-bench 120 python3 benchmarks/recurrent.py "${fla[@]}" --out "$log/recb"
  ) &
  (
    export CUDA_VISIBLE_DEVICES=$(gpu 2),$(gpu 3)
    EJGEN_FAILURE_LOG=$PWD/$log/ring-failures.txt job ring-tests 100 python3 -m pytest -m gpu -q -rf \
      -p no:cacheprovider tests/multidevice/test_ring_gpu.py
    local ring=(benchmarks/ring.py --devices 2 --seqs 32768 --heads 16/16 --orders zigzag --passes fwd,fwdbwd)
    job ring-profile 100 python3 "${ring[@]}" --parts time,profile --out "$log/ring"
    job ring-memcpy 60 env XLA_FLAGS=--xla_gpu_use_memcpy_local_p2p=true python3 "${ring[@]}" --parts time \
      --out "$log/ring-memcpy"
    job ring-nch4 60 env XLA_FLAGS=--xla_gpu_nccl_p2p_max_nchannels=4 python3 "${ring[@]}" --parts time \
      --out "$log/ring-nch4"
  ) &
  wait
  OUT=$PWD/$log GPUS="$(gpu 1) $(gpu 2) $(gpu 3)" PER_GPU=2 job rec-tests 210 bash benchmarks/gpu_shards.sh \
    rec-shards 195 -k triton tests/recurrent
}

lane_zoo() {  # the whole zoo against Flex, half the cases on each of GPUs 0 and 3 (ejgen, then Flex in its own process)
  local half
  for half in "0 causal,causal_zoo,chunked,dilated,t5,natten1d,natten2d,streaming,gpt_oss" \
              "3 gemma2,gemma3,paligemma,alibi,sliding_tile,sliding_window,documents,flamingo,prefix_lm"; do
    (
      set -- $half
      export CUDA_VISIBLE_DEVICES=$(gpu $1)
      job zoo-ejgen-$1 330 python3 benchmarks/zoo.py --out "$log/zoo$1" --cases "$2" --reps 4 --rounds 2
      job zoo-flex-$1 220 env -u PYTHONPATH python3 benchmarks/flex_zoo.py --out "$log/zoo$1" --cases "$2" --reps 6
      python3 benchmarks/zoo.py --out "$log/zoo$1" --table --plot "" > "$log/zoo$1/table.md" 2>&1
    ) &
  done
  wait
}

lane_intra() {  # GPU 1: gla's chunked kernels alone, the intra-chunk kernels' launch settings, their Nsight Compute
  # counters (occupancy, stall reasons, throughput); GPU 2: fla, then ejgen's recurrent table against it; then the
  # recurrent Triton GPU tests on both
  (
    export CUDA_VISIBLE_DEVICES=$(gpu 1)
    job rec-kernels 150 python3 benchmarks/recurrent_kernels.py --ops gla --sweep \
      --sweep-kernels chunk_intra,chunk_grads_intra
    job ncu 120 ncu --clock-control none -k regex:'chunk_(grads_)?intra' --launch-count 2 --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
      python3 benchmarks/recurrent_kernels.py --ops gla --no-check --reps 1 --rounds 1
  ) &
  (
    export CUDA_VISIBLE_DEVICES=$(gpu 2)
    job fla 120 python3 benchmarks/recurrent_fla.py --out "$log/fla/fla.json"
    local fla=()
    [ -f "$log/fla/fla.json" ] && fla=(--fla "$log/fla/fla.json")
    job rec-bench 150 python3 benchmarks/recurrent.py "${fla[@]}" --out "$log/recb"
  ) &
  wait
  OUT=$PWD/$log GPUS="$(gpu 1) $(gpu 2)" PER_GPU=2 job rec-tests 200 bash benchmarks/gpu_shards.sh rec-shards 185 \
    -k triton tests/recurrent
}

lane_verify() {
  (
    export CUDA_VISIBLE_DEVICES=$(gpu 0)
    EJGEN_FAILURE_LOG=$PWD/$log/zoo-failures.txt job zoo-gluon 200 python3 -m pytest -m gpu -q -rf \
      -p no:cacheprovider tests/zoo/test_zoo_gluon.py
    EJGEN_GLUON_SPEC_MASKS=1 OUT=$PWD/$log job zoo-bench 200 bash benchmarks/zoo_session.sh \
      natten1d,natten2d,dilated,sliding_tile,paligemma,prefix_lm,streaming --first
    cp -r "$log/zoo" "$log/zoo-on" 2>/dev/null
    EJGEN_GLUON_SPEC_MASKS=0 OUT=$PWD/$log/off job zoo-bench-off 150 bash benchmarks/zoo_session.sh \
      natten1d,natten2d,sliding_tile,paligemma,prefix_lm --first
  ) &
  (
    export CUDA_VISIBLE_DEVICES=$(gpu 1)
    job rec-kernels 100 python3 benchmarks/recurrent_kernels.py --ops gla,simple_gla
    OUT=$PWD/$log GPUS="$(gpu 1)" PER_GPU=3 job rec-tests 200 bash benchmarks/gpu_shards.sh rec-shards 185 \
      -k triton tests/recurrent
    job rec-sweep 150 python3 benchmarks/recurrent_kernels.py --ops gla --sweep --no-check
  ) &
  (
    CUDA_VISIBLE_DEVICES=$(gpu 2),$(gpu 3) EJGEN_FAILURE_LOG=$PWD/$log/ring-failures.txt job ring-tests 120 \
      python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests/multidevice/test_ring_gpu.py
    CUDA_VISIBLE_DEVICES=$(gpu 2),$(gpu 3) job ring-profile 170 python3 benchmarks/ring.py --devices 2 \
      --parts time,profile --seqs 32768 --heads 16/16 --orders zigzag --passes fwd,fwdbwd --out "$log/ring"
    (
      export CUDA_VISIBLE_DEVICES=$(gpu 2)
      job dispatch 120 python3 benchmarks/dispatch.py --cases documents,flamingo --out "$log/disp"
      job documents 120 python3 benchmarks/blocksparse.py --documents-only --rounds 2 --reps 4 --out "$log/bs"
      job layouts-flex 90 env -u PYTHONPATH python3 benchmarks/flex_blocksparse.py --reps 6 --out "$log/bs"
    ) &
    (
      export CUDA_VISIBLE_DEVICES=$(gpu 3)
      job fla 150 python3 benchmarks/recurrent_fla.py --out "$log/fla/fla.json"
      fla=()
      [ -f "$log/fla/fla.json" ] && fla=(--fla "$log/fla/fla.json")
      job rec-bench 150 python3 benchmarks/recurrent.py "${fla[@]}" --out "$log/recb"
    ) &
    wait
  ) &
  wait
}

nvidia-smi --query-gpu=index,name --format=csv,noheader > "$log/summary.txt"
for lane in ${*:-verify}; do
  "lane_$lane" &
done
wait
{
  echo "== summary ($(( $(date +%s) - T0 )) s)"; cat "$log/summary.txt"
  [ -f "$log/rec-shards/failures.txt" ] && { echo "== recurrent failures"; cut -c1-400 "$log/rec-shards/failures.txt"; }
  [ -f "$log/gluon-failures.txt" ] && { echo "== gluon failures"; cut -c1-400 "$log/gluon-failures.txt"; }
  [ -f "$log/gluon-shards/failures.txt" ] && { echo "== gluon failures"; cut -c1-400 "$log/gluon-shards/failures.txt"; }
  [ -f "$log/ring-failures.txt" ] && { echo "== ring failures"; cut -c1-400 "$log/ring-failures.txt"; }
  [ -f "$log/rec-failures.txt" ] && { echo "== recurrent failures"; cut -c1-400 "$log/rec-failures.txt"; }
  [ -f "$log/zoo-failures.txt" ] && { echo "== zoo failures"; cut -c1-400 "$log/zoo-failures.txt"; }
  for f in rec-tests gluon-tests rec-kernels rec-decode layouts layouts-flex layouts-32k fla rec-bench \
           dispatch-nocb documents zoo-gluon zoo-bench zoo-bench-off rec-sweep zoo-tests ring-profile ring-tests trace \
           zoo-ejgen-0 zoo-flex-0 zoo-ejgen-3 zoo-flex-3 ring-memcpy ring-nch4 zoo-ejgen-1; do
    [ -f "$log/$f.txt" ] && { echo "== $f"; grep -vE "DeprecationWarning|^  (return|from) " "$log/$f.txt" | tail -70; }
  done
  [ -f "$log/trace/profile.md" ] && { echo "== trace/profile.md"; cat "$log/trace/profile.md"; }
  [ -f "$log/ring/profile.md" ] && { echo "== ring/profile.md"; cat "$log/ring/profile.md"; }
  [ -f "$log/dispatch.txt" ] && { echo "== dispatch (whole)"; grep -vE "DeprecationWarning|^  (return|from) " \
    "$log/dispatch.txt"; }
  [ -f "$log/zoo/table.md" ] && { echo "== zoo/table.md"; cat "$log/zoo/table.md"; }
  [ -f "$log/off/zoo/table.md" ] && { echo "== zoo/table.md (EJGEN_GLUON_SPEC_MASKS=0)"; cat "$log/off/zoo/table.md"; }
  for z in 0 3; do [ -f "$log/zoo$z/table.md" ] && { echo "== zoo$z/table.md"; cat "$log/zoo$z/table.md"; }; done
  [ -f "$log/ncu.txt" ] && { echo "== ncu (whole)"; grep -E "^  [a-z_]+.*kernel|^    [A-Z]" "$log/ncu.txt" \
    | grep -vE "^    (OPT|INF|WRN) " | head -220; }
} > "$OUT/round.txt" 2>&1
tuned=$(find "$log/fla" -maxdepth 1 -name fla_tuned -type d 2>/dev/null)
[ -n "$tuned" ] && tar czf "$OUT/fla_tuned.tgz" -C "$tuned" .
grep -E "^== summary" -A14 "$OUT/round.txt"
