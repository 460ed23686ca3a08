#!/usr/bin/env bash
# One device call that checks and times what landed since the last GPU run: lanes of jobs, each lane on its own GPUs,
# the lanes in parallel, every job under a timeout and the whole call under DEADLINE seconds (default 560):
#
#   bash benchmarks/gpu_round.sh LANE...     LANE: GPUS:JOB[,JOB...]  (GPUS: 0, 2-3, 0,3; jobs run in order)
#                                            or a preset below, e.g. `zoo`
#   bash benchmarks/gpu_round.sh 0:rec-kernels,rec-tests 1:fla,rec-bench 2-3:ring-gaps,ring-time
#
# A lane's GPUs are given to its jobs as CUDA_VISIBLE_DEVICES (a GPU index past the host's wraps around, so a plan for
# 4 GPUs also runs on 2). Jobs (j_<name> below; "(N GPUs)" where a job uses more than one):
#   rec-tests      the recurrent Triton GPU tests, sharded 3 processes a GPU (REC_TESTS_K: their -k) (issue 17)
#   rec-kernels    gla's chunked kernels one by one (recurrent_kernels.py; REC_KERNELS_ARGS adds arguments)
#   rec-kernels-ab the same from abtree/ (a `git archive` of the tree before a change), for a before/after in one call
#   rec-sweep      the same under each launch setting of the intra-chunk kernels
#   rec-sweep-sums the same for the kernels that read chunk_sums' gate sums (and chunk_sums itself)
#   ncu-intra      Nsight Compute counters of the intra-chunk kernels (issue-bound or not; it catches chunk_intra's
#                  two launches first)
#   ncu-grads      the same for chunk_grads_intra alone, with its memory and scheduler counters
#   rec-sweep-long simple_gla's state, output and gradient kernels by launch setting at B2 T16k
#   ncu-src        per-instruction stall samples (SASS, CUDA lines) of the chunked kernels, CSV files in $OUT
#   ncu-qk         Nsight Compute of chunk_grads_qk (simple_gla, then gla): stall reasons, memory, source counters
#                  (~1.0 ms whatever its blocks and warps, session 23)
#   ncu-state      Nsight Compute counters of chunk_state and chunk_output
#   ncu-out        Nsight Compute of chunk_output (NCU_OUT_OPS, the default form): stalls, memory, source counters
#   blocks-first-tests  the GPU tests of host.BLOCKS_FIRST (a chunk's blocks side by side in the grid)
#   fixed-decay-tests   the GPU tests of host.FIXED_DECAY_SUMS (g_gamma alone: its sums formed in the kernels)
#   s33            session 33's new defaults: the scalar gates' GPU tests, then their kernel and op rows (s33-rows)
#   s33e-tests     the scalar gates' chunked GPU tests with BLOCKS_FIRST "always" (default and other forms)
#   rec-full       every recurrent GPU test, 8 processes a GPU (2 GPUs: one call)
#   ring-ab        the ring's default, then --narrow-accumulators (2 GPUs)
#   ring-wire      the ring tests, then the forward reading the wire / merging in its kernel against before (2 GPUs)
#   ring-dq        the ring tests, then the default against --no-kv-from-wire-bwd and --no-dq-once (2 GPUs)
#   ring-paired    one GPU and the ring timed in turns, 7 rounds, 4 and 16 calls a sample (2 GPUs)
#   ring-paired-tuned  ring-paired with XLA's combiner over K and V and NCCL_CGA_CLUSTER_SIZE=0 (the recommended setup)
#   ring-qinplace  the ring tests, then the default against --no-q-in-place and --no-zeros-by-delta (2 GPUs)
#   ring-p5        the ring tests, then the default against --no-dkv-into, each twice, and one call's kernels of each
#   ring-spans     the GPU tests of gluon.host.LAYOUT_SPANS (off), one call's kernels with and without it, each timed
#                  twice; ring-spans-gaps: each form's 16 calls back to back under the profiler
#   docs-ab        the Gluon document tests, then blocksparse.py's probe rows with the DOCS masks (issue 14)
#   held-gates     the GPU tests of the scalar gates held fixed (no log gradient formed), of g_gamma's total and of
#                  chunk_output's L2 prefetch, then their rows, chunk_grads_qk's 3 stages, chunk_output's launches
#   gated-q        the GPU tests of host.GATED_Q (chunk_intra's q ⊙ e^P for gla's chunk_output), then gla's rows
#   fla-profile    fla's B4 T4096 cases, then each one's kernels under torch.profiler (us a call by kernel)
#   fla            flash-linear-attention's times (recurrent_fla.py; its autotune comes back as fla_tuned.tgz)
#   intra-diag     chunk_intra's diagonal from its own launch and in pieces of 4 steps: GPU tests, gla's kernel
#                  rows in each form (inline / kernel, steps / pieces), the diagonal kernel's settings
#   grads-sums     chunk_grads_intra reading chunk_sums' prefix sums: GPU tests, gla's kernel rows both ways
#   state-groups   the state walks in groups: GPU tests, the kernel and op rows both ways (T 16k, 4k)
#   after-sums     the 16-bit after sums stored (the default forms them where read): GPU tests (the rows: any
#                  rec-kernels table)
#   grads-qk-tests chunk_grads_qk's scalar-gate GPU tests (its default form, folded and a program a chunk, and the others)
#   grads-qk       the same, then its forms' kernel and op rows
#   output-ahead   the GPU tests of the forms the defaults do not take (chunk_output's and chunk_grads_v's reads
#                  after their K loops, the adjoint walk through registers, the after sums stored), then the kernel
#                  and op rows of every form (recurrent_kernels.py) for simple_gla, lightning and gla at both shapes
#   rec-bench      ejgen's recurrent table, with fla's column when fla ran before it in the lane (REC_BENCH_ARGS)
#   rec-light      the recurrent table's lightning rows alone
#   rec-decode     the recurrent decode table
#   rec-decode-study  the same with the fused kernels' BV x warps sweep and a 4-step loop's kernels under the profiler
#   attn-tests     every attention GPU test (the Gluon file included), sharded 2 processes a GPU
#   gluon-tests    the Gluon GPU tests, sharded 2 processes a GPU                     (issues 14, 15)
#   zoo-tests      the zoo's GPU tests (every spec on the GPU backends)                (issue 15)
#   zoo-tests-p0, -p1, -p2  a third of them each (one H200: 114 tests, ~13 s a test in a process)
#   hopper-tests   the Gluon GPU tests and the conformance suite's Hopper cases (soft caps, sinks included)
#   zoo-capsinks   the zoo's GPU tests of Gemma 2 / 3, gpt-oss and the sink window (soft caps and sinks)
#   zoo-gluon      the zoo's spec masks on the Hopper kernels
#   zoo-a, zoo-b   half the zoo each against FlexAttention (zoo.py, then flex_zoo.py in its own process). Not beside
#                  a lane that compiles tests: short kernels are host-bound (session 17: gpt-oss's 80-88 us forward
#                  timed 0.586 ms a call beside test shards against 0.129 alone)
#   zoo-a16, zoo-b16  the same at 16 calls a sample (both sides)
#   trace          every kernel of one call of a few masked zoo cases (trace_table.py; TRACE_CASES)
#   trace-natten   the same for causal, NATTEN 2-D and the 8k documents
#   zoo-ab         zoo.py's AB_CASES (default causal,natten2d; 16 calls) here and in each folder of AB_TREES (A/B)
#   flex-ab        FlexAttention on AB_CASES (16 calls), its table beside zoo-ab's main rows
#   staged-bwd     the Hopper backward's position terms read from the table (STAGED_BACKWARD off) in a copy:
#                  NATTEN 2-D / sliding tile zoo rows here (staged, the default since session 26) and there
#   select-once    the Hopper forward's element mask as one predicate in a copy: its Gluon GPU tests (3 processes)
#   select-once-ab the masked zoo rows there and here (session 26: NATTEN 2-D fwd 0.289 there, 0.334-0.338 here in
#                  other calls; the tests ran out of time, 19 passed)
#   ncu-natten     Nsight Compute of NATTEN 2-D's Hopper forward (details and SASS samples into $OUT)
#   docs-plan      the documents' plan kernels: their tests, 16 calls a sample against jnp's plan and Flex, a trace
#   docs-delta     the backward's delta kernel (gluon.host.DELTA_KERNEL) and the DOCS masks: the Gluon document and
#                  sinks tests, 16 calls a sample against each switched (one process) and Flex, a trace
#   docs-masks     the DOCS masks (on since session 36): the Gluon document tests, 16 calls a sample against them off
#                  (one process) and Flex
#   docs-trace     every kernel of the documents' fwd and fwd+bwd calls, and their gaps (issue 14)
#   documents      documents vs Flex (blocksparse.py, flex_blocksparse.py)             (issue 14)
#   documents16    the same at 16 calls a sample (both sides)
#   pause          45 s of nothing (benchmarks after another lane's test shards)
#   layouts        block layouts vs Flex, 8k and 32k
#   dispatch       how much of a short call is not its kernels (dispatch.py: documents, Flamingo)
#   dispatch-nocb  the same with XLA's command buffers off
#   decode         the decode / paged decode table (decode.py)                        (issue 16)
#   decode-tune    the decode kernel's launch settings on the cases short of their targets (decode_tune.py;
#                  DECODE_TUNE_CASES, DECODE_TUNE_SETTINGS; 32 calls a sample, DECODE_TUNE_CALLS), decode-tune-b
#                  and decode-tune-c on others (DECODE_TUNE_CASES_B / _C, DECODE_TUNE_SETTINGS_B / _C)
#   decode-page    paged 64 with the block's page number read once (default) or per key (decode_tune.py)
#   decode-steady  the decode table at 32 calls a sample (the host's first dispatch, ~30 us, amortized)
#   decode-tests   the decode GPU tests, sharded 3 processes a GPU
#   decode-trace   B4 S32k and B32 S8k decode (ejgen, cuDNN) under the profiler: kernels, busy time, gaps
#   hopper-features  soft caps, sinks and cross-attention (Sq != Sk) on the Hopper set against the generated kernels
#                  and cuDNN, same card, with the exact and the fast tanh (hopper_features.py)  (issues 15, 18)
#   launch         the host's cost of one Triton launch by PTX size (launch_cost.py)   (issues 14, 15)
#   ring-tests     the ring's GPU tests (2 GPUs)                                       (issue 18)
#   ring-time      the ring at 32k, zigzag, timed as the project times (2 GPUs)
#   ring-steady    the same at 4 and 16 calls a sample (the host's first dispatch a sample, ~1.4 ms, amortized)
#   ring-wide      the same with and without each later step's two blocks as one call (ring.COALESCE; 2 GPUs)
#   ring-p2p, ring-gaps-p2p, ring-tests-p2p  ring-steady, ring-gaps and ring-tests with XLA's collective-permutes
#                  as peer copies (--xla_gpu_use_memcpy_local_p2p: copy engines, no NCCL kernels on the SMs)
#   ring-gaps      the same calls back to back under the profiler: idle gaps against slower kernels (2 GPUs)
#   ring-gaps16    the ring's forward alone, 16 then 4 calls back to back under the profiler: gaps, kernels a call
#   wide-step      the ring's second step priced apart on one GPU: plain calls against its block lists (wide_step.py)
#   cards          one GPU's 32k causal attention on each card in turns (cards.py: are the host's cards alike?)
#   ring-paired-each  ring-paired with a third form: the one-GPU call on both GPUs at once (every card busy)
#   ring-profile   one call's kernels per device (2 GPUs)
# Every lane also samples its GPUs' SM clocks and power (nvidia-smi, 200 ms) into clocks-<GPUS>.txt.
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
  echo "$name: rc $rc in $(( $(date +%s) - s )) s (limit $secs, GPUs $CUDA_VISIBLE_DEVICES)" >> "$log/summary.txt"
  { cat "$log/summary.txt"; tail -40 "$log/$name.txt"; } >> "$OUT/progress.txt" 2>/dev/null  # a call cut short
}

shards() {  # shards NAME SECONDS PER_GPU PYTEST-ARGS...: gpu_shards.sh over the lane's GPUs (SHARDS_PER_GPU overrides
  # PER_GPU: a lane of test jobs alone on a 4-GPU host keeps 16 processes busy, one of 4 cores each)
  local name=$1 secs=$2 per=${SHARDS_PER_GPU:-$3}
  shift 3
  OUT=$PWD/$log GPUS="${CUDA_VISIBLE_DEVICES//,/ }" PER_GPU=$per job "$name" "$secs" bash benchmarks/gpu_shards.sh \
    "$name-shards" $(( secs - 15 )) "$@"
}

RING=(benchmarks/ring.py --devices 2 --seqs 32768 --heads 16/16 --orders zigzag --passes fwd,fwdbwd)

j_rec-tests() { shards rec-tests 240 3 -k "${REC_TESTS_K:-triton}" tests/recurrent; }
j_intra-diag() {  # chunk_intra's diagonal blocks from a launch of their own (host.CHUNK_INTRA_DIAGONAL "kernel",
  # session 26, not yet GPU-run): its GPU tests, then gla's kernel rows with both forms and the new kernel's settings
  shards intra-diag-tests 200 3 -k diagonal_in_a_kernel tests/recurrent
  job intra-diag 200 python3 benchmarks/recurrent_kernels.py --ops gla --sweep --sweep-kernels chunk_intra_diag
}
j_grads-sums() {  # chunk_grads_intra's exponents from chunk_sums' prefix sums (host.GRADS_INTRA_SUMS, session 27, not
  # yet GPU-run): its GPU tests and the 16-bit strong gates' (NaN rows fixed in session 27), then gla's kernel rows
  # ("chunk_grads_intra, prefix sums", "op fwd+bwd, chunk_grads_intra's prefix sums") at B4 T4096 and B2 T16k
  shards grads-sums-tests 200 3 -k "prefix_sums or strong_gates_in_16" tests/recurrent
  job grads-sums 200 python3 benchmarks/recurrent_kernels.py --ops gla --shapes 4x4096,2x16384 --rounds 2
}
j_state-groups() {  # the state walks in groups (host.STATE_GROUPS; session 28: no gain in the "relative" form; the
  # "rewalk" form NOT yet GPU-run): GPU tests of both forms, then the kernel rows ("chunk_state in N groups ...",
  # "... walked twice", "op fwd / fwd+bwd, the state walks in N groups", "..., N groups walked twice") where it splits
  shards state-groups-tests 200 3 -k "walk_in_groups" tests/recurrent
  job state-groups 330 python3 benchmarks/recurrent_kernels.py --ops simple_gla,lightning_attention,gla \
    --shapes 2x16384,4x4096 --rounds 2 --no-check
}
j_grads-qk-tests() {  # chunk_grads_qk with a scalar gate, folded and a program a chunk (the default since session 30),
  # and its forms before: the scalar-gate chunked GPU tests
  shards grads-qk-tests 240 3 -k "triton and chunked and (simple_gla or lightning)" tests/recurrent
}
j_output-ahead() {  # session 30's forms (on since session 31 but gk's walk as loaded, which lost and is gone): the
  # GPU tests of the forms the defaults do not take, then the kernel and op rows of every form ("chunk_output, reads
  # after the K loop", "chunk_grads_v, ...", "chunk_state_bwd, scaled through registers", "..., blocks of a chunk
  # side by side", the op rows of each) for simple_gla, lightning and gla at B2 T16k and B4 T4096
  j_output-ahead-tests
  j_output-ahead-rows
}
j_output-ahead-tests() {
  shards output-ahead-tests 240 3 -k "other_form or after_sums or through_registers" tests/recurrent
}
j_output-ahead-rows() { job output-ahead 360 python3 benchmarks/recurrent_kernels.py \
  --ops "${OUTPUT_AHEAD_OPS:-simple_gla,lightning_attention,gla}" --shapes "${OUTPUT_AHEAD_SHAPES:-2x16384,4x4096}" \
  --rounds 2 --no-check; }
j_blocks-first-tests() {  # chunk_output's, chunk_grads_v's and chunk_grads_qk's blocks of a chunk side by side in the
  # grid (host.BLOCKS_FIRST, session 31, not yet GPU-run): its GPU tests (the rows: "chunk_output / chunk_grads_v /
  # chunk_grads_qk, blocks of a chunk side by side", "op fwd / fwd+bwd, blocks ...", in every recurrent_kernels.py table)
  shards blocks-first-tests 200 4 -k "blocks_first" tests/recurrent
}
j_gated-q() {  # chunk_intra's q ⊙ e^{P} read by gla's chunk_output (host.GATED_Q, session 32, not yet GPU-run): its GPU
  # tests, then gla's kernel and op rows at both shapes ("chunk_intra / chunk_output / op fwd / op fwd+bwd, q ⊙ e^P
  # ...", in every recurrent_kernels.py table of gla)
  shards gated-q-tests 150 3 -k "gated_q" tests/recurrent
  job gated-q 240 python3 benchmarks/recurrent_kernels.py --ops gla --shapes 2x16384,4x4096 --rounds 2 --no-check
}
j_held-gates() {  # the scalar gates held fixed (chunk_grads_qk without the log gates' gradient) and g_gamma's total
  # (host.GAMMA_TOTAL), session 32, not yet GPU-run: their GPU tests, then the rows ("chunk_grads_qk, the gates held
  # fixed", "..., 3 stages", "..., g_gamma's total" and their "op fwd+bwd" rows) of simple_gla and lightning at both
  # shapes (flip GAMMA_TOTAL where lightning's op fwd+bwd wins at both)
  shards held-gates-tests 200 3 -k "held_fixed or gamma_total" tests/recurrent
  job held-gates 240 python3 benchmarks/recurrent_kernels.py --ops simple_gla,lightning_attention \
    --shapes 2x16384,4x4096 --rounds 2 --no-check
}
j_s33() {  # session 33's defaults (GAMMA_TOTAL, chunk_grads_qk's 3 stages, chunk_output's 4 warps for the scalar
  # gates, FIXED_DECAY_SUMS outside a gradient): the scalar gates' GPU tests, then their kernel and op rows at both
  # shapes (the "(before session 33)" rows are the old defaults)
  shards s33-tests 240 3 -k "triton and chunked and not gk and (against_the_oracle or fixed_decay_sums or gamma_total \
or output_at_chunked or held_fixed)" tests/recurrent
  j_s33-rows
}
j_s33-rows() {
  job s33-rows 240 python3 benchmarks/recurrent_kernels.py --ops simple_gla,lightning_attention \
    --shapes 2x16384,4x4096 --rounds 2 --no-check
}
j_s33e-tests() {  # BLOCKS_FIRST "always" beside session 33's other defaults: the scalar gates' chunked GPU tests of
  # the default forms and of the forms the defaults do not take (chunks first, reads after the K loops, held gates)
  shards s33e-tests 260 3 -k "triton and chunked and not gk and (against_the_oracle or blocks_first or other_forms \
or fixed_decay_sums or gamma_total or held_fixed)" tests/recurrent
}
j_rec-full() {  # every recurrent GPU test (425 under -m gpu in tests/recurrent; ~7.7 process-seconds a test on an H200
  # in session 33): the whole suite in one call on 2 GPUs at 8 processes each (SHARDS_PER_GPU overrides)
  shards rec-full 520 8 tests/recurrent
}
j_fixed-decay-tests() {  # a fixed decay's sums formed in the forward's walk and output kernel (host.FIXED_DECAY_SUMS,
  # session 31, not yet GPU-run): its GPU tests (the rows: "chunk_state / chunk_output / op fwd / op fwd+bwd, a fixed
  # decay's sums formed in the kernels", lightning's in every recurrent_kernels.py table)
  shards fixed-decay-tests 120 3 -k "fixed_decay" tests/recurrent
}
j_grads-qk() {  # the same tests, then the kernel and op rows of chunk_grads_qk's forms ("chunk_grads_qk, unfolded, blocks
  # of K (before session 30)", "op fwd+bwd, chunk_grads_qk ...") for simple_gla and lightning at B2 T16k and B4 T4096
  j_grads-qk-tests
  job grads-qk 240 python3 benchmarks/recurrent_kernels.py --ops simple_gla,lightning_attention \
    --shapes 2x16384,4x4096 --rounds 2 --no-check
}
j_after-sums() {  # 16-bit after sums stored by chunk_sums (host.AFTER_FROM_PREFIX "never"; "always", the default since
  # session 31, forms them where they are read): its GPU tests (the other form's rows, "chunk_sums, after sums stored"
  # and "op fwd / fwd+bwd, ...", come in every recurrent_kernels.py table)
  shards after-sums-tests 150 3 -k "after_sums" tests/recurrent
}
j_rec-kernels() { job rec-kernels 200 python3 benchmarks/recurrent_kernels.py --ops gla,simple_gla ${REC_KERNELS_ARGS:-}; }
j_rec-sweep() { job rec-sweep 150 python3 benchmarks/recurrent_kernels.py --ops gla --sweep --no-check \
  --sweep-kernels chunk_intra,chunk_grads_intra; }
j_rec-sweep-sums() { job rec-sweep-sums 200 python3 benchmarks/recurrent_kernels.py --ops gla --sweep --no-check \
  --sweep-kernels chunk_sums,chunk_state,chunk_output,chunk_state_bwd,chunk_grads_v; }
j_ncu-intra() { job ncu 120 ncu --clock-control none -k regex:'chunk_(grads_)?intra' --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  python3 benchmarks/recurrent_kernels.py --ops gla --no-check --reps 1 --rounds 1; }
j_ncu-grads() { job ncu-grads 120 ncu --clock-control none -k regex:'chunk_grads_intra' --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  --section MemoryWorkloadAnalysis --section SchedulerStats \
  python3 benchmarks/recurrent_kernels.py --ops gla --no-check --reps 1 --rounds 1; }
j_ncu-qk() { job ncu-qk 170 ncu --clock-control none -k regex:'chunk_grads_qk' --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
  python3 benchmarks/recurrent_kernels.py --ops simple_gla,gla --no-check --reps 1 --rounds 1; }
j_ncu-src() {  # per-instruction stall samples (SASS, CSV) of gla's chunked kernels, then simple_gla's, into $OUT
  # (NCU_SRC_OPS "op:launches ..." and NCU_SRC_KERNELS, a regex, narrow it: e.g. "gla:1 lightning_attention:1" and
  # 'chunk_output_kernel' for chunk_output's excessive sectors and L1TEX stalls, session 31's ncu-out)
  local op n
  for op in ${NCU_SRC_OPS:-gla:7 simple_gla:3}; do
    n=${op#*:}; op=${op%:*}
    job ncu-src-$op 150 ncu --clock-control none \
      -k regex:"${NCU_SRC_KERNELS:-chunk_(grads_qk|grads_intra|intra|state|output)_kernel}" \
      --launch-count "$n" --section SourceCounters --section WarpStateStats --import-source yes -f -o "$log/src-$op" \
      python3 benchmarks/recurrent_kernels.py --ops "$op" --no-check --reps 1 --rounds 1
    # (SASS only: the kernels jax-triton launches carry no line info)
    ncu -i "$log/src-$op.ncu-rep" --page source --csv --print-source sass 2> "$log/src-$op-err.txt" \
      | gzip > "$OUT/src-$op.csv.gz"
  done
}
j_rec-sweep-long() { job rec-sweep-long 200 python3 benchmarks/recurrent_kernels.py --ops "${REC_SWEEP_LONG_OPS:-simple_gla}" \
  --shapes "${REC_SWEEP_LONG_SHAPES:-2x16384}" \
  --sweep --no-check --sweep-kernels ${REC_SWEEP_LONG_KERNELS:-chunk_state,chunk_output,chunk_state_bwd,chunk_grads_v,chunk_grads_qk}; }
j_ncu-out() {  # chunk_output under ncu at B4 T4096, the default form, one op after the other (NCU_OUT_OPS; gla's was
  # 1.6x fla's chunk_gla_fwd_kernel_o at B2 T16k in session 31, the scalar gates' 1.2-1.36x fla's chunk_fwd_kernel_o,
  # whatever their launch setting): where its time goes
  local op
  for op in ${NCU_OUT_OPS:-lightning_attention gla}; do
    job "ncu-out-$op" 120 ncu --clock-control none -k regex:'chunk_output_kernel' --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
      python3 benchmarks/recurrent_kernels.py --ops "$op" --no-check --reps 1 --rounds 1
  done
}
j_ncu-state() { job ncu-state 150 ncu --clock-control none -k regex:'chunk_(state|output)_kernel' --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  --section MemoryWorkloadAnalysis --section SchedulerStats \
  python3 benchmarks/recurrent_kernels.py --ops gla --no-check --reps 1 --rounds 1; }
j_fla() { job fla 150 python3 benchmarks/recurrent_fla.py --out "$log/fla/fla.json"; }
j_fla-profile() { job fla 170 python3 benchmarks/recurrent_fla.py --profile --cases "${FLA_PROFILE_CASES:-|B4-T4096|}" \
  --out "$log/fla/fla.json"; }
j_rec-bench() {
  local fla=()
  [ -f "$log/fla/fla.json" ] && fla=(--fla "$log/fla/fla.json")
  job rec-bench 240 python3 benchmarks/recurrent.py "${fla[@]}" ${REC_BENCH_ARGS:-} --out "$log/recb"
}
j_rec-kernels-ab() {  # recurrent_kernels.py of the tree in abtree/ (a `git archive` of the code before a change)
  [ -d abtree ] || { echo "rec-kernels-ab: no abtree/" >> "$log/summary.txt"; return; }
  job rec-kernels-ab 200 env PYTHONPATH="${PYTHONPATH//$PWD/$PWD/abtree}" python3 abtree/benchmarks/recurrent_kernels.py \
    --ops gla,simple_gla --no-check --rounds 2 ${REC_KERNELS_ARGS:-}
}
j_rec-light() { job rec-light 150 python3 benchmarks/recurrent.py --cases lightning --out "$log/light"; }
j_rec-decode() { job rec-decode 150 python3 benchmarks/recurrent.py --decode-only --out "$log/dec"; }
j_rec-decode-study() { job rec-decode-study 240 python3 benchmarks/recurrent.py --decode-only --decode-sweep \
  --decode-profile --out "$log/dec"; cp -r "$log/dec" "$OUT/rec-decode" 2>/dev/null || true; }
j_attn-tests() { shards attn-tests 450 2 tests/attention; }
j_gluon-tests() { shards gluon-tests 290 2 tests/attention/test_gluon.py; }
j_zoo-tests() { shards zoo-tests 220 2 tests/zoo; }
# the same in three parts (~40 tests each, 3 processes): the whole suite on a one-GPU host over two calls
j_zoo-tests-p0() { PART=0/3 shards zoo-tests-p0 250 3 tests/zoo; }
j_zoo-tests-p1() { PART=1/3 shards zoo-tests-p1 250 3 tests/zoo; }
j_zoo-tests-p2() { PART=2/3 shards zoo-tests-p2 250 3 tests/zoo; }
j_hopper-tests() { shards hopper-tests 290 2 tests/attention/test_gluon.py tests/attention/test_conformance.py \
  -k "gluon or hopper_kernels"; }
j_zoo-capsinks() { shards zoo-capsinks 200 2 tests/zoo -k "gemma or gpt_oss or sink"; }
j_zoo-gluon() { shards zoo-gluon 200 2 tests/zoo/test_zoo_gluon.py; }
zoo_half() {  # zoo_half NAME CASES [CALLS a sample, both sides; default 4]
  local calls=${3:-4}
  job zoo-ejgen-$1 330 python3 benchmarks/zoo.py --out "$log/zoo$1" --cases "$2" --reps 4 --rounds 2 --calls "$calls"
  job zoo-flex-$1 220 env -u PYTHONPATH python3 benchmarks/flex_zoo.py --out "$log/zoo$1" --cases "$2" --reps 6 \
    --calls "$calls"
  python3 benchmarks/zoo.py --out "$log/zoo$1" --table --plot "" > "$log/zoo$1/table.md" 2>&1
}
ZOO_A=causal,causal_zoo,chunked,dilated,t5,natten1d,natten2d,streaming,gpt_oss
ZOO_B=gemma2,gemma3,paligemma,alibi,sliding_tile,sliding_window,documents,flamingo,prefix_lm
j_zoo-a() { zoo_half a $ZOO_A; }
j_zoo-b() { zoo_half b $ZOO_B; }
j_zoo-a16() { zoo_half a16 $ZOO_A 16; }
j_zoo-b16() { zoo_half b16 $ZOO_B 16; }
copy_tree() {  # copy_tree DIR: this tree's generated, zoo, ejgen, benchmarks and tests in DIR, its packages linked, to
  # change one thing in and run beside this tree (PYTHONPATH="${PYTHONPATH//$PWD/$PWD/DIR}")
  rm -rf "$1"; mkdir "$1"
  tar --exclude=__pycache__ --exclude=ejgen/generated --exclude=ejgen/zoo -cf - generated zoo ejgen benchmarks tests \
    | tar -x -C "$1"
  (cd "$1" && ln -sfn ../generated ejgen/generated && ln -sfn ../zoo/generated ejgen/zoo)
}
j_zoo-ab() {  # zoo.py's AB_CASES (16 calls a sample) in this tree, then in each of AB_TREES (folders holding a
  # `git archive` of generated, zoo, ejgen and benchmarks, ejgen/generated and ejgen/zoo linked): A/B of kernel changes
  local t
  job zoo-ab-main 150 python3 benchmarks/zoo.py --out "$log/zoo-ab-main" --cases "${AB_CASES:-causal,natten2d}" \
    --reps 4 --rounds 2 --calls 16
  for t in ${AB_TREES:-}; do
    job "zoo-ab-$t" 150 env PYTHONPATH="${PYTHONPATH//$PWD/$PWD/$t}" python3 "$t/benchmarks/zoo.py" \
      --out "$log/zoo-ab-$t" --cases "${AB_CASES:-causal,natten2d}" --reps 4 --rounds 2 --calls 16
  done
}
j_flex-ab() { job flex-ab 200 env -u PYTHONPATH python3 benchmarks/flex_zoo.py --out "$log/zoo-ab-main" \
  --cases "${AB_CASES:-causal,natten2d}" --reps 6 --calls 16; python3 benchmarks/zoo.py --out "$log/zoo-ab-main" \
  --table --plot "" > "$log/zoo-ab-main/table.md" 2>&1; }
j_staged-bwd() {  # the Hopper backward's position terms read from the table (triton/host.STAGED_BACKWARD off) in a
  # copy of this tree against this tree's staged form (on since session 26): NATTEN 2-D's and the sliding tile's rows
  local t=abunstaged
  copy_tree "$t"
  sed -i 's/^STAGED_BACKWARD = True$/STAGED_BACKWARD = False/' "$t/ejgen/runtime/attention/triton/host.py"
  grep -q "^STAGED_BACKWARD = False" "$t/ejgen/runtime/attention/triton/host.py" || echo "staged-bwd: no switch" \
    >> "$log/summary.txt"
  job staged-bwd-main 120 python3 benchmarks/zoo.py --out "$log/zoo-staged" --cases natten2d,sliding_tile --reps 4 \
    --rounds 2 --calls 16
  job staged-bwd-off 120 env PYTHONPATH="${PYTHONPATH//$PWD/$PWD/$t}" python3 "$t/benchmarks/zoo.py" \
    --out "$log/zoo-unstaged" --cases natten2d,sliding_tile --reps 4 --rounds 2 --calls 16
}
select_tree() {  # abselect: a copy of this tree with the Hopper forward's element mask as one predicate (notes/perf.md,
  # session 25), made once a call
  [ -f abselect/.patched ] && return
  copy_tree abselect
  python3 - abselect/ejgen/runtime/attention/gluon/kernels.py <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
old = '        s = gl.where(keep, s, -float("inf"))\n'
new = ('        s = gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; selp.f32 $0, $1, 0fFF800000, p; }",\n'
       '                                      "=r,r,r", [s, keep.to(gl.int32)], dtype=gl.float32, is_pure=True, pack=1)\n')
assert s.count(old) == 1
open(p, "w").write(s.replace(old, new))
PY
  touch abselect/.patched
}
j_select-once() {  # the one-predicate copy's Gluon GPU tests, 3 processes (one H200 ran 19 in 200 s with one)
  select_tree
  PYTHONPATH="${PYTHONPATH//$PWD/$PWD/abselect}" shards select-once-tests 280 3 abselect/tests/attention/test_gluon.py \
    abselect/tests/zoo/test_zoo_gluon.py
}
j_select-once-ab() {  # the masked zoo rows in the one-predicate copy and in this tree, one after the other
  select_tree
  job select-once-zoo 150 env PYTHONPATH="${PYTHONPATH//$PWD/$PWD/abselect}" python3 abselect/benchmarks/zoo.py \
    --out "$log/zoo-select" --cases causal,natten2d,sliding_tile,documents,sliding_window --reps 4 --rounds 2 --calls 16
  job select-once-main 150 python3 benchmarks/zoo.py --out "$log/zoo-noselect" \
    --cases causal,natten2d,sliding_tile,documents,sliding_window --reps 4 --rounds 2 --calls 16
}
j_ncu-natten() {  # Nsight Compute of NATTEN 2-D's Hopper forward: stall reasons, issue, instruction mix, SASS samples
  job ncu-natten 150 ncu --clock-control none -k regex:'gluon_attention_fwd' --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --section SourceCounters --import-source yes -f -o "$log/src-natten" \
    python3 benchmarks/zoo.py --out "$log/zoo-ncu" --cases natten2d --reps 1 --rounds 1 --calls 1
  ncu -i "$log/src-natten.ncu-rep" --page details > "$log/ncu-natten-details.txt" 2>&1
  cp "$log/ncu-natten-details.txt" "$OUT/" 2>/dev/null
  ncu -i "$log/src-natten.ncu-rep" --page source --csv --print-source sass 2> /dev/null | gzip > "$OUT/src-natten.csv.gz"
}
j_trace() { job trace 120 python3 benchmarks/trace_table.py \
  --cases "${TRACE_CASES:-causal,documents,chunked,flamingo}" --out "$log/trace"; }
j_trace-natten() { TRACE_CASES=causal,natten2d,documents j_trace; }
j_documents() {
  job documents 120 python3 benchmarks/blocksparse.py --documents-only --rounds 2 --reps 4 --out "$log/bs"
  job layouts-flex 90 env -u PYTHONPATH python3 benchmarks/flex_blocksparse.py --reps 6 --out "$log/bs"
}
j_docs-trace() {  # every kernel of one documents call (8k / 8, 32k / 64; fwd, fwd+bwd) and 4 calls' span and gaps
  job docs-trace 150 python3 benchmarks/blocksparse.py --documents-only --doc-cases 8192x8,32768x64 --rounds 1 \
    --reps 2 --trace --out "$log/bs-trace"
}
j_docs-plan() {  # the documents' plan in two Triton launches a pass (gluon.host.PLAN_KERNELS, session 35): the Gluon
  # document tests, then 16 calls a sample against the plan in jnp (one process) and FlexAttention (its own), then
  # every kernel of one call
  shards docs-tests 240 3 -k "document_masks or persistent or segment" tests/attention/test_gluon.py
  job docs-plan 200 python3 benchmarks/blocksparse.py --documents-only --rounds 2 --reps 4 --calls 16 \
    --switch PLAN_KERNELS=0 --out "$log/bs16"
  job documents16-flex 120 env -u PYTHONPATH python3 benchmarks/flex_blocksparse.py --reps 6 --calls 16 \
    --out "$log/bs16"
  j_docs-trace
}
j_docs-delta() {  # the backward's delta in a Triton kernel (gluon.host.DELTA_KERNEL, session 36) and the forward's DOCS
  # masks again (off since session 34: a 4-call probe) at 16 calls a sample, documents and plain causal, then Flex
  shards docs-tests 240 3 -k "document_masks or persistent or segment or sinks or gluon_forward" \
    tests/attention/test_gluon.py
  job docs-delta 260 python3 benchmarks/blocksparse.py --doc-cases 8192x8,32768x64 --layout-tokens "" --rounds 2 \
    --reps 4 --calls 16 --switch DELTA_KERNEL=0 --switch DOCS_MASKS=1 --out "$log/bs16"
  job documents16-flex 120 env -u PYTHONPATH python3 benchmarks/flex_blocksparse.py --reps 6 --calls 16 \
    --out "$log/bs16"
  j_docs-trace
}
j_docs-masks() {  # the forward's DOCS masks, on since session 36: the Gluon document tests, then 16 calls a sample
  # against them off (one process) and Flex (its own), then every kernel of each form's calls
  shards docs-tests 240 3 -k "document_masks or persistent or segment" tests/attention/test_gluon.py
  job docs-masks 200 python3 benchmarks/blocksparse.py --documents-only --doc-cases 8192x8,32768x64 --rounds 2 \
    --reps 4 --calls 16 --switch DOCS_MASKS=0 --out "$log/bs16"
  job documents16-flex 120 env -u PYTHONPATH python3 benchmarks/flex_blocksparse.py --reps 6 --calls 16 \
    --out "$log/bs16"
}
j_documents16() {
  job documents16 150 python3 benchmarks/blocksparse.py --documents-only --rounds 2 --reps 4 --calls 16 \
    --out "$log/bs16"
  job documents16-flex 120 env -u PYTHONPATH python3 benchmarks/flex_blocksparse.py --reps 6 --calls 16 \
    --out "$log/bs16"
}
j_tile-costs() {  # what a tile costs the Hopper kernels beside its blocks (a fit over lengths), and the forward with
  # head sections of 32 MiB
  job tile-costs 300 python3 benchmarks/tile_costs.py --l2-kv-budget 32 --out "$log/tile-costs"
}
j_l2-ab() { job l2-ab 280 python3 benchmarks/blocksparse.py --documents-only --causal --doc-cases 8192x8,32768x64 \
  --rounds 3 --reps 4 --calls 16 --switch L2_KV_BUDGET=33554432 --out "$log/bs-l2"; }  # the forward's head sections
# of 32 MiB against 16 (gluon.host.L2_KV_BUDGET): documents and the causal call, one process (session 37's tile-costs
# traces: every causal length faster at 32)
j_pause() { sleep 45; }  # a lane's benchmarks after another lane's test shards have compiled
j_layouts() {
  job layouts 230 python3 benchmarks/blocksparse.py --layouts-only --layout-tokens 8192 --rounds 2 --reps 4 \
    --out "$log/bs"
  job layouts-flex 120 env -u PYTHONPATH python3 benchmarks/flex_blocksparse.py --reps 6 --out "$log/bs"
  job layouts-32k 200 python3 benchmarks/blocksparse.py --layouts-only --layout-tokens 32768 --rounds 2 --reps 4 \
    --out "$log/bs32"
}
dispatch() {  # dispatch NAME XLA_FLAGS
  job "$1" 100 env XLA_FLAGS="$2" python3 benchmarks/dispatch.py --cases documents,flamingo --out "$log/$1"
}
j_dispatch() { dispatch dispatch ""; }
j_dispatch-nocb() { dispatch dispatch-nocb --xla_gpu_enable_command_buffer=; }
j_decode() { job decode 300 python3 benchmarks/decode.py --out "$log/decode"; }
j_decode-steady() { job decode-steady 420 python3 benchmarks/decode.py --calls "${DECODE_CALLS:-32}" --platforms triton,cudnn \
  --out "$log/decode-steady"; }
decode_tune() {  # decode_tune NAME CASES SETTINGS (decode_tune.py --settings; empty: its own list)
  job "$1" 300 python3 benchmarks/decode_tune.py --budget-s 260 --out "$log/$1" --cases "$2" --settings "$3" \
    --calls "${DECODE_TUNE_CALLS:-32}"
}
j_decode-tune() { decode_tune decode-tune "${DECODE_TUNE_CASES:-decode-B4-S32k,paged16-B8-S8k,decode-B8-S8k}" \
  "${DECODE_TUNE_SETTINGS:-}"; }
j_decode-tune-b() { decode_tune decode-tune-b "${DECODE_TUNE_CASES_B:-decode-B32-S8k,decode-B8-S8k}" \
  "${DECODE_TUNE_SETTINGS_B:-}"; }
j_decode-tune-c() { decode_tune decode-tune-c "${DECODE_TUNE_CASES_C:-paged16-B4-S32k,paged16-B32-S8k}" \
  "${DECODE_TUNE_SETTINGS_C:-${DECODE_TUNE_SETTINGS:-}}"; }
j_decode-page() {  # pages of whole blocks read once a block (the default) or per key (decode.WHOLE_PAGE off), beside
  # the contiguous batches: the paged 64 B8 S8k shortfall of session 26 (0.90 of contiguous)
  decode_tune decode-page "decode-B8-S8k,paged64-B8-S8k,paged16-B8-S8k,decode-B4-S32k,paged64-B4-S32k" \
    "64,2,4,1,4,4096,0,0"
}
j_decode-clamp-ab() {  # paged16's ragged B32 batch, 0.97 of contiguous in session 29, 0.91 in session 34: this tree
  # against copies of generated, zoo, ejgen and benchmarks made before the call (the tree before the paged call's
  # clamps moved into the kernel, this tree without the page numbers' clamps), each run in its own process, in the
  # order DECODE_AB_ORDER_<GPU> gives ("main" and the copies' folder names)
  local t n=0 order=DECODE_AB_ORDER_${CUDA_VISIBLE_DEVICES%%,*} tag
  for t in ${!order:-main}; do
    n=$(( n + 1 )); tag="$t-g$CUDA_VISIBLE_DEVICES-$n"
    if [ "$t" = main ]; then
      job "dab-$tag" 90 python3 benchmarks/decode.py --cases paged16-B32-ragged16k,paged16-B8-S8k \
        --calls 128 --platforms triton --out "$log/dab-$tag"
    else
      (cd "$t" && ln -sfn ../generated ejgen/generated && ln -sfn ../zoo/generated ejgen/zoo)
      job "dab-$tag" 90 env PYTHONPATH="${PYTHONPATH//$PWD/$PWD/$t}" python3 "$t/benchmarks/decode.py" \
        --cases paged16-B32-ragged16k,paged16-B8-S8k --calls 128 --platforms triton --out "$log/dab-$tag"
    fi
  done
}
j_decode-trace() { job decode-trace 150 python3 benchmarks/decode.py --cases B4-S32k,B32-S8k --platforms triton,cudnn \
  --trace --rounds 2 --out "$log/dtrace"; }
j_hopper-features() { job hopper-features 240 python3 benchmarks/hopper_features.py --fast-tanh both --cross-backward \
  --out "$log/hfeat"; }
j_decode-tests() { shards decode-tests 200 3 tests/decode; }
j_launch() { job launch 90 python3 benchmarks/launch_cost.py --out "$log/launch"; }
j_ring-tests() { EJGEN_FAILURE_LOG=$PWD/$log/ring-failures.txt job ring-tests 240 python3 -m pytest -m gpu -q -rf \
  -p no:cacheprovider tests/multidevice/test_ring_gpu.py; }
j_docs-ab() {  # session 33's document forms: the forward's DOCS masks (gluon.host.DOCS_MASKS, off) and the
  # backward one program a key block (PERSISTENT_SEGMENTS_BWD off; on since session 34): the Gluon document tests
  # (every form, and the windows' persistent backward), then blocksparse.py's probe rows ("ejgen-triton documents,
  # DOCS masks" / ", per-program backward" beside the default, the ideal's causal call and the other probes, one
  # process) at 8k / 8 and 32k / 64 documents
  shards docs-tests 240 3 -k "document_masks or persistent or window" tests/attention/test_gluon.py
  job docs-ab 300 python3 benchmarks/blocksparse.py --documents-only --probe --doc-cases 8192x8,32768x64 --rounds 2 \
    --reps 4 --out "$log/bs-docs"
}
j_ring-ab() {  # session 33's ring experiments (notes/perf.md, "Session 33"): the default, then each flag in its own
  # process (the one GPU timed in each: compare each ring row with its own run's one-GPU row)
  job ring-ab-base 150 python3 "${RING[@]}" --parts time,gaps --out "$log/ring-ab-base"  # (gaps: device spans)
  job ring-ab-narrow 110 python3 "${RING[@]}" --parts time --narrow-accumulators --out "$log/ring-ab-narrow"
}
ring_forms() {  # ring_forms NAME FORM...: the ring GPU tests, then twice each FORM ("label:ring.py flags") in its own
  # process, one after another (compare each ring row with its own run's one-GPU row)
  local name=$1 i f
  shift
  EJGEN_FAILURE_LOG=$PWD/$log/ring-failures.txt job "$name-tests" 180 python3 -m pytest -m gpu -q -rf \
    -p no:cacheprovider tests/multidevice/test_ring_gpu.py
  for i in 1 2; do
    for f in "$@"; do
      # shellcheck disable=SC2086  # (the form's flags, word-split)
      job "$name-${f%%:*}-$i" 80 python3 "${RING[@]}" --parts time ${f#*:} --out "$log/$name-${f%%:*}-$i"
    done
  done
}
j_ring-wire() {  # the coalesced forward reading K and V out of the received buffer (ring.KV_FROM_WIRE) and merging
  # into the first step's result in its kernel (ring.MERGE_IN_KERNEL), both on since session 34, against the forms
  # before them
  ring_forms ring-wire "base:--no-kv-from-wire --no-merge-in-kernel" "on:--no-merge-in-kernel" "merge:"
}
j_ring-dq() {  # the backward's pairs adding dQ into one accumulator in their kernels (ring.DQ_ONCE) and reading K
  # and V out of the received buffer (ring.KV_FROM_WIRE_BWD), both on since session 35, against the forms before them
  ring_forms ring-dq "base:--no-kv-from-wire-bwd --no-dq-once" "once:--no-kv-from-wire-bwd" "wire:"
}
j_ring-qinplace() {  # the backward's pairs reading q and dO in place (ring.Q_IN_PLACE) and the dQ accumulator
  # zeroed by the delta launch's memset (ring.ZEROS_BY_DELTA), both on since session 37: the ring tests, then the
  # default against each off, each twice in its own process (session 37's call 1 ran it with both off by default)
  ring_forms ring-qinplace "base:--no-q-in-place --no-zeros-by-delta" "q:--no-zeros-by-delta" "both:"
}
j_ring-p5() {  # the backward's first step's pairs writing dK / dV into the buffer that travels home (ring.DKV_INTO,
  # on since session 37; session 37's call 3 ran it with it off by default): the ring tests (its zigzag-dkv-into form
  # among them), the default against it off twice each in its own process, then one call's kernels of each
  ring_forms ring-p5 "base:--no-dkv-into" "p5:"
  job ring-trace-p5-base 100 python3 "${RING[@]}" --parts profile --passes fwdbwd --no-dkv-into \
    --out "$log/ring-trace-p5-base"
  job ring-trace-p5 100 python3 "${RING[@]}" --parts profile --passes fwdbwd --out "$log/ring-trace-p5"
}
j_ring-l2() {  # the forward's head sections of 32 MiB of K and V (gluon.host.L2_KV_BUDGET, default 16; session 36: 8
  # made the ring's first step 3-4% slower) against the default, one GPU's and the ring's calls alike, twice each
  local i
  for i in 1 2; do
    job "ring-l2-base-$i" 80 python3 "${RING[@]}" --parts time --passes fwd --out "$log/ring-l2-base-$i"
    job "ring-l2-32-$i" 80 python3 "${RING[@]}" --parts time --passes fwd --l2-kv-budget 32 --out "$log/ring-l2-32-$i"
  done
}
j_ring-trace-dkv() {  # one call's kernels without ring.DKV_INTO, then with it (its default): does the first step's
  # pair kernels' +2% of session 37's call 3 come back?
  job ring-trace-dkv-off 100 python3 "${RING[@]}" --parts profile --passes fwdbwd --no-dkv-into \
    --out "$log/ring-trace-dkv-off"
  job ring-trace-dkv-on 100 python3 "${RING[@]}" --parts profile --passes fwdbwd --out "$log/ring-trace-dkv-on"
}
j_ring-spans() {  # the wide step walking its tiles' spans of key blocks (gluon.host.LAYOUT_SPANS, off; session 39)
  # against its block lists (the default): the GPU tests (the kernel's own against the oracle, the ring's forms), one
  # forward call's kernels of each form, then each timed twice in its own process (session 39's calls 5-7: the step
  # faster in the traces, the forward slower timed at 16 calls a sample)
  EJGEN_FAILURE_LOG=$PWD/$log/ring-failures.txt job ring-spans-tests 180 python3 -m pytest -m gpu -q -rf \
    -p no:cacheprovider tests/attention/test_gluon.py::test_gluon_layout_spans_merged_match_the_oracle \
    tests/multidevice/test_ring_gpu.py
  job ring-spans-trace-on 90 python3 "${RING[@]}" --parts profile --passes fwd --layout-spans \
    --out "$log/ring-spans-trace-on"
  job ring-spans-trace-off 90 python3 "${RING[@]}" --parts profile --passes fwd --out "$log/ring-spans-trace-off"
  local i
  for i in 1 2; do
    job "ring-spans-on-$i" 70 python3 "${RING[@]}" --parts time --passes fwd --batch 4,16 --layout-spans \
      --out "$log/ring-spans-on-$i"
    job "ring-spans-off-$i" 70 python3 "${RING[@]}" --parts time --passes fwd --batch 4,16 \
      --out "$log/ring-spans-off-$i"
  done
}
j_ring-spans-gaps() {  # LAYOUT_SPANS under a sustained load: 16 forward calls back to back under the profiler (each
  # kernel's first and last durations, the batch's middle as it ran and the host's launches then), each form once
  job ring-spans-gaps-on 90 python3 "${RING[@]}" --parts gaps --passes fwd --batch 16 --layout-spans \
    --out "$log/ring-spans-gaps-on"
  job ring-spans-gaps-off 90 python3 "${RING[@]}" --parts gaps --passes fwd --batch 16 --out "$log/ring-spans-gaps-off"
}
TUNED=(env XLA_FLAGS=--xla_gpu_collective_permute_combine_threshold_bytes=1073741824 NCCL_CGA_CLUSTER_SIZE=0)
j_ring-paired-tuned() {  # the ring in the configuration docs/DESIGN.md §3 recommends (Ring attention, the hop): XLA's
  # combiner over K and V (ring.KV_APART then on), NCCL's kernels without clusters (the first step spares
  # ring.HOP_SMS, the wide step walks spans); in turns with one GPU, fwd and fwd+bwd
  job ring-paired-tuned 150 "${TUNED[@]}" python3 "${RING[@]}" --parts paired --rounds 7 --batch 4,16 \
    --out "$log/ring-paired-tuned"
}
j_ring-paired-128k() {  # 128k in turns with one GPU, 3 rounds of 4 calls a sample: the tuned setup, then the default
  local at=(benchmarks/ring.py --devices 2 --seqs 131072 --heads 16/16 --orders zigzag --passes fwd,fwdbwd
    --parts paired --rounds 3 --batch 4 --reps 3)
  job ring-paired-128k-tuned 150 "${TUNED[@]}" python3 "${at[@]}" --out "$log/ring-paired-128k-tuned"
  job ring-paired-128k 150 python3 "${at[@]}" --out "$log/ring-paired-128k"
}
j_ring-schedule() {  # where XLA schedules the hop's start against the first step's launch (ring.py --parts schedule):
  # the lists (default), spans, K and V apart with the combiner's threshold raised, and that with spans (session 40)
  local comb=(env XLA_FLAGS=--xla_gpu_collective_permute_combine_threshold_bytes=1073741824)
  job ring-schedule-lists 60 python3 "${RING[@]}" --parts schedule --passes fwd --out "$log/ring-schedule-lists"
  job ring-schedule-spans 60 python3 "${RING[@]}" --parts schedule --passes fwd --layout-spans \
    --out "$log/ring-schedule-spans"
  job ring-schedule-apart 60 "${comb[@]}" python3 "${RING[@]}" --parts schedule --passes fwd \
    --out "$log/ring-schedule-apart"
  job ring-schedule-apart-spans 60 "${comb[@]}" python3 "${RING[@]}" --parts schedule --passes fwd --layout-spans \
    --out "$log/ring-schedule-apart-spans"
}
j_ring-qspacer-ab() {  # s40h: spans with ring.Q_SPACER (16M items) put the hop first on both devices without any
  # process variable (0 / 0 of 16 late) and ran 1.80x in turns at 16 calls (5 rounds), but its tie then was a pass
  # over the output. With the one-element tie: 4M and 16M items under the profiler, then 16M in turns with one GPU
  # against the default and the tuned setup, one call
  local n
  for n in 4194304 16777216; do
    job "ring-qspacer-gaps-$n" 60 python3 "${RING[@]}" --parts gaps --passes fwd --batch 16 --layout-spans \
      --q-spacer "$n" --out "$log/ring-qspacer-gaps-$n"
  done
  job ring-qspacer-paired 90 python3 "${RING[@]}" --parts paired --passes fwd,fwdbwd --rounds 7 --batch 4,16 \
    --layout-spans --q-spacer 16777216 --out "$log/ring-qspacer-paired"
  job ring-paired-default 90 python3 "${RING[@]}" --parts paired --passes fwd --rounds 7 --batch 4,16 \
    --out "$log/ring-paired-default"
  job ring-paired-tuned-fwd 90 "${TUNED[@]}" python3 "${RING[@]}" --parts paired --passes fwd --rounds 7 \
    --batch 4,16 --out "$log/ring-paired-tuned-fwd"
}
j_ring-paired() { job ring-paired 200 python3 "${RING[@]}" --parts paired --rounds 7 --batch 4,16 \
  --out "$log/ring-paired"; }  # one GPU and the ring in turns: the same clocks for both (session 36)
j_ring-paired-each() { job ring-paired-each 300 python3 "${RING[@]}" --parts paired --each --rounds 7 --batch 4,16 \
  --out "$log/ring-paired-each"; }  # (with a third form in the turns: the one-GPU call on both GPUs at once)
j_ring-paired-p5() { job ring-paired-p5 200 python3 "${RING[@]}" --parts paired --rounds 7 --batch 4,16 \
  --out "$log/ring-paired-p5"; }  # (the same, run with ring.DKV_INTO on while it was off by default: session 37)
j_ring-time() { job ring-time 100 python3 "${RING[@]}" --parts time --out "$log/ring"; }
j_ring-steady() { job ring-steady 170 python3 "${RING[@]}" --parts time --batch 4,16 --out "$log/ring-steady"; }
P2P=--xla_gpu_use_memcpy_local_p2p=true  # collective-permutes between one process's GPUs as copies (copy engines)
j_ring-p2p() { job ring-p2p 170 env XLA_FLAGS="$P2P" python3 "${RING[@]}" --parts time --batch 4,16 \
  --out "$log/ring-p2p"; }
j_ring-gaps-p2p() { job ring-gaps-p2p 120 env XLA_FLAGS="$P2P" python3 "${RING[@]}" --parts gaps \
  --out "$log/ring-p2p"; }
j_ring-tests-p2p() { EJGEN_FAILURE_LOG=$PWD/$log/ring-p2p-failures.txt job ring-tests-p2p 120 env XLA_FLAGS="$P2P" \
  python3 -m pytest -m gpu -q -rf -p no:cacheprovider tests/multidevice/test_ring_gpu.py; }
j_ring-wide() { job ring-wide 150 python3 "${RING[@]}" --parts time --coalesce both \
  --out "$log/ring-wide"; }
j_ring-gaps() { job ring-gaps 120 python3 "${RING[@]}" --parts gaps --out "$log/ring"; }
j_wide-step() {  # the ring's second step priced apart on one GPU: plain calls against its block lists (wide_step.py)
  job wide-step 150 python3 benchmarks/wide_step.py --out "$log/wide-step"
}
j_cards() {  # one GPU's 32k causal attention on each card in turns (issue 18's ring runs at its slower card's pace)
  job cards 150 python3 benchmarks/cards.py --seq 32768 --heads 16 --batch 16 --rounds 5
}
j_ring-gaps16() {  # where the ring's forward loses at 16 calls a sample (session 38: 1.67-1.71x against 1.76-1.79 at
  # 4): 16 forward calls back to back under the profiler, then 4
  job ring-gaps16 120 python3 "${RING[@]}" --parts gaps --passes fwd --batch 16 --out "$log/ring-gaps16"
  job ring-gaps4 120 python3 "${RING[@]}" --parts gaps --passes fwd --batch 4 --out "$log/ring-gaps4"
}
j_ring-profile() { job ring-profile 100 python3 "${RING[@]}" --parts profile --out "$log/ring"; }

lane() {  # lane GPUS JOBS: the jobs in order on those GPUs, their clocks sampled meanwhile
  local ids=() part a b j
  for part in ${1//,/ }; do
    if [[ $part == *-* ]]; then a=${part%-*}; b=${part#*-}; else a=$part; b=$part; fi
    for ((j = a; j <= b; j++)); do ids+=($(( j % gpus ))); done
  done
  export CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${ids[*]}")
  nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 200 \
    -i "$CUDA_VISIBLE_DEVICES" > "$log/clocks-$1.txt" 2>&1 &
  local smi=$!
  for j in ${2//,/ }; do
    if declare -F "j_$j" > /dev/null; then "j_$j"; else echo "$j: no such job" >> "$log/summary.txt"; fi
  done
  kill $smi 2>/dev/null
}

declare -A PRESETS=(
  [zoo]="0:zoo-a 3:zoo-b"
  [rec]="0:rec-kernels,rec-sweep 1:fla,rec-bench 2-3:rec-tests"
  [attention]="0-1:gluon-tests,zoo-tests 2:documents,dispatch 3:layouts"
  # what session 19 staged: the cross backward and the fast tanh checked, the soft cap and sinks timed against the
  # generated kernels, the ring with coalesced backward steps, decode under the profiler
  [staged]="0:gluon-tests 1:hopper-features,decode-trace 2-3:ring-wide"  # (ring-wide-bwd until session 38)
  # what session 20 left unchecked on a GPU: the decode tests with the hoisted param loads, the conformance suite's
  # Hopper cases with the narrow-window rule (an int window's sides) and sinks kept on the Hopper set, the ring at
  # 4 and 16 calls a sample; then (another call, nothing beside it) the zoo
  [next]="0-1:hopper-tests,zoo-capsinks 2-3:decode-tests,ring-tests,ring-steady"
  # what session 21 left for the next: the recurrent table with the 16-bit forward states (rec-bench's
  # ejgen-triton-16bit-states beside fla) and their GPU tests, and traces of NATTEN 2-D and the 8k documents
  # on a quiet GPU
  [s22]="0:fla,rec-bench 1:trace-natten 2-3:rec-tests"
  # session 22's first call: the ring with peer copies against NCCL's kernels; decode at 32 calls after the
  # scalar arrays' marker, with its tests; fla's kernels one by one beside ejgen's and the bf16 chunk states
  [s22a]="0-1:ring-steady,ring-p2p,ring-tests-p2p 2:decode-steady,decode-tests 3:fla-profile,rec-bench,rec-kernels"
  # what session 22 left for the next: the Gluon / conformance / zoo GPU tests not run since the scalar arrays'
  # marker (session 21); where chunk_intra's time goes (its two parts alone, by warps: the state-study job, removed in
  # session 31 with its script) beside fla and
  # ejgen's recurrent table (after the gate sums and the bf16 chunk states); the tests in a call of their own (fla's
  # host-bound forward timed 1.148 ms beside test shards against 0.748 without, session 22)
  [s23]="0:fla,rec-bench 1:rec-kernels"
  [s23-tests]="0-1:hopper-tests,zoo-capsinks 2-3:rec-tests,decode-tests,ring-tests"
  # what session 23 left for the next: the scalar gates' sums from chunk_sums (not GPU-run: rec-bench's
  # -inline-sums row is the form before), where chunk_grads_qk's ~1 ms goes (Nsight Compute), fla beside them; then,
  # in a call of their own, the recurrent GPU tests, the Gluon / conformance cases not reached in session 23's lane,
  # and the ring tests (no 2-GPU host was lent in session 23)
  [s24]="0:fla,rec-bench,rec-kernels,ncu-qk"
  [s24-tests]="0:rec-tests,decode-tests 1:hopper-tests,ring-tests"
  # what session 25 left for the next: the staged backward's GPU tests and times (s25a); the whole zoo against
  # FlexAttention at 16 calls a sample after the position terms (issue 15's table; on one GPU the halves take a call
  # each: s25b, s25c); then the element mask as one predicate A/B'd (notes/perf.md, session 25: AB_TREES with the
  # patch, AB_CASES causal,natten2d,documents)
  [s25a]="0:zoo-gluon,staged-bwd"
  [s25b]="0:zoo-a16"
  [s25c]="0:zoo-b16"
  [s25d]="0:select-once"
  [s25e]="0:decode-steady,decode-tests"  # the decode kernel's partials of real rows only (session 25, not GPU-run)
  # what session 26 left for the next (one H200; each call ~7-9 min, so ~3 fit a session's 30 min): the whole zoo GPU
  # suite in thirds after the position terms and the staged backward (issue 15's last condition: s26a, then s26b with
  # chunk_intra's diagonal forms, issue 17); the one-predicate mask's tests and A/B (s26c); decode's page reads and
  # table (issue 16: paged B8 S8k fell to 0.90-0.94 of contiguous in session 26: s26d)
  # session 27's, in this order: the state walks in groups (issue 17's T16k gap, s27b), chunk_grads_intra from the
  # prefix sums and the decode table at 32 calls (issue 16: paged B8 S8k was 0.96 / 0.99 of contiguous at 128 calls
  # in decode_tune, 0.94 / 0.90 in session 26's table; s27a); then the recurrent table with what won (s27c: flip the
  # defaults first); the one-predicate mask still undecided (s26c)
  # session 28's for the next: the state walks in groups walked twice (STATE_GROUP_FORM "rewalk", issue 17's T16k
  # gap) and the after sums formed by their readers (AFTER_FROM_PREFIX; s28a: both built, not GPU-run), then the
  # recurrent table with what won (s27c, after flipping it on); the decode table at 128 calls with the same-rounds
  # contiguous pair and the pages in order (DECODE_CALLS=128 ... decode-steady: paged B8 S8k 0.91-0.92, issue 16)
  # (session 29: s28b's page numbers read up front tied; removed)
  # session 29 left: chunk_grads_qk's scalar-gate forms (s29a: flip host.GRADS_QK_FOLD and GRADS_QK_SCALAR_TILES if
  # "op fwd+bwd, chunk_grads_qk folded, a program a chunk" wins at both shapes), then the table against fla after the
  # walks' 4 stages (s29b); on a 2-GPU host both at once: `0:grads-qk 1:fla,rec-bench`
  # (session 30: s29a's folded chunk_grads_qk won at both shapes, on by default; s30a: its tests with the new default,
  # then the table against fla)
  [s30a]="0:grads-qk-tests,fla,rec-bench"
  # where the B2 T16k forwards' time goes against fla's (issue 17's gap): fla's kernels under the profiler at that
  # shape (FLA_PROFILE_CASES='|B2-T16384|'), then simple_gla's walks and output kernel by launch setting there
  # the scalar gates' walk with kᵀ fed as loaded and e^R on v (chunk_state's V_GATED, session 30's SASS study, not yet
  # GPU-run): its GPU tests, then the table against fla (s30c; REC_TESTS_K as below)
  [s30c]="0:rec-tests,fla,rec-bench"
  # session 30 left: chunk_output's and chunk_grads_v's reads ahead, the gk walk and the adjoint walk as loaded
  # (s31a: flip host.OUTPUT_AHEAD, GRADS_V_AHEAD, GK_WALK_AS_LOADED (removed since), ADJOINT_AS_LOADED where their
  # rows win at both shapes); then the table against fla again (s31b)
  [s31a]="0:output-ahead"  # (~8 min on one H200: if the call runs short, s31a-tests then s31a-rows)
  [s31a-tests]="0:output-ahead-tests"
  [s31a-rows]="0:output-ahead-rows"
  [s31b]="0:fla,rec-bench"
  # (session 31: s31a's reads ahead (chunk_output's for every gate, chunk_grads_v's for scalar gates), the adjoint walk as
  # loaded and the after sums formed by their readers for every gate won, on by default; s31c: the forms the defaults no
  # longer take, then the chunked Triton GPU tests of the new defaults (REC_TESTS_K as below), 4 processes)
  [s31c]="0:output-ahead-tests,rec-tests"  # REC_TESTS_K="triton and chunked and not other_form and not after_sums
  # and not grads_intra and not groups" SHARDS_PER_GPU=4
  [s31d]="0:fla,rec-bench,ncu-out"  # the table against fla with s31a's forms on; chunk_output under ncu
  [s31e]="0:ncu-out"
  # session 31 left: a chunk's blocks side by side in the grid (host.BLOCKS_FIRST) and a fixed decay's sums formed in
  # the kernels (host.FIXED_DECAY_SUMS): their GPU tests, then the rows of simple_gla, lightning and gla at B2 T16k and
  # B4 T4096 (flip each where its "op fwd, ..." and "op fwd+bwd, ..." rows win at both shapes), then the table against
  # fla again (s31d's first two jobs, s32b)
  [s32a]="0:blocks-first-tests,fixed-decay-tests,output-ahead-rows"
  [s32b]="0:fla,rec-bench"
  [s32d]="0:gated-q"  # (session 32: BLOCKS_FIRST on for gk, FIXED_DECAY_SUMS flat, then s32b; s32d: GATED_Q)
  [s32e]="0:rec-tests,fla,rec-bench"  # REC_TESTS_K="triton and chunked and gk": GATED_Q and BLOCKS_FIRST on for gk;
  # the table with o returned by every fwd+bwd (before, XLA dropped chunk_output there: nothing read its o)
  # session 32 left: the scalar gates held fixed (RecurrentConfig.log_grads; lightning's fla comparison, whose backward
  # forms no g_gamma gradient: rec-bench's "ejgen-triton-fixed-decay" rows), g_gamma's total (host.GAMMA_TOTAL),
  # chunk_grads_qk at 3 stages and the scalar gates' chunk_output at fla's launch and at 4 warps (the helper studies'
  # rows in the held-gates job's tables; flip what wins at both shapes), then the table against fla
  [s33a]="0:held-gates,fla,rec-bench"
  # session 33: s33a's winners on (GAMMA_TOTAL, 3 stages, 4-warp chunk_output, FIXED_DECAY_SUMS outside a gradient):
  # their tests and rows (s33b), then the table against fla (s33c, REC_BENCH_ARGS="--no-variants")
  [s33b]="0:s33"
  [s33c]="0:fla,rec-bench"
  [s33d]="0:s33-rows,fla,rec-bench"  # (s33b's rows stopped on the grouped chunk_grads_qk at 3 stages: 248 KB)
  [s33e]="0:s33e-tests,fla,rec-bench"  # BLOCKS_FIRST "always": SHARDS_PER_GPU=5, REC_BENCH_ARGS="--no-variants"
  # session 34, all on kind nvidia-h200-x2 (a lane a GPU: one call's time runs two jobs' worth), DEADLINE=560:
  # s34a the whole recurrent GPU suite on session 33's final tree (issue 17's last condition); s34b the decode GPU
  # tests and the paged decode's stages A/B'd beside the contiguous batches (DECODE_TUNE_CALLS=128; issue 16) on GPU 0,
  # the forward's DOCS masks for packed documents, tests and probe rows (issue 14) on GPU 1; s34c the ring's
  # experiments, each against the default in the same call (issue 18: the backward as one call, dK/dV accumulators in
  # bf16, the wide step by head sections)
  [s34a]="0-1:rec-full"
  [s34b]="0:decode-tests 1:docs-ab"  # (and decode-paged-stages, removed with decode.PAGED_STAGES after it ran)
  [s34c]="0-1:ring-ab"  # (and ring-ab-sections, removed with gluon.host.LAYOUT_HEAD_SECTIONS after it ran, and
  # ring-ab-coalesce-bwd, removed with ring.COALESCE_BACKWARD in session 38)
  # then (DECODE_AB_ORDER_0="abtree-fix main abtree-fix", trees made by hand) "0-1:decode-clamp-ab,ring-wire"; the
  # last call s34e: the decode GPU tests and the paged rows with the register fix in the template, the ring's new
  # defaults timed
  # s34d the decode table at 128 calls a sample (issue 16) on GPU 0; the documents against FlexAttention at 16 calls,
  # the persistent backward on (issue 14), on GPU 1
  [s34d]="0:decode-steady 1:documents16"
  [s34e]="0-1:decode-tests,decode-clamp-ab,ring-time"
  # session 35: the ring's one dQ accumulator (ring.DQ_ONCE) and the backward reading the wire (KV_FROM_WIRE_BWD)
  # tested and A/B'd on 2 GPUs (issue 18), DEADLINE=560
  [s36a]="0:docs-delta"  # (DOCS_MASKS was off then: its --switch DOCS_MASKS=1 row is the default since)
  [s36b]="0-1:ring-steady"  # (session 36's call 2 also ran ring-trace-p7: P7's trace; P7 removed after)
  [s37d]="0:tile-costs"  # (one GPU: the per-tile cost of the Hopper kernels, issue 14's short lists, 18's 16k steps)
  [s39d]="0-1:ring-spans,ring-paired"  # (the wide step by its tiles' spans, gluon.host.LAYOUT_SPANS: tests, traces,
  # A/B, then the forward and fwd+bwd in turns with one GPU)
  [s41a]="0-1:ring-qspacer-ab"  # (session 41 first, ~6 min: spans with a kernel on q after the hop's start, the
  # one-element tie, under the profiler and in turns against the default and the tuned setup. If its hop is first on
  # both devices and it beats the default at 16 calls, make it the default (spans + spacer): the process defaults
  # would then need no variable; run ring-tests with it)
  # s40h: 0-1:ring-qspacer (session 40: spans with a kernel on q ahead of the first step, after the hop's start; the
  # job went, superseded by ring-qspacer-ab). s40a-d: their jobs went once answered (BENCHMARKS.md "Session 40")
  [s40g]="0-1:ring-schedule"  # (session 40: the hop's start in XLA's schedule, lists / spans / apart)
  [s40f]="0-1:ring-paired-128k"  # (session 40: the tuned setup at 128k, against the default, in turns with one GPU)
  [s40e]="0-1:ring-tests,ring-paired-tuned,ring-paired"  # (session 40's final tree: the ring's GPU tests with the
  # apart and hop-SMs forms, the tuned configuration and the default in turns with one GPU)
  # s40d: 0-1:ring-apart-spans (session 40's fourth: KV_APART with LAYOUT_SPANS, without NCCL's variable)
  # s40c: 0-1:ring-apart (session 40's third: K and V sent apart, one collective by XLA's combiner, no pack)
  # s40b: 0-1:ring-cga-paired (session 40's second: the forward in turns with one GPU, lists and spans with
  # NCCL_CGA_CLUSTER_SIZE=0 and 8 SMs spared (both hops on time in s40a), 4 spared under the profiler, lists plain)
  # s40a: 0-1:ring-cga (session 40's first ran ring-cga and ring-spacer: spacers of 4M-64M items between the pack
  # and the first step left the hop late on 7-15 of 16 calls; removed with ring.SPACER_BEFORE_FIRST_STEP. Since then
  # NCCL_CGA_CLUSTER_SIZE=0 alone spares ring._hop_sms' 8 SMs and walks spans: ring-cga0-gaps no longer runs without)
  [s39g]="0-1:ring-spans-gaps,ring-paired"  # (LAYOUT_SPANS off again: where the hop's launch goes with it on, then
  # the default in turns with one GPU)
  [s39e]="0-1:ring-spans-gaps"  # (LAYOUT_SPANS sustained; its timed half was ring-spans-on/off-3, 4)
  # s39f: ring-spare (ring.FIRST_STEP_SPARE_SMS 8 / 16, the lists, copy engines, each under the profiler and timed at
  # 16 calls a sample; the job went with the switch, which is back: ring.FIRST_STEP_SPARE_SMS, session 40)
  # s39c: hop-after (the first step's kernel without the hop beside it, ring.HOP_AFTER_FIRST_STEP, removed after it
  # answered: 51-57 us)
  [s39b]="0:wide-step"  # (one GPU: what the wide step's lists, order and L2 cost; notes/studies/s37-ring-fwd.md, A)
  # s39a: ring-apart, ring-paired-apart (ring.SEND_APART's fourth form; removed with it after it lost: BENCHMARKS.md
  # "Session 39")
  [s38h]="0-1:ring-tests,ring-time"  # (after ring.COALESCE_BACKWARD's removal: every ring GPU test, the timed ring)
  [s38g]="0-1:ring-paired-each"  # (the ring in turns with one GPU, and with one GPU's call on both cards at once)
  [s38f]="0-1:cards,ring-gaps16"  # (the cards' speeds; the ring's kernels over 16 and 4 calls)
  [s38e]="0-1:ring-gaps16"  # (session 38's calls 2-4 ran s38b-d: ring.SEND_APART, K and V as two hops, which lost
  # three ways and was reverted: BENCHMARKS.md "Session 38")
  # s38a: ring-sections (gluon.host.LAYOUT_HEAD_SECTIONS; removed with it in session 39: it lost in session 38)
  [s37g]="0-1:ring-paired,ring-trace-dkv"  # (the ring's final defaults in turns with one GPU, then DKV_INTO's traces)
  [s37f]="0:l2-ab"  # (one GPU: head sections of 32 MiB timed against 16, documents and causal)
  [s37e]="0-1:ring-l2,tile-costs"  # (head sections of 32 MiB on 2 GPUs, then the tile costs on GPU 0)
  [s37c]="0:hopper-tests,documents16"  # (the backward kernel's new DKV_IN on one GPU: every Hopper test, documents)
  [s37b]="0-1:ring-p5,ring-paired-p5"  # (ring.DKV_INTO: tests, A/B, traces; then it in turns with one GPU)
  [s37a]="0-1:ring-qinplace"  # (Q_IN_PLACE and ZEROS_BY_DELTA: tests, A/B; then ring-trace-coalesce, option B's
  # trace, removed with ring.COALESCE_BACKWARD in session 38)
  [s36c]="0:docs-masks"  # (session 36's call 4 ran docs-dqcast: the in-kernel dQ cast's forms, removed: it lost)
  [s35a]="0-1:ring-dq"
  [s35b]="0:docs-trace"
  [s35c]="0:docs-plan"
  [s35d]="0-1:ring-tests"  # (session 35's call 5 ran ring-p7: P7's tests and A/B; P7 lost and was removed)
  [s32c]="0:ncu-src"  # NCU_SRC_OPS="gla:1 lightning_attention:1" NCU_SRC_KERNELS=chunk_output_kernel: which loads
  # make gla's chunk_output's 27% excessive sectors and its L1TEX stalls (session 31's ncu-out)
  [s30b]="0:fla-profile,rec-sweep-long"  # (FLA_PROFILE_CASES='|B2-T16384|' REC_SWEEP_LONG_KERNELS=chunk_state,...)
  [s29a]="0:grads-qk"
  [s29b]="0:fla,rec-bench"
  [s28a]="0:after-sums,state-groups"
  [s27a]="0:grads-sums,decode-steady"
  [s27b]="0:state-groups"
  [s27c]="0:fla,rec-bench"
  [s26a]="0:zoo-tests-p0,zoo-tests-p1"
  [s26b]="0:zoo-tests-p2,intra-diag"
  [s26c]="0:select-once,select-once-ab"
  [s26d]="0:decode-page,decode-steady"
)
plan=()
for arg in "${@:-zoo}"; do
  if [[ -n ${PRESETS[$arg]+x} ]]; then plan+=(${PRESETS[$arg]}); else plan+=("$arg"); fi
done

nvidia-smi --query-gpu=index,name --format=csv,noheader > "$log/summary.txt"
echo "plan: ${plan[*]}" >> "$log/summary.txt"
for l in "${plan[@]}"; do
  lane "${l%%:*}" "${l#*:}" &
done
wait
{
  echo "== summary ($(( $(date +%s) - T0 )) s)"; cat "$log/summary.txt"
  for f in "$log"/*-shards/failures.txt "$log"/*-failures.txt; do
    [ -f "$f" ] && { echo "== failures: $f"; cut -c1-400 "$f"; }
  done
  for f in "$log"/*.txt; do
    case $(basename "$f") in summary.txt|clocks-*|ncu.txt|ncu-grads.txt|dispatch*.txt) continue;; esac
    echo "== $(basename "$f" .txt)"; grep -vE "DeprecationWarning|^  (return|from) " "$f" | tail -70
  done
  for f in "$log"/clocks-*.txt; do  # per GPU: samples, median and lowest SM clock, highest power
    echo "== $(basename "$f" .txt): GPU samples median-MHz min-MHz max-W"
    python3 - "$f" <<'PY'
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    cells = [c.split()[0] for c in line.split(",")]
    try:
        rows[cells[0]].append((float(cells[1]), float(cells[2])))
    except (IndexError, ValueError):
        pass
for gpu, r in sorted(rows.items()):
    print(gpu, len(r), statistics.median(c for c, _ in r), min(c for c, _ in r), max(w for _, w in r))
PY
  done
  for f in "$log"/trace/profile.md "$log"/ring/profile.md "$log"/ring/gaps.md "$log"/zoo*/table.md; do
    [ -f "$f" ] && { echo "== $f"; cat "$f"; }
  done
  for f in "$log"/dispatch*.txt; do
    [ -f "$f" ] && { echo "== $(basename "$f" .txt) (whole)"; grep -vE "DeprecationWarning|^  (return|from) " "$f"; }
  done
  for f in "$log"/ncu*.txt; do
    [ -f "$f" ] && { echo "== $(basename "$f" .txt) (whole)"; grep -E "^  [a-z_]+.*kernel|^    [A-Z]" "$f" \
      | grep -vE "^    (OPT|INF|WRN) " | head -220; }
  done
} > "$OUT/round.txt" 2>&1
tar czf "$OUT/logs.tgz" -C "$log" $(cd "$log" && ls *.txt) 2>/dev/null  # every job's whole output in one file
# (round.txt has tails; the device tool returns few files)
tuned=$(find "$log/fla" -maxdepth 1 -name fla_tuned -type d 2>/dev/null)
[ -n "$tuned" ] && tar czf "$OUT/fla_tuned.tgz" -C "$tuned" .
grep -E "^== summary" -A20 "$OUT/round.txt"
