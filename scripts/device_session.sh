#!/usr/bin/env bash
# One device call made of named stages, each under its own time limit, logging to $OUT/<stage>.log (at
# most 8 files come back from a device call; suites add their JSON, multirank a .log too). Written for the
# first session with a GPU after the multi-process, training, layouts, small-message, plain-jit and
# context work that no GPU had run.
# Usage: STAGES="matmul ranks2 multirank2" PREBUILT=.prebuilt PK_JAX_COMMIT=<sha> bash scripts/device_session.sh
# Stages (one GPU unless noted):
#   matmul      GEMM GPU tests, every layout (NN/NT/TN/TT), poisoned outputs            ~2 min
#   ranks2      2 ranks sharing GPU 0 under MPS: init + each op once vs NumPy            ~1 min
#   multirank2  python -m pk_jax.bench multirank --ranks 2 (ops, training, jit, small, soak, faults) ~4 min
#   multirank4  the same at 4 ranks                                                      ~7 min
#   small2      multirank at 2 ranks with the small-message path on (PK_JAX_SMALL_PATH=1) ~3 min
#   layouts     python -m pk_jax.bench gemm --layouts (NT/TN vs cuBLAS, target 0.95)    ~1 min
#   model       python -m pk_jax.bench model --group 1 (target fwd+bwd >= 0.98x XLA)     ~5 min
#   demo        python -m pk_jax.bench demo                                              ~1 min
#   democlone   the tree (no builds) copied to a fresh directory, then `bash scripts/demo.sh` there
#               (set-up + build + demo, as a new user runs it; issue 28: <= 2 min after the build)  ~2 min
#   attention   our attention kernel's GPU tests (both schedules), then its bench         ~6 min
#   grouped     grouped_matmul GPU tests, then its bench rows (vs ragged_dot_mgpu, jnp.dot)  ~2 min
#   sdpa        the cuDNN default of the library attention: its tests, Ulysses' reference tests, an S 8192 timeline ~4 min
#   groupedab   grouped_matmul bench rows once per extension in AB_PREBUILT (A/B of two builds, same machine) ~2x2 min
#   soab        bench rows AB_ARGS once per extension in AB_PREBUILT, AB_TURNS turns (A/B of builds, same Python)
#   bwdstalls   Nsight Compute stall sampling of the attention backward, ours and cuDNN's (BWD_NCU_WHO; + the loop
#               summary, memory): B4 S8192 with BWD_NCU_ARGS (else NCU_ARGS), e.g. "--seq 16384 --batch 2 --causal", or
#               per BWD_NCU_CFGS "B:S:N:D:K[:causal]", two of ours then classed by scripts/ncu_per_task.py  ~5 min
#   attnpower   SM clock, power and throttle reasons under ours and cuDNN's attention run back to back, per
#               ATTN_POWER_CFGS "B:S:N:D[:causal][:grads]" (scripts/attention_power.py; ATTN_POWER_ARGS)  ~40 s each
#   attntimeline device 0's kernels of one attention fwd+bwd, ours and cuDNN's, per ATTN_TL_CFGS "B:S:N:D[:causal]"
#               (scripts/attention_timeline.py; default 4:16384:16:128:causal)  ~1 min each
#   pytests     the GPU tests named by PYTESTS (pytest arguments; PYTESTS_LIMIT seconds, default 200)
#   fwdstalls   Nsight Compute on the attention forward, ours and cuDNN's (FWD_NCU_WHO), per FWD_NCU_CFGS "D:B:S:N" (two of
#               ours: scripts/ncu_per_task.py on them, the shorter first; the SASS
#               with per-instruction samples: $OUT/src-fwd-<who>-d<D>-s<S>.csv; the hot loop: ncu_loop_summary.py) ~4 min
#   fwdvariant  the forward variant FWD_NAME: its first look (bounded waits), its float32-reference and same-bits
#               tests, then rows beside the default (FWD_CASES / FWD_SEQS / FWD_DIMS; FWD_OTHERS: more variants) ~6 min
#   bwdvariant  the backward variant BWD_NAME: its first look (under 80 s), its variant tests, the ring's in-place
#               dQ tests under it, then fwd+bwd rows beside the default (BWD_CASES / BWD_SEQS / BWD_DIMS)   ~6 min
#   attnbwd     the attention backward kernel (opt-in): its first test alone under 90 s (a hang costs
#               only that), then every backward test, then the fwd_bwd bench rows            ~5 min
#   fdshare     2 and 4 ranks sharing the GPU, XLA's memory shared by POSIX fd (no staging)  ~1 min
#   latency     (2 GPUs+) all_reduce latency sweep, small path on (PK_JAX_SMALL_PATH=1), forced variants   ~2 min
#   latdefault  (2 GPUs+) the latency sweep and the floor slopes at defaults                    ~1.5 min
#   latfloor2   (4 GPUs) the floor slopes at defaults on GPUs PAIR (default 0,1)              ~1 min
#   ulysses8k   (4 GPUs) Ulysses forward timelines at S 8192 / 2048 on GPUs PAIR, then its 2-GPU forward rows  ~3 min
#   ringfloor   (2 GPUs+) issue 26's compute floor at defaults (S 12288, every ring case)          ~4 min
#   timeline49k (4 GPUs) a timeline of the non-causal ring forward at S 49152 at defaults    ~1.5 min
#   collectives (2 GPUs+) the collectives suite at defaults (issue 25: <= 90 s)              ~1.5 min
#   smallfused  multirank check_ops + check_small at RANKS (default 2): fused ops incl. schedule "small" ~2 min
#   floor       scripts/latency_floor.py under three XLA_FLAGS (command buffers default / off / custom calls)  ~3 min
#   attnvariants the forward kernel's variants (PK_JAX_ATTENTION_FWD_VARIANT): first looks, same bits, timing ~5 min
#   latsweep    (2 GPUs+) small-path grid geometry sweep (PK_JAX_SMALL_LINES_PER_CTA / _MAX_CTAS), chains 16/64/256 ~2 min
#   ringreserve (2 GPUs+) ring attention rows at S 12288 with PK_JAX_RING_RESERVE_SMS in RESERVES (default "8 0") ~2 min
#   moesmoke    fused MoE dispatch/combine: 2 ranks sharing GPU 0, waits bounded at 3 s          ~1 min
#   moe2        (2 GPUs+) check_moe at 2 ranks, then dispatch/combine alone (GB/s) vs reference and lax  ~4 min
#   attnr2      wide-key forward variants and backward variants: first looks, f32 reference, timing  ~6 min
#   contexttests (2 GPUs+) ring / Ulysses GPU tests (forward and gradients vs a float32 reference)  ~2 min
#   groupedvariants grouped GEMM schedule variants (PK_JAX_GROUPED_VARIANT): every variant's first test, then timing ~4 min
#   context     (2 GPUs+) python -m pk_jax.bench context                                  ~4 min
#   moe         (2 GPUs+) python -m pk_jax.bench moe                                      ~4 min
#   expertffn   moe_mlp's experts on the rows in use: its GPU tests, the grouped GEMM's (default schedule), moe_mlp's
#               (2 GPUs+), then (2 GPUs+) bench moe --op moe_mlp --variants (ours[compose]: the FFN composed, same turns) ~7 min
#   zerotail    (2 GPUs+) dispatch(zero_tail=False) GPU tests, the expert FFN's and moe_mlp's, then expertffn's bench ~6 min
#   ll128       (2 GPUs+) the LL128 all_reduce: first test alone (3 s waits), its GPU and chain-stress tests, floor slopes
#               beside the other small all_reduces / auto / psum (LL128_BYTES; GPUs PAIR too from 4 GPUs), lines-per-CTA
#               sweep (LL128_LINES), 2 and 4 ranks sharing GPU 0 (LL128_SHARED_STEPS); the two-shot kernel forced
#               (PK_JAX_AR_LL128_SHOTS=2): its tests, floor slopes and shared-GPU chains                       ~10 min
#   ll128lag    (2 GPUs+) the LL128 one-shot's lag of sums behind sends (LL128_LAGS), GPUs PAIR, 256 KiB-8 MiB ~3 min
#   ll128ctas   (2 GPUs+) LL128 CTAs per SM (LL128_CTAS, default "1 2 3"): fresh-process tests, floor slopes pair and all ~5 min
#   ll128env    (2 GPUs+) LL128 floor slopes at 1-8 MiB on GPUs PAIR per setting of LL128_ENVS, defaults first and last ~1 min each
#   ll128odd    (1 GPU+) LL128 chains at 3 and 5 ranks sharing GPU ODD_GPU (default shots, one-shot forced), the lag knob tests ~5 min
#   ll128verify (2 GPUs+) LL128 at auto's thresholds: GPU tests and chains (all GPUs, then GPUs PAIR), chains with
#               LL128_SHARED_RANKS sharing GPU 0 (LL128_SHARED_ENV, e.g. PK_JAX_AR_LL128_SHOTS=2)          ~6 min
#   chunked     (2 GPUs+) the chunk-flag all_reduce: first test alone (waits bounded at 3 s), the small-path GPU
#               tests, then floor slopes of LL one-shot vs chunk flags vs auto vs psum, chunk-size sweep  ~5 min
#   acctests    the attention kernels merging into ring attention's float32 states (forward epilogue, backward dQ add):
#               first look, tests (1 GPU)                                                        ~2 min
#   copyengine  (2 GPUs+) tests of the copy-engine ring shift (PK_JAX_RING_SHIFT_ENGINE=copy: first test alone, 5 s
#               waits, then the shift tests of both engines) and of the kernels merging into the ring's states
#               (PK_JAX_RING_MERGE=kernel: first look at every forward variant, their tests)      ~5 min
#   copybench   (2 GPUs+) after copyengine: ring GPU tests with both on, a timeline, ring rows at S 12288 per
#               transport (pk-copy-acc, pk, pk-copy, pk-acc in the same turns), fwd+bwd with bf16 accumulator hops ~9 min
#   moeskew     (2 GPUs+) dispatch / combine alone at H 4096, uniform and skewed routing (GB/s at the busiest receiver) ~2 min
#   windowtests (2 GPUs+) the windowed all-to-all (copy engines, pk_exchange_start): first test alone, then its tests
#               (tiled all-to-all bits, head runs into `into`, 40 in a row, Ulysses on it vs the reference)     ~4 min
#   dqmerge     (2 GPUs+) ring tests with PK_JAX_RING_MERGE=dq over copy engines, a timeline, ring rows at S 12288 per
#               transport (pk-copy-dq, pk, pk-copy, pk-dq), causal zigzag fwd+bwd at S 24576                 ~8 min
#   ulyssestimeline (2 GPUs+) scripts/ring_timeline.py --op ulysses: device 0's kernels of Ulysses fwd / fwd+bwd at
#               S 2048, H 128 per ULYSSES_CFGS "chunks:exchange[:engine]" (default 1:pk 2:async:sm 2:async:copy 4:async:sm) ~2 min
#   moetimeline (2 GPUs+, G dividing 256) scripts/moe_timeline.py: device 0's kernels of moe_mlp fwd / fwd+bwd and of
#               dispatch + GEMM fused / GEMM alone / unfused at the DeepSeek-V3 shape                  ~3 min
#   ulysseshalf2 (4 GPUs) the 2-GPU Ulysses forward rows on GPUs PAIR, defaults then half ends          ~2 min
#   ulyssescopy (2 GPUs+) Ulysses fwd / fwd+bwd per ULYSSES_CFGS (default "1:pk 2:async:pk 4:async:pk 8:async:pk")
#               with PK_JAX_RING_SHIFT_ENGINE=copy: head chunks exchanged by copy engines under the attention, as
#               windowed all-to-alls since session 15 (no chunk slices, no assembly)                        ~8 min
#   ulyssesreserve (2 GPUs+) windowed Ulysses timelines per SMs our attention leaves free (RESERVES, default
#               "0 8 16 32"), then its bench rows at RESERVE_BENCH (default 16)                              ~4 min
#   moesort     (2 GPUs+) MoE dispatch / combine with the routing's counted positions: E 8 timelines, rows at H 4096 ~2 min
#   ulyssesdefault (2 GPUs+) Ulysses at defaults: its GPU tests (18 took > 100 s), then the bench rows (fwd, fwd_bwd) ~5.5 min
#   ulysseschunks (2 GPUs+) Ulysses forward rows per head-chunk count (ULYSSES_CHUNKS_LIST, default "8 4 16 8") ~4 min
#   ulyssesprefill (2 GPUs+) Ulysses forward rows per own-block prefill count (ULYSSES_PREFILL_LIST, default "4 0 7 4 0") ~1 min each
#   ulyssesenvs (2 GPUs+) Ulysses rows per entry of ULYSSES_ENVS ("VAR=VAL,VAR=VAL" or "-" for the defaults) ~1 min each (fwd)
#   ulyssestests (2 GPUs+) Ulysses' and the windowed exchange's GPU tests on GPUs PAIR                  ~1.5 min
#   ulyssestl   (2 GPUs+) Ulysses forward timelines at defaults, S in ULYSSES_TL_SEQS (default "8192 2048")  ~1 min each
#   ulysseshalf (2 GPUs+) Ulysses bench rows at defaults with PK_JAX_ULYSSES_HALF_ENDS=1 (run after ulyssesdefault)  ~3 min
#   ulyssesown  (2 GPUs+) windowed Ulysses with the own blocks placed by XLA (PK_JAX_WINDOW_OWN=xla: only peer copies on
#               the side stream): timelines per RESERVES (default "0 16"), then bench rows per OWN_CFGS
#               "chunks:reserve:local" (default "4:0:pk 8:0:pk"; local "default" is cuDNN)                                                          ~6 min
#   ringshift   (2 GPUs+) the asynchronous ring shift: its first test alone (waits bounded at 5 s), then its tests and
#               the context GPU tests, then ring rows at S 12288 with both transports (pk side-stream shift, xla ppermute) ~7 min
#   ringprofile (2 GPUs+) scripts/ring_timeline.py: device 0's kernels of one ring call per case, both transports ~2 min
#   moededup    (2 GPUs+) the deduplicated dispatch and the partials combine: first tests alone (waits bounded at 3 s),
#               the MoE GPU tests, then dispatch/combine alone vs the kernels before dedup, the reference and lax ~5 min
#   ringbench   (2 GPUs+) ring rows at S 12288 with both transports (no tests first)              ~1.5 min
#   moeranks2   2 ranks sharing one GPU (MPS): check_moe only (dispatch/combine every routing, moe_mlp and gradients) ~3 min
#   sharedranks ranks sharing one GPU (MPS): check_small (incl. chunk flags), replays, check_moe (dedup/partials
#               and the kernels before), check_ring, at 2 then 4 ranks                              ~8 min
#   ringtimeline (2 GPUs+) scripts/ring_timeline.py, pk transport only: causal zigzag fwd, fwd+bwd both masks ~1.5 min
#   attnncu     Nsight Compute counters of our attention forward/backward kernels beside cuDNN's (B4 S16384 N16
#               D128; NCU_ARGS="--causal"): details page (Firecracker kinds only: nvidia-h100-x1)   ~4 min
#   groupedprobe scripts/grouped_probe.py (grouped forward vs jnp.dot: one group, even, multinomial, 64-row counts),
#               then Nsight Compute on three of them (nvidia-h100-x1 only)                            ~5 min
#   probe       scripts/grouped_probe.py --variants PAIR_VARIANTS $PROBE_ARGS on GPU 0 only                 ~1 min
#   defaulttests the grouped GEMM's GPU tests and the expert FFN's at the default schedule (after a default change) ~2 min
#   ncustalls   Nsight Compute's stall reasons (WarpStateStats) of grouped_probe contenders
#               NCU_CONTENDERS ("|"-separated; default: E 1 static, E 1 dyn, the E 64 weight grad); NCU_SECTIONS ~5 min
#   wgradab     the weight grad's variants (WGRAD_VARIANTS, default "pipe w128"): pairab's stages with the probe's
#               --modes dgrad wgrad (GPU tests under each and the default, probe, bench rows)              ~5 min
#   splitdefault split as the default: grouped GPU tests at default / nosplit / pair, the expert FFN's, then
#               grouped_probe with the backward's GEMMs (--modes dgrad wgrad), default vs nosplit and dyn    ~5 min
#   pairab      grouped forward variants PAIR_VARIANTS (default "pair w128 pair+w128"): GPU tests of each and the
#               default's, grouped_probe and bench moe --op grouped_matmul --variants, default vs each      ~8 min
#   arpipe      (2 GPUs+) the pipelined all_reduce: scripts/stage_ar_pipelined.sh (first test alone, tests, latency
#               slopes vs small_chunked / auto / psum; PIPE_SWEEP="8:1 8:2" adds a rounds:lag sweep)   ~7 min
#   moeoverlap  (2 GPUs+) dispatch + first grouped GEMM in one kernel: scripts/stage_moe_overlap.sh (first test alone,
#               tests, bench moe --op dispatch_gemm; SMS_SWEEP="8 16 24")                              ~7 min
#   overlapall  (2 GPUs+) DispatchMatmul on every GPU of the machine (3 s waits): x4next's first stage alone   ~1 min
#   x4next      (2 GPUs+) session 12's leftover tests: DispatchMatmul on every GPU (3 s waits), small_pipelined's
#               interleave / fresh-process / replay tests, the context temp-memory and bench-shape tests   ~8 min
#   x4rows      (2 GPUs+) a ring timeline (pk transport), then ring rows at S 12288 per RING_CFGS "dtype:ctas"
#               (default "float32:8 float32:4 input:8 input:16": PK_JAX_RING_ACC_DTYPE : PK_JAX_RING_SHIFT_CTAS) ~9 min
#   x4ctxrest   (2 GPUs+) the context rows session 12 did not reach (Ulysses fwd+bwd, causal contiguous fwd+bwd) ~4 min
#   ulyssesab   (2 GPUs+) the distance-shift and head-chunk GPU tests (5 s waits), then Ulysses fwd / fwd+bwd per
#               ULYSSES_CFGS "chunks:exchange[:local]" (default "1:pk 4:async 4:async:pk 8:async:pk 4:lax":
#               PK_JAX_ULYSSES_CHUNKS : _A2A : _LOCAL), one bench run each                                   ~9 min
#   x4moe       (2 GPUs+) dispatch + first grouped GEMM fused vs the GEMM alone, then the whole moe suite (canonical) ~9 min
#   dqconvert   the backward's dQ conversion kernel: bits vs XLA's, gradient tests, ring (2 GPUs+) and attention
#               fwd+bwd rows with PK_JAX_ATTENTION_DQ_CONVERT=xla then kernel                              ~9 min
#   x4ring2     (2 GPUs+) shift tests (every unroll), ring GPU tests (bf16 first accumulator hop), a timeline, the
#               compute floor (issue 26's 5 %), ring rows at S 12288 per SHIFT_CFGS "ctas:unroll" (default
#               "8:4 16:4 8:8 8:16 16:8": PK_JAX_RING_SHIFT_CTAS : PK_JAX_RING_SHIFT_UNROLL)                ~9 min
#   x4copy      (4 GPUs) copy engines at G 4: first test, ring rows per TRANSPORTS, shift and window tests  ~8 min
#   ulyssesbarrier (2 GPUs+) PK_JAX_ULYSSES_BWD_BARRIER=chunks: its GPU tests, then Ulysses fwd+bwd at G 2 with / without ~6 min
#   ringcudnn   the ring's pairs on cuDNN (PK_JAX_RING_LOCAL=cudnn): the one-GPU probe (compiles? right? per-block
#               timing), then (2 GPUs+) its GPU tests and ring rows against the default                      ~1-8 min
#   subaxis     (4 GPUs) ring attention on the size-2 axis of a (2, 2) mesh (two copy-engine rings at once)  ~1 min
#   ring2       (4 GPUs) the ring's 2-GPU rows (S 12288, 24576) on GPUs PAIR (default 0,1) at defaults, or per
#               RING2_TRANSPORTS (bench context --ring-transports names, same turns)                       ~4 min
#   ringnext    (2 GPUs+) deferred merges/sums (PK_JAX_RING_SUMS=deferred), bf16 hops and bottom-right pairs split for
#               cuDNN (PK_JAX_RING_LOCAL=cudnn-split) vs the default: GPU tests,
#               ring rows at S 12288 with the compute floor, 2-GPU causal zigzag fwd+bwd S 24576, a timeline     ~9 min
#   ringnextlong (4 GPUs) the S 49152 fwd+bwd rows, deferred sums vs the default                          ~5 min
#   ringdirect  (2 GPUs+; 4 for the 4-GPU rows) PK_JAX_RING_MERGE=dq-direct (q / dO rows read in place, dQ added into
#               the ring's state by the backward kernel): its first test alone (bounded waits), the in-place tests, the
#               ring tests, then rows against the defaults and cudnn-split (deferred sums: never timed together) in
#               the same turns (G 4 S 12288 fwd+bwd both masks; GPUs PAIR S 24576 causal zigzag fwd+bwd)       ~9 min
#   abpy        a Python-level A/B on one machine: `python -m pk_jax.bench $AB_ARGS` from AB_DIR (the old pk_jax/, made
#               by scripts/ab_prepare.sh <commit>; carry .ab) and from the tree, alternating AB_TURNS (default 2) times;
#               AB_COMMIT names the old commit in its JSON, PK_JAX_COMMIT the tree's (pass it; the device's .git
#               can be stale, so never `git rev-parse` there)                                           ~2 x 2 runs
#   splitrows   (2 GPUs+; 4 for S 49152) causal zigzag fwd+bwd with every bottom-right pair split for cuDNN or none:
#               GPUs PAIR at S 12288 (3072-row pairs; fwd too, 20 reps), all at S 49152 (6144 rows)   ~5 min
#   ringpk      (2 GPUs+; 4 for the G 4 rows) transports default / pk-direct: G 4 S 12288 fwd+bwd both masks, GPUs PAIR
#               S 24576 non-causal fwd+bwd                                                               ~5 min
#   ringmix     (4 GPUs) cudnn-fwd / dq-direct vs the defaults: GPU tests, S 12288 fwd+bwd at G 4 and on GPUs PAIR ~6 min
#   bench       any bench rows: BENCH_ARGS (the bench's arguments), BENCH_TAG (file name), BENCH_LIMIT
#   topo        nvidia-smi and the GPU link topology                                       ~5 s
#   a2a         (2 GPUs+) the all-to-all transfer pattern: its GPU tests, then bench transfer --quick   ~2 min
#   (CONTEXT_LIMIT / CONTEXT_REPS / CONTEXT_ARGS (e.g. "--op ring_attention") / CONTEXT_TAG, MOE_LIMIT, ULYSSES_LIMIT / ULYSSES_REPS, ARPIPE_DEADLINE, MOEOVERLAP_DEADLINE size those stages; PACK=1 returns $OUT as
#   one out.tgz)
#   gputests    every GPU test this machine can run (tests/gpu/run.sh -x)                 2 GPUs+: long
set -o pipefail
: "${PK_JAX_COMMIT:?set PK_JAX_COMMIT to the commit of this tree (the device copy of .git may be stale)}"
export PK_JAX_COMMIT PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pk_jax_out}; mkdir -p "$OUT"
if [ -n "${PACK:-}" ]; then  # one archive back (a device call returns at most 8 files), whatever ends the script
  trap '(cd "$OUT" && tar czf /tmp/pk_jax_out.tgz . && find . -mindepth 1 -delete && mv /tmp/pk_jax_out.tgz "$OUT/out.tgz")' EXIT
fi
DEADLINE=${DEADLINE:-560}  # every stage's limit shrinks to what is left of this (a device call ends at 600 s)
if [ -n "${PREBUILT:-}" ]; then
  cp "$PREBUILT"/_pk_jax_ext*.so pk_jax/ || exit 1
else
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
day=$(date +%F)

source scripts/stage_step.sh
stage() { step "$@" || true; }  # a stage that fails or times out does not stop the call
FLOOR_BYTES="4096 16384 65536 131072 262144 524288 1048576 2097152 4194304 8388608"  # issue 25's sizes (latdefault, latfloor2)

# Grouped forward variants $1 (space-separated PK_JAX_GROUPED_VARIANT values): the GPU tests of each (bounded) and the
# default's, grouped_probe (default vs each, same turns), then bench moe grouped_matmul rows (same turns).
# ($PROBE_ARGS: more grouped_probe arguments, e.g. "--modes dgrad wgrad --reps 20".)
variant_ab() {
  variant_tests "$1"
  stage default-tests 120 env PK_JAX_GROUPED_VARIANT=default timeout 110 python3 -m pytest \
    tests/gpu/test_grouped_matmul_gpu.py -m gpu -x -q -rs
  stage variants-probe 120 python3 scripts/grouped_probe.py --variants $1 ${PROBE_ARGS:-}
  stage variants-bench ${PAIR_BENCH_LIMIT:-200} env PK_JAX_BENCH_GROUPED_VARIANTS="$1" \
    python3 -m pk_jax.bench moe --op grouped_matmul --variants --out "$OUT/$day-moe-grouped-variants.json"
}

# The grouped GEMM's GPU tests under each variant of $1 (bounded waits; logs tests-<variant>).
variant_tests() {
  for v in $1; do
    stage tests-${v//+/_} 120 env PK_JAX_GROUPED_VARIANT=$v PK_JAX_TIMEOUT_MS=5000 timeout 110 python3 -m pytest \
      tests/gpu/test_grouped_matmul_gpu.py -m gpu -x -q -rs
  done
}

# so_ab TAG LIMIT BENCH_ARGS...: the bench once per extension folder in $AB_PREBUILT, in AB_TURNS turns (default 2),
# logs and JSON <TAG>-<folder>-<turn>; the first extension is restored after.
so_ab() {
  local tag=$1 limit=$2; shift 2
  : "${AB_PREBUILT:?set AB_PREBUILT to two or more prebuilt extension folders}"
  for i in $(seq "${AB_TURNS:-2}"); do
    for pre in $AB_PREBUILT; do
      cp "$pre"/_pk_jax_ext*.so pk_jax/ && stage $tag-${pre##*/}-$i $limit python3 -m pk_jax.bench "$@" \
        --out "$OUT/$day-$tag-${pre##*/}-$i.json"
    done
  done
  local first=${AB_PREBUILT%% *}; cp "$first"/_pk_jax_ext*.so pk_jax/
}

# A results-format tag for a comma-separated list of settings: lowercase, hyphens only
# (PK_JAX_SMALL_LL128_LAG=2 -> small-ll128-lag2, PK_JAX_ULYSSES_HALF_ENDS=1,PK_JAX_WINDOW_OWN=copy ->
# ulysses-half-ends1-window-owncopy).
env_tag() { echo "$1" | sed 's/PK_JAX_//g; s/=//g; s/,/-/g; s/_/-/g' | tr 'A-Z' 'a-z'; }

# Ulysses bench rows (ULYSSES_CASES, default fwd) on GPUs PAIR once per entry of $1 (space-separated; each a
# comma-separated VAR=VALUE list, "-" for the defaults), in that order; logs and JSON ulysses-<tag>-<seconds>.
ulysses_env_rows() {
  local entry tag vars
  for entry in $1; do
    tag=$(env_tag "${entry//PK_JAX_ULYSSES_/}"); vars=${entry//,/ }
    [ "$entry" = - ] && tag=defaults && vars=  # ("env -" would empty the environment)
    stage ulysses-$tag-$SECONDS ${ULYSSES_LIMIT:-120} env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} $vars \
      python3 -m pk_jax.bench context --op ulysses_attention --cases ${ULYSSES_CASES:-fwd} --reps ${ULYSSES_REPS:-10} \
      --out "$OUT/$day-context-ulysses-$tag-$SECONDS.json"
  done
}

# The LL128 lag knob's fresh-process tests (lag 0 and 2) on every GPU (log ll128-lag-tests).
ll128_lag_tests() {
  stage ll128-lag-tests 240 python3 -m pytest tests/gpu/test_small_collectives_gpu.py -m gpu -q -rs -k "fresh_process and LAG"
}

# Nsight Compute on one launch of a kernel: the second one matching $3 (the first is the compile run's), alone, with
# sections $4 (few: few replay passes), XLA's command buffers off, of the command after $4. Logs ncu-$1 and its
# details page; with SourceCounters also the SASS with per-instruction samples ($OUT/src-$1.csv), its most sampled
# instructions (scripts/ncu_top_stalls.py) and its hot loop (scripts/ncu_loop_summary.py). The report stays on the
# device (/tmp/$1.ncu-rep: with SourceCounters it is large; the CSV and logs hold what the sessions read).
ncu_one() {
  local tag=$1 limit=$2 kern=$3 sections=$4 ncu
  shift 4
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  stage ncu-$tag $limit "$ncu" --clock-control none -f -o /tmp/$tag --kernel-name-base demangled -k "$kern" \
    --launch-skip 1 -c 1 $sections env XLA_FLAGS=--xla_gpu_enable_command_buffer= "$@"
  stage ncu-$tag-details 60 "$ncu" -i /tmp/$tag.ncu-rep --page details
  if [[ "$sections" == *SourceCounters* ]]; then
    "$ncu" -i /tmp/$tag.ncu-rep --page source --csv --print-source sass > "$OUT/src-$tag.csv" 2>&1
    stage ncu-$tag-stalls 30 python3 scripts/ncu_top_stalls.py "$OUT/src-$tag.csv" 30
    stage ncu-$tag-loop 30 python3 scripts/ncu_loop_summary.py "$OUT/src-$tag.csv"
  fi
}

# Nsight Compute (ncu_one) on grouped_probe contenders $1 ("|"-separated): the second launch of each alone (--once),
# sections $2, probe arguments $3.
ncu_contenders() {
  local c cs
  IFS='|' read -ra cs <<< "$1"
  for c in "${cs[@]}"; do
    ncu_one grouped-$(echo "$c" | tr ' .[]' '____') 150 'regex:grouped' "$2" python3 scripts/grouped_probe.py --once "$c" $3
  done
}

# The kernels merging into ring attention's states (1 GPU): first look at every forward variant, then the tests.
accumulate_tests() {
  local t=tests/gpu/test_attention_accumulate_gpu.py
  stage acc-first 80 timeout 70 python3 -m pytest "$t" -m gpu -q -x -rs -k first_look
  if grep -q " passed" "$OUT/acc-first.log" && ! grep -qE "failed|rror" "$OUT/acc-first.log"; then
    stage acc-tests 120 python3 -m pytest "$t" -m gpu -q -rs
  fi
}

# A new path's first test alone ($2, waits bounded at 5 s, 110 s at most: a hang costs only that), then, if it
# passed, the tests in $3. Logs $1-first, $1-tests.
first_then_rest() {
  stage $1-first 120 env PK_JAX_TIMEOUT_MS=5000 timeout 110 python3 -m pytest -x -q -rs "$2"
  if grep -q " passed" "$OUT/$1-first.log" && ! grep -qE "failed|rror" "$OUT/$1-first.log"; then
    stage $1-tests 200 env PK_JAX_TIMEOUT_MS=5000 python3 -m pytest -q -rs $3
  fi
}

# (2 GPUs+) ring A/B: the ring's reference tests and a timeline over copy engines with the settings $2 (VAR=value
# ...), then ring rows at S 12288 per transport (${@:5}, the same turns). Logs $1-ring-tests, $1-timeline,
# $1-ring-bench; results ...-context-ring-$4.json.
ring_ab() {
  local tag=$1 settings=$2 cases=$3 out=$4
  shift 4
  stage $tag-ring-tests 150 env $settings PK_JAX_RING_SHIFT_ENGINE=copy python3 -m pytest tests/gpu/test_context_gpu.py \
    -m gpu -q -x -rs -k "ring_attention_matches_reference"
  stage $tag-timeline 60 env $settings PK_JAX_RING_TRANSPORT=pk PK_JAX_RING_SHIFT_ENGINE=copy python3 scripts/ring_timeline.py \
    --cases $cases
  stage $tag-ring-bench 200 python3 -m pk_jax.bench context --op ring_attention --seqs 12288 --cases fwd_contiguous \
    fwd_causal_zigzag fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports "$@" --reps 10 \
    --out "$OUT/$day-context-ring-$out.json"
}

for s in ${STAGES:-matmul ranks2 multirank2 layouts}; do
  case $s in
    matmul) stage matmul 240 python3 -m pytest tests/gpu/test_matmul_gpu.py -m gpu -q -x -rs ;;
    ranks2) stage ranks2 180 python3 -m pk_jax.launch --share-gpu -n 2 --timeout 170 tests/launch_scripts/gpu_ranks.py ;;
    multirank2) stage multirank2 420 python3 -m pk_jax.bench multirank --ranks 2 --out "$OUT/$day-multirank-2.json" ;;
    small2) stage small2 300 env PK_JAX_SMALL_PATH=1 python3 -m pk_jax.bench multirank --ranks 2 --calls 100 \
              --out "$OUT/$day-multirank-2-small.json" ;;
    multirank4) stage multirank4 560 python3 -m pk_jax.bench multirank --ranks 4 --out "$OUT/$day-multirank-4.json" ;;
    layouts) stage layouts 240 python3 -m pk_jax.bench gemm --layouts --out "$OUT/$day-gemm-layouts.json" ;;
    model) stage model 400 python3 -m pk_jax.bench model --group 1 --out "$OUT/$day-model.json" ;;
    attention) stage attention-tests 300 python3 -m pytest tests/gpu/test_attention_gpu.py -m gpu -q -x -rs
               stage attention 280 python3 -m pk_jax.bench attention --out "$OUT/$day-attention.json" ;;
    demo) stage demo 180 python3 -m pk_jax.bench demo --out "$OUT/$day-demo.json" ;;
    democlone) rm -rf /tmp/pk_jax_fresh && mkdir -p /tmp/pk_jax_fresh  # the device's .git may be stale: copy the tree
               tar --exclude=./.git --exclude=./build --exclude=./.venv --exclude=./.prebuilt --exclude='*.so' -cf - . \
                 | tar -xf - -C /tmp/pk_jax_fresh
               stage democlone 300 bash -c "cd /tmp/pk_jax_fresh && time bash scripts/demo.sh --out $OUT/$day-demo-clone.json" ;;
    grouped) stage grouped-tests 150 python3 -m pytest tests/gpu/test_grouped_matmul_gpu.py -m gpu -q -x -rs
             stage grouped 240 python3 -m pk_jax.bench moe --op grouped_matmul --reps 10 --out "$OUT/$day-moe-grouped.json" ;;
    sdpa) # the library attention defaults to cuDNN (pk_jax.sdpa): its tests on one GPU, then Ulysses vs the float32
          # reference (2 GPUs+), then a Ulysses forward timeline at S 8192 on GPUs PAIR with the default implementation
          stage sdpa-tests 120 python3 -m pytest tests/gpu/test_sdpa_gpu.py -m gpu -q -rs
          stage ulysses-tests 150 python3 -m pytest tests/gpu/test_context_gpu.py -m gpu -q -rs \
            -k "ulysses_attention_matches_reference"
          stage ulysses-default-timeline 90 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 scripts/ring_timeline.py \
            --op ulysses --seq 8192 --heads 128 --cases fwd ;;
    groupedab) # the grouped_matmul rows once per extension in AB_PREBUILT (e.g. ".prebuilt/x .prebuilt/h"), each
               # with its own jnp.dot / ragged_dot baselines in the same run
               AB_TURNS=1 so_ab grouped ${GROUPED_LIMIT:-200} moe --op grouped_matmul --reps 10 ;;
    soab) # any bench rows ($AB_ARGS) once per extension in AB_PREBUILT per turn (AB_TURNS, default 2): an A/B of builds
          # with the same Python tree, the baselines in every run
          so_ab "${AB_TAG:-soab}" ${AB_LIMIT:-200} ${AB_ARGS:?soab: set AB_ARGS to the bench arguments} ;;
    fwdvariant) : "${FWD_NAME:?set FWD_NAME to a forward variant (pk_jax.attention.FWD_VARIANTS)}"
           stage "$FWD_NAME-first" 90 env PK_JAX_ATTENTION_FWD_DEBUG=1 timeout 80 python3 -m pytest tests/gpu/test_attention_gpu.py \
             -m gpu -q -x -rs -k "first_look and $FWD_NAME"
           if grep -q " passed" "$OUT/$FWD_NAME-first.log" && ! grep -qE "failed|rror" "$OUT/$FWD_NAME-first.log"; then
             stage "$FWD_NAME-tests" 200 python3 -m pytest tests/gpu/test_attention_gpu.py -m gpu -q -x -rs -k "$FWD_NAME"
             stage "$FWD_NAME-bench" ${FWD_LIMIT:-240} python3 -m pk_jax.bench attention --fwd-variants "$FWD_NAME" ${FWD_OTHERS:-} \
               --cases ${FWD_CASES:-fwd fwd_causal fwd_gqa fwd_causal_gqa} --seqs ${FWD_SEQS:-1024 2048 4096} \
               --head-dims ${FWD_DIMS:-64} --reps 10 --out "$OUT/$day-attention-$FWD_NAME.json"
           fi ;;
    bwdvariant) : "${BWD_NAME:?set BWD_NAME to a backward variant (pk_jax.attention.BWD_VARIANTS)}"
           stage "$BWD_NAME-first" 90 timeout 80 python3 -m pytest tests/gpu/test_attention_bwd_gpu.py -m gpu -q -x -rs \
             -k "bwd_first_look and $BWD_NAME"
           if grep -q " passed" "$OUT/$BWD_NAME-first.log" && ! grep -qE "failed|rror" "$OUT/$BWD_NAME-first.log"; then
             stage "$BWD_NAME-tests" 150 python3 -m pytest tests/gpu/test_attention_bwd_gpu.py -m gpu -q -x -rs -k "$BWD_NAME"
             stage "$BWD_NAME-acc" 150 env PK_JAX_ATTENTION_BWD_VARIANT="$BWD_NAME" python3 -m pytest \
               tests/gpu/test_attention_accumulate_gpu.py -m gpu -q -rs
             stage "$BWD_NAME-bench" ${BWD_LIMIT:-240} python3 -m pk_jax.bench attention --bwd-variants "$BWD_NAME" \
               --cases ${BWD_CASES:-fwd_bwd fwd_bwd_causal fwd_bwd_gqa fwd_bwd_causal_gqa} --seqs ${BWD_SEQS:-4096 16384} \
               --head-dims ${BWD_DIMS:-128} --reps 10 --out "$OUT/$day-attention-$BWD_NAME.json"
           fi ;;
    attnbwd) export PK_JAX_ATTENTION_BWD=kernel
             stage attnbwd-first 90 env PK_JAX_ATTENTION_BWD_DEBUG=1 stdbuf -oL -eL python3 -m pytest -s -x -v -m gpu \
               tests/gpu/test_attention_bwd_gpu.py -k "B2-Tq256-N4-Tk256-K4-D64-full-off0_0-bf16"  # debug: waits time out and name the barrier
             if grep -q " passed" "$OUT/attnbwd-first.log"; then
               stage attnbwd-tests 180 python3 -m pytest tests/gpu/test_attention_bwd_gpu.py -m gpu -q -x -rs
               stage attnbwd 200 python3 -m pk_jax.bench attention --cases fwd_bwd fwd_bwd_causal fwd_bwd_gqa \
                 fwd_bwd_causal_gqa --seqs 1024 4096 16384 --head-dims 128 --reps 5 --out "$OUT/$day-attention-fwd-bwd.json"
             fi
             unset PK_JAX_ATTENTION_BWD ;;
    fdshare) stage fdshare 150 bash -c "PK_JAX_EXPECT_SHARING=posix_fd python3 -m pk_jax.launch --share-gpu -n 2 --timeout 60 \
               tests/launch_scripts/gpu_ranks.py && PK_JAX_EXPECT_SHARING=posix_fd python3 -m pk_jax.launch --share-gpu -n 4 \
               --timeout 70 tests/launch_scripts/gpu_ranks.py" ;;
    latency) stage latency 200 env PK_JAX_SMALL_PATH=1 python3 -m pk_jax.bench collectives --latency --variants \
               --out "$OUT/$day-collectives-latency.json" ;;
    latdefault) stage latency-default 120 python3 -m pk_jax.bench collectives --latency --out "$OUT/$day-collectives-latency.json"
                stage floor-default 120 python3 scripts/latency_floor.py --tag default --ops pk_auto psum \
                  --bytes $FLOOR_BYTES --out "$OUT/$day-floor-default.json" ;;
    collectives) stage collectives 150 python3 -m pk_jax.bench collectives --out "$OUT/$day-collectives.json" ;;
    smallfused) stage smallfused 200 python3 -m pk_jax.bench multirank --ranks ${RANKS:-2} --steps check_ops check_small \
                  --out "$OUT/$day-multirank-small-fused.json" ;;
    floor) mkdir -p "$OUT/hlo"  # where the small all_reduce's per-op time goes: chains 16/64/256, command buffers on/off
           stage floor-default 90 python3 scripts/latency_floor.py --tag default --hlo-dir "$OUT/hlo" --out "$OUT/$day-floor-default.json"
           stage floor-nocmd 90 env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/latency_floor.py --tag no_cmdbuf \
             --out "$OUT/$day-floor-nocmd.json"
           stage floor-cmd 90 env XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,COLLECTIVES --xla_gpu_graph_min_graph_size=1" \
             python3 scripts/latency_floor.py --tag cmd_custom --hlo-dir "$OUT/hlo" --out "$OUT/$day-floor-cmd.json" ;;
    profile) stage floor-profile 120 python3 scripts/latency_floor.py --tag profile --bytes 4096 1048576 --profile \
               --out "$OUT/$day-floor-profile.json" ;;
    attnvariants) for v in l2order pingpong fa3; do  # forward variants: each alone first (bounded waits), then bits, then timing
                    stage attnvar-first-$v 60 env PK_JAX_ATTENTION_FWD_DEBUG=1 python3 -m pytest tests/gpu/test_attention_gpu.py \
                      -m gpu -q -x -rs -k "first_look and $v"
                  done
                  stage attnvar-bits 200 python3 -m pytest tests/gpu/test_attention_gpu.py -m gpu -q -x -rs -k "same_bits or default_bits"
                  stage attnvar 200 python3 -m pk_jax.bench attention --fwd-variants --cases fwd fwd_causal fwd_gqa \
                    --seqs 4096 16384 --head-dims 128 --out "$OUT/$day-attention-fwd-variants.json" ;;
    latsweep) for geo in ${GEOS:-2048:128 1024:132 512:132 256:132 128:132}; do  # small path grid geometry: lines per CTA : CTA cap
                stage latsweep-${geo/:/-} 60 env PK_JAX_SMALL_LINES_PER_CTA=${geo%:*} PK_JAX_SMALL_MAX_CTAS=${geo#*:} \
                  python3 scripts/latency_floor.py --tag "lpc${geo%:*}-cap${geo#*:}" --ops pk_small_one_shot \
                  --bytes 4096 16384 65536 262144 524288 1048576 --out "$OUT/$day-latency-sweep-${geo/:/-}.json"
              done ;;
    ringreserve) for r in ${RESERVES:-8 0}; do  # ring attention with r SMs left to the K/V transfer
                   stage ring-reserve$r 150 env PK_JAX_RING_RESERVE_SMS=$r python3 -m pk_jax.bench context --op ring_attention \
                     --cases fwd_contiguous fwd_causal_zigzag fwd_bwd_contiguous fwd_bwd_causal_zigzag --seqs 12288 --reps 10 \
                     --out "$OUT/$day-context-ring-reserve$r.json"
                 done ;;
    moesmoke) stage moe-smoke 90 env PK_JAX_TIMEOUT_MS=3000 python3 -m pk_jax.launch -n 2 --ranks-per-gpu 2 --timeout 80 \
                tests/multirank/check_moe.py --smoke --out "$OUT/$day-moe-smoke.json" ;;
    moe2) stage moe-check 150 python3 -m pk_jax.bench multirank --ranks 2 --steps check_moe --out "$OUT/$day-multirank-moe.json"
          stage moe-exchange 150 python3 -m pk_jax.bench moe --op dispatch,combine --sizes 7168 --cases uniform_fwd \
            uniform_fwd_bwd skewed_fwd --out "$OUT/$day-moe-exchange.json" ;;
    attnr2) for v in fa3n176 fa3n160; do
              stage attnr2-first-$v 60 env PK_JAX_ATTENTION_FWD_DEBUG=1 python3 -m pytest tests/gpu/test_attention_gpu.py -m gpu \
                -q -x -rs -k "first_look and $v"
            done
            stage attnr2-bwd-first 60 env PK_JAX_ATTENTION_BWD_DEBUG=1 python3 -m pytest tests/gpu/test_attention_bwd_gpu.py -m gpu \
              -q -x -rs -k "bwd_first_look"
            stage attnr2-ref 100 python3 -m pytest tests/gpu/test_attention_gpu.py -m gpu -q -x -rs \
              -k "f32_reference and bf16 and (fa3n160 or fa3n176)"
            stage attnr2-fwd 90 python3 -m pk_jax.bench attention --fwd-variants fa3n160 fa3n176 --cases fwd fwd_causal fwd_gqa \
              --seqs 4096 16384 --head-dims 128 --out "$OUT/$day-attention-fwd-wide.json"
            stage attnr2-bwd 120 python3 -m pk_jax.bench attention --bwd-variants --cases fwd_bwd fwd_bwd_causal fwd_bwd_gqa \
              --seqs 4096 16384 --head-dims 128 --reps 5 --out "$OUT/$day-attention-fwd-bwd-variants.json" ;;
    contexttests) stage context-tests 180 python3 -m pytest tests/gpu/test_context_gpu.py -m gpu -q -x -rs ;;
    groupedvariants) stage grouped-first 120 python3 -m pytest -x -v -o faulthandler_timeout=50 tests/gpu/test_grouped_matmul_gpu.py \
                       -k "test_bf16 and 4096x512x1408-E64-uniform"
                     if grep -q " passed" "$OUT/grouped-first.log" && ! grep -q "failed" "$OUT/grouped-first.log"; then
                       stage grouped-var 220 env PK_JAX_BENCH_GROUPED_VARIANTS="dyn dyn+narrow dyn+narrow+pipe" \
                         python3 -m pk_jax.bench moe --op grouped_matmul --reps 10 --variants --out "$OUT/$day-moe-grouped-variants.json"
                     fi ;;
    context) stage context${CONTEXT_TAG:+-$CONTEXT_TAG} ${CONTEXT_LIMIT:-240} python3 -m pk_jax.bench context \
               --reps ${CONTEXT_REPS:-20} ${CONTEXT_ARGS:-} --out "$OUT/$day-context${CONTEXT_TAG:+-$CONTEXT_TAG}.json" ;;
    moe) stage moe ${MOE_LIMIT:-240} python3 -m pk_jax.bench moe --out "$OUT/$day-moe.json" ;;
    expertffn) stage ffn-tests 150 python3 -m pytest tests/gpu/test_expert_ffn_gpu.py -m gpu -x -q -rs
               stage grouped-tests 150 env PK_JAX_GROUPED_VARIANT=default python3 -m pytest \
                 tests/gpu/test_grouped_matmul_gpu.py -m gpu -x -q -rs
               stage moe-mlp-tests 120 python3 -m pytest tests/gpu/test_moe_gpu.py -m gpu -x -q -rs -k moe_mlp
               stage moe-mlp-ab ${MOE_LIMIT:-300} python3 -m pk_jax.bench moe --op moe_mlp --variants \
                 --out "$OUT/$day-moe-mlp-ab.json" ;;
    zerotail) stage zero-tail-tests 120 env PK_JAX_TIMEOUT_MS=5000 python3 -m pytest tests/gpu/test_moe_fused_gpu.py \
                -m gpu -x -q -rs -k "zero_tail or fused_equals_reference"
              stage ffn-tests 120 python3 -m pytest tests/gpu/test_expert_ffn_gpu.py tests/gpu/test_moe_gpu.py -m gpu -x \
                -q -rs -k "expert or sum or swiglu or moe_mlp"
              stage moe-mlp-ab ${MOE_LIMIT:-300} python3 -m pk_jax.bench moe --op moe_mlp --variants \
                --out "$OUT/$day-moe-mlp-ab.json" ;;
    chunked) stage chunked-first 60 env PK_JAX_TIMEOUT_MS=3000 python3 -m pytest tests/gpu/test_small_collectives_gpu.py \
               -m gpu -x -q -rs -k "test_all_reduce_sizes and small_chunked and 4096-"
             if grep -q " passed" "$OUT/chunked-first.log" && ! grep -q "failed" "$OUT/chunked-first.log"; then
               stage chunked-tests 200 python3 -m pytest tests/gpu/test_small_collectives_gpu.py -m gpu -x -q -rs
               stage chunked-floor 150 python3 scripts/latency_floor.py --tag chunked --ops pk_small_one_shot pk_small_chunked \
                 pk_auto psum --bytes 4096 16384 65536 262144 1048576 2097152 8388608 --out "$OUT/$day-floor-chunked.json"
               for cb in ${CHUNKS:-2048 8192 16384}; do
                 stage chunked-cb$cb 45 env PK_JAX_SMALL_CHUNK_BYTES=$cb python3 scripts/latency_floor.py --tag "cb$cb" \
                   --ops pk_small_chunked --bytes 65536 262144 1048576 8388608 --out "$OUT/$day-floor-chunked-cb$cb.json"
               done
             fi ;;
    ll128) # (2 GPUs+) the LL128 all_reduce: first test alone (waits bounded at 3 s), its GPU tests and the chain stress
           # tests, floor slopes beside the other small all_reduces / auto / psum (on GPUs PAIR too from 4 GPUs), the
           # lines-per-CTA sweep (LL128_LINES), then 2 and 4 ranks sharing GPU 0 (LL128_SHARED_STEPS)
           stage ll128-first 60 env PK_JAX_TIMEOUT_MS=3000 python3 -m pytest tests/gpu/test_small_collectives_gpu.py \
             -m gpu -x -q -rs -k "test_all_reduce_sizes and small_ll128 and 4096-"
           if grep -q " passed" "$OUT/ll128-first.log" && ! grep -q "failed" "$OUT/ll128-first.log"; then
             stage ll128-tests 300 python3 -m pytest tests/gpu/test_small_collectives_gpu.py -m gpu -q -rs -k "ll128 or dims or chain"
             ll128_bytes=${LL128_BYTES:-4096 16384 65536 131072 262144 524288 1048576 2097152 8388608}
             ll128_ops="pk_small_one_shot pk_small_two_shot pk_small_ll128 pk_small_chunked pk_small_pipelined pk_auto psum"
             stage ll128-floor 200 python3 scripts/latency_floor.py --tag ll128 --ops $ll128_ops --bytes $ll128_bytes \
               --out "$OUT/$day-floor-ll128.json"
             if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
               stage ll128-floor-2gpu 120 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 scripts/latency_floor.py --tag ll128-2gpu \
                 --ops pk_small_ll128 pk_small_chunked pk_auto psum --bytes $ll128_bytes --out "$OUT/$day-floor-ll128-2gpu.json"
             fi
             for lines in ${LL128_LINES:-}; do
               stage ll128-lines$lines 60 env PK_JAX_SMALL_LL128_LINES_PER_CTA=$lines python3 scripts/latency_floor.py \
                 --tag "lines$lines" --ops pk_small_ll128 --bytes 65536 262144 1048576 8388608 --out "$OUT/$day-floor-ll128-lines$lines.json"
             done
             # the two-shot kernel forced at every size and G (fresh processes: the knob is read once)
             stage ll128-2shot-tests 150 env PK_JAX_AR_LL128_SHOTS=2 python3 -m pytest tests/gpu/test_small_collectives_gpu.py \
               -m gpu -q -rs -k "small_ll128 and (sizes or chain)"
             stage ll128-2shot-floor 100 env PK_JAX_AR_LL128_SHOTS=2 python3 scripts/latency_floor.py --tag ll128-2shot \
               --ops pk_small_ll128 --bytes $ll128_bytes --out "$OUT/$day-floor-ll128-2shot.json"
             stage ll128-shared ${LL128_SHARED_LIMIT:-240} env CUDA_VISIBLE_DEVICES=0 python3 -m pk_jax.bench multirank --ranks 2 4 \
               --steps ${LL128_SHARED_STEPS:-check_small_chain check_small_replay} --out "$OUT/$day-multirank-shared-ll128.json"
             stage ll128-shared-2shot 120 env CUDA_VISIBLE_DEVICES=0 PK_JAX_AR_LL128_SHOTS=2 python3 -m pk_jax.bench multirank \
               --ranks 2 4 --steps check_small_chain --out "$OUT/$day-multirank-shared-ll128-2shot.json"
           fi ;;
    ll128lag) # (2 GPUs+) the LL128 one-shot's lag of sums behind sends (LL128_LAGS; 100000: every send first, session 31's
              # kernel) on GPUs PAIR, beside the chunk flags and psum, 256 KiB-8 MiB
              stage ll128lag-base 60 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 scripts/latency_floor.py --tag lag-base \
                --ops pk_small_chunked psum --bytes 262144 1048576 2097152 4194304 8388608 --out "$OUT/$day-floor-ll128lag-base.json"
              for lag in ${LL128_LAGS:-4 100000 2 8}; do
                stage ll128lag$lag 45 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} PK_JAX_SMALL_LL128_LAG=$lag python3 scripts/latency_floor.py \
                  --tag "lag$lag" --ops pk_small_ll128 --bytes 262144 1048576 2097152 4194304 8388608 --out "$OUT/$day-floor-ll128lag$lag.json"
              done ;;
    ll128ctas) # (2 GPUs+) LL128 with LL128_CTAS (default "1 2 3") CTAs per SM: the knobs' fresh-process tests, then floor
               # slopes per value on GPUs PAIR and, with more than 2 GPUs, on all of them (the two-shot serves 1 MiB and up there)
               stage ll128ctas-tests 240 python3 -m pytest tests/gpu/test_small_collectives_gpu.py -m gpu -q -rs -k "fresh_process and CTAS"
               for v in ${LL128_CTAS:-1 2 3}; do
                 stage ll128ctas-$v-pair 45 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} PK_JAX_SMALL_LL128_CTAS_PER_SM=$v python3 \
                   scripts/latency_floor.py --tag "ctas$v-pair" --ops pk_small_ll128 \
                   --bytes 4096 262144 1048576 2097152 4194304 8388608 --out "$OUT/$day-floor-ll128-ctas$v-pair.json"
                 [ "$(nvidia-smi -L | wc -l)" -le 2 ] || stage ll128ctas-$v-all 45 env PK_JAX_SMALL_LL128_CTAS_PER_SM=$v \
                   python3 scripts/latency_floor.py --tag "ctas$v" --ops pk_small_ll128 \
                   --bytes 4096 131072 1048576 2097152 4194304 8388608 --out "$OUT/$day-floor-ll128-ctas$v.json"
               done ;;
    ll128env) # (2 GPUs+) LL128 floor slopes on GPUs PAIR per setting in LL128_ENVS (space-separated; each a comma-separated
              # VAR=value list, "-" for the defaults), 1-8 MiB, one fresh process each; the defaults first and last
              for cfg in - ${LL128_ENVS:?set LL128_ENVS} -; do
                tag=$(env_tag "$cfg"); vars=${cfg//,/ }
                [ "$cfg" = - ] && tag=default-$SECONDS && vars=PK_JAX_LL128ENV_DEFAULTS=1  # ("env -" would empty the environment)
                stage ll128env-$tag 45 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} $vars python3 scripts/latency_floor.py \
                  --tag "$tag" --ops pk_small_ll128 --bytes 1048576 2097152 4194304 8388608 \
                  --out "$OUT/$day-floor-ll128env-$tag.json"
              done ;;
    ll128odd) # (1 GPU+) LL128 at odd group sizes (LL128_ODD_RANKS, default "3 5") with ranks sharing GPU ODD_GPU (default
              # 0): the chain stress at the default shots (two-shot from 256 KiB there) and with the one-shot forced; then
              # the lag knob's fresh-process tests (lag 0 and 2) on every GPU
              stage ll128odd-chain 200 env CUDA_VISIBLE_DEVICES=${ODD_GPU:-0} python3 -m pk_jax.bench multirank --ranks ${LL128_ODD_RANKS:-3 5} \
                --steps check_small_chain --out "$OUT/$day-multirank-shared-ll128-odd.json"
              stage ll128odd-chain-1shot 200 env CUDA_VISIBLE_DEVICES=${ODD_GPU:-0} PK_JAX_AR_LL128_SHOTS=1 python3 -m pk_jax.bench multirank \
                --ranks ${LL128_ODD_RANKS:-3 5} --steps check_small_chain --out "$OUT/$day-multirank-shared-ll128-odd-1shot.json"
              ll128_lag_tests ;;
    ll128lagtests) ll128_lag_tests ;;  # (2 GPUs+) the LL128 lag knob's fresh-process tests (lag 0 and 2) on every GPU
    ll128verify) # (2 GPUs+) LL128 at auto's thresholds: its GPU tests and chains on every GPU, the chains on GPUs PAIR,
                 # then chains with ranks sharing GPU 0
                 stage ll128-tests 300 python3 -m pytest tests/gpu/test_small_collectives_gpu.py -m gpu -q -rs -k "ll128 or dims or chain"
                 stage ll128-chain-pair 90 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 -m pytest tests/gpu/test_small_collectives_gpu.py \
                   -m gpu -q -rs -k "chain"
                 stage ll128-shared-chain 150 env CUDA_VISIBLE_DEVICES=0 ${LL128_SHARED_ENV:-} python3 -m pk_jax.bench multirank \
                   --ranks ${LL128_SHARED_RANKS:-2 4} --steps check_small_chain --out "$OUT/$day-multirank-shared-ll128-chain.json" ;;
    ringshift) stage ringshift-first 120 env PK_JAX_TIMEOUT_MS=5000 python3 -m pytest -x -q -rs \
                 "tests/gpu/test_ring_shift_gpu.py::test_shift_alone_small[sm-2]"
               if grep -q " passed" "$OUT/ringshift-first.log" && ! grep -q "failed" "$OUT/ringshift-first.log"; then
                 stage ringshift-tests 240 python3 -m pytest -x -q -rs tests/gpu/test_ring_shift_gpu.py tests/gpu/test_context_gpu.py
                 stage ringshift-bench 200 python3 -m pk_jax.bench context --op ring_attention --seqs 12288 --cases \
                   fwd_contiguous fwd_causal_zigzag fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports pk xla --reps 10 \
                   --out "$OUT/$day-context-ring-transports.json"
               fi ;;
    ringprofile) for t in pk xla; do
                   stage ringprofile-$t 100 env PK_JAX_RING_TRANSPORT=$t python3 scripts/ring_timeline.py \
                     --cases fwd_contiguous fwd_causal_zigzag fwd_bwd_causal_zigzag
                 done ;;
    ringtimeline) stage ringtimeline 150 env PK_JAX_RING_TRANSPORT=pk python3 scripts/ring_timeline.py \
                    --cases fwd_causal_zigzag fwd_contiguous fwd_bwd_causal_zigzag fwd_bwd_contiguous ;;
    attnpower) # SM clock / power / throttle reasons while ours and cuDNN's attention run back to back, per
               # ATTN_POWER_CFGS "B:S:N:D[:flag...]" (flags: causal, grads; scripts/attention_power.py)
               for cfg in ${ATTN_POWER_CFGS:-4:16384:16:128:causal:grads}; do
                 IFS=: read -r b sq n d flags <<< "$cfg"
                 stage attnpower-${cfg//:/-} 120 python3 scripts/attention_power.py --batch $b --seq $sq --heads $n \
                   --head-dim $d ${ATTN_POWER_ARGS:-} $(for f in ${flags//:/ }; do echo --$f; done)
               done ;;
    attntimeline) # device 0's kernels of one attention call, ours and cuDNN's, per ATTN_TL_CFGS "B:S:N:D[:causal]"
               # (fwd+bwd: scripts/attention_timeline.py --grads), summed per kernel name
               for cfg in ${ATTN_TL_CFGS:-4:16384:16:128:causal}; do
                 IFS=: read -r b sq n d flag <<< "$cfg"
                 stage attntimeline-$b-$sq-$n-$d${flag:+-$flag} 90 python3 scripts/attention_timeline.py --grads \
                   --batch $b --seq $sq --heads $n --head-dim $d ${flag:+--$flag}
               done ;;
    bwdstalls) # where the attention backward's warps wait, ours and cuDNN's (ncu_one): B4 S8192 N16 D128 and
               # BWD_NCU_ARGS, or per BWD_NCU_CFGS "B:S:N:D:K[:causal]" (K: kv heads), then with two of ours
               # scripts/ncu_per_task.py on them (shorter first, as many tasks)
               bwd_csvs=()
               for cfg in ${BWD_NCU_CFGS:-default}; do
                 if [ "$cfg" = default ]; then tag=; shape="--batch 4 --seq 8192 ${BWD_NCU_ARGS:-${NCU_ARGS:-}}"
                 else IFS=: read -r b sq n d kh flag <<< "$cfg"; tag=-${cfg//:/-}
                      shape="--batch $b --seq $sq --heads $n --head-dim $d --kv-heads $kh ${flag:+--$flag}"; fi
                 for who in ${BWD_NCU_WHO:-ours cudnn}; do
                   if [ $who = ours ]; then kern='regex:attention_bwd::Kernel'; else kern='regex:bprop'; fi
                   ncu_one bwd-$who$tag 240 "$kern" "--section SpeedOfLight --section WarpStateStats --section SourceCounters \
                     --section MemoryWorkloadAnalysis" python3 scripts/attention_ncu.py --only ${who}_bwd $shape
                 done
                 bwd_csvs+=("$OUT/src-bwd-ours$tag.csv")
               done
               [ ${#bwd_csvs[@]} -eq 2 ] && [[ " ${BWD_NCU_WHO:-ours cudnn} " == *" ours "* ]] && \
                 stage bwd-per-task 30 python3 scripts/ncu_per_task.py "${bwd_csvs[@]}" ;;
    bench) stage bench-${BENCH_TAG:-rows} ${BENCH_LIMIT:-200} python3 -m pk_jax.bench ${BENCH_ARGS:?bench: set BENCH_ARGS} \
             --out "$OUT/$day-${BENCH_TAG:-rows}.json" ;;  # any bench rows, e.g. BENCH_ARGS="attention --seqs 16384"
    pytests) : "${PYTESTS:?set PYTESTS to pytest arguments (files, -k ...)}"  # $PYTESTS unquoted: pytest's own arguments
             # PYTESTS_K: a -k expression with spaces (e.g. "fa3 or bwd"), which $PYTESTS cannot carry
             stage pytests ${PYTESTS_LIMIT:-200} env PK_JAX_TIMEOUT_MS=5000 python3 -m pytest $PYTESTS \
               ${PYTESTS_K:+-k "$PYTESTS_K"} -m gpu -q -rs ;;
    fwdstalls) # where the attention forward's warps wait, ours and cuDNN's, per FWD_NCU_CFGS "D:B:S:N" (ncu_one):
               # speed of light, pipes, warp states, smem conflicts, the SASS with its samples
               ours_csvs=()
               for cfg in ${FWD_NCU_CFGS:-128:4:8192:16 64:64:1024:32}; do
                 IFS=: read -r d b sq n <<< "$cfg"
                 ours_csvs+=("$OUT/src-fwd-ours-d$d-s$sq.csv")
                 for who in ${FWD_NCU_WHO:-ours cudnn}; do
                   if [ $who = ours ]; then kern='regex:attention::Kernel'; else kern='regex:fprop|sdpa|fmha'; fi
                   ncu_one fwd-$who-d$d-s$sq 150 "$kern" "--section SpeedOfLight --section ComputeWorkloadAnalysis \
                     --section WarpStateStats --section SchedulerStats --section InstructionStats \
                     --section MemoryWorkloadAnalysis --section SourceCounters --section LaunchStats" \
                     python3 scripts/attention_ncu.py --only ${who}_fwd --batch $b --seq $sq --heads $n --head-dim $d ${NCU_ARGS:-}
                 done
               done
               # two configurations of ours, shorter first and with as many tasks: where the per-task cost goes
               [ ${#ours_csvs[@]} -eq 2 ] && [[ " ${FWD_NCU_WHO:-ours cudnn} " == *" ours "* ]] && \
                 stage fwd-per-task 30 python3 scripts/ncu_per_task.py "${ours_csvs[@]}" ;;
    attnncu) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
             # Our kernels' base names are lcsc's `kernel`: match the demangled names (template arguments name the role).
             # Session 23 caught no cuDNN kernel with 'flash_bprop' and -c 2 (both launches were ours): match more names,
             # take more launches, and keep XLA's command buffers off so cuDNN's kernels launch on their own.
             stage attnncu 300 "$NCU" --clock-control none -f -o "$OUT/attn" --kernel-name-base demangled \
               -k 'regex:attention(_bwd)?::Kernel|sdpa|fmha|flash' -c ${NCU_COUNT:-12} --section SpeedOfLight \
               --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
               --section InstructionStats --section Occupancy --section MemoryWorkloadAnalysis \
               env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/attention_ncu.py --only ours_bwd cudnn_bwd \
               ${NCU_ARGS:-}
             stage attnncu-details 120 "$NCU" -i "$OUT/attn.ncu-rep" --page details ;;
    groupedprobe) # where the grouped forward loses to jnp.dot: one group / even / multinomial / 64-row counts, then
                  # Nsight Compute on E 64 uniform (nvidia-h100-x1 only: counters elsewhere refused)
                  stage groupedprobe 150 python3 scripts/grouped_probe.py ${PROBE_ARGS:-}
                  ncu_contenders "ours E64 uniform" "--section SpeedOfLight --section MemoryWorkloadAnalysis \
                    --section ComputeWorkloadAnalysis" "${PROBE_ARGS:-}" ;;
    ncustalls) ncu_contenders "${NCU_CONTENDERS:-ours E1|ours E1 [dyn]|ours wgrad E64 uniform}" \
                 "${NCU_SECTIONS:---section SpeedOfLight --section WarpStateStats --section SchedulerStats}" \
                 "--variants dyn --modes wgrad" ;;
    probe) stage probe ${PROBE_LIMIT:-120} env CUDA_VISIBLE_DEVICES=0 python3 scripts/grouped_probe.py --variants ${PAIR_VARIANTS:-pair} ${PROBE_ARGS:-} ;;
    splitdefault) # split as the default (PK_JAX_GROUPED_VARIANT unset): the tests at it and beside it, then the probe
             variant_tests "default nosplit pair"
             stage ffn-tests 120 timeout 110 python3 -m pytest tests/gpu/test_expert_ffn_gpu.py -m gpu -x -q -rs
             stage modes-probe 240 python3 scripts/grouped_probe.py --modes dgrad wgrad --variants nosplit dyn --reps 20 ;;
    defaulttests) variant_tests default
                  stage ffn-tests 120 timeout 110 python3 -m pytest tests/gpu/test_expert_ffn_gpu.py -m gpu -x -q -rs ;;
    wgradab) PROBE_ARGS="--modes dgrad wgrad --reps 20" variant_ab "${WGRAD_VARIANTS:-pipe w128}" ;;
    pairab) variant_ab "${PAIR_VARIANTS:-pair w128 pair+w128}" ;;
    arpipe) stage arpipe $((${ARPIPE_DEADLINE:-420} + 20)) env OUT="$OUT" DEADLINE=${ARPIPE_DEADLINE:-420} \
              bash scripts/stage_ar_pipelined.sh ;;
    moeoverlap) stage moeoverlap $((${MOEOVERLAP_DEADLINE:-420} + 20)) env OUT="$OUT" DEADLINE=${MOEOVERLAP_DEADLINE:-420} \
                  bash scripts/stage_moe_overlap.sh ;;
    topo) stage topo 30 bash -c "nvidia-smi; nvidia-smi topo -m" ;;
    a2a) stage a2a-tests 90 python3 -m pytest tests/gpu/test_microbench_gpu.py -m gpu -q -x -rs -k all_to_all
         stage transfer 150 python3 -m pk_jax.bench transfer --quick --out "$OUT/$day-transfer-quick.json" ;;
    moededup) stage moe-first 150 bash -c "PK_JAX_TIMEOUT_MS=3000 timeout 70 python3 -m pytest -x -q -rs \
                tests/gpu/test_moe_fused_gpu.py::test_dedup_dispatch_first && PK_JAX_TIMEOUT_MS=3000 timeout 70 python3 -m pytest \
                -x -q -rs tests/gpu/test_moe_fused_gpu.py::test_partials_combine_first"
              if grep -q " passed" "$OUT/moe-first.log" && ! grep -qE "failed|Timeout|rror" "$OUT/moe-first.log"; then
                stage moe-tests 150 env PK_JAX_TIMEOUT_MS=3000 python3 -m pytest -x -q -rs tests/gpu/test_moe_fused_gpu.py \
                  tests/gpu/test_moe_gpu.py
                stage moe-exchange 150 python3 -m pk_jax.bench moe --op dispatch,combine --sizes 7168 --cases uniform_fwd \
                  uniform_fwd_bwd --out "$OUT/$day-moe-exchange-dedup.json"
              fi ;;
    ringbench) stage ringbench 150 python3 -m pk_jax.bench context --op ring_attention --seqs 12288 --cases \
                 fwd_contiguous fwd_causal_zigzag fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports pk xla --reps 10 \
                 --out "$OUT/$day-context-ring-transports.json" ;;
    moeranks2) stage moeranks2 ${MOERANKS_LIMIT:-200} python3 -m pk_jax.bench multirank --ranks 2 --steps check_moe \
                 --out "$OUT/$day-multirank-2-moe.json" ;;
    sharedranks) stage sharedranks 540 python3 -m pk_jax.bench multirank --ranks 2 4 --steps check_small \
                   check_small_replay check_moe check_ring --out "$OUT/$day-multirank-shared.json" ;;
    overlapall) stage overlap-every-gpu 150 env PK_JAX_TIMEOUT_MS=3000 python3 -m pytest -x -q -rs tests/gpu/test_moe_overlap_gpu.py \
                  -k on_every_gpu ;;
    x4next) # (2 GPUs+; written for the next 4-GPU lease) the tests session 12's lease left: each suspect first, bounded
            stage overlap-all 150 env PK_JAX_TIMEOUT_MS=3000 python3 -m pytest -x -q -rs tests/gpu/test_moe_overlap_gpu.py \
              -k on_every_gpu
            stage pipelined-rest 200 env PK_JAX_TIMEOUT_MS=10000 python3 -m pytest -x -q -rs tests/gpu/test_small_pipelined_gpu.py \
              -k "interleave or fresh_processes or replays"
            stage context-rest 150 python3 -m pytest -q -rs tests/gpu/test_context_gpu.py -k "temp_memory or bench_shape" ;;
    x4rows) stage ringtimeline 150 env PK_JAX_RING_TRANSPORT=pk python3 scripts/ring_timeline.py \
              --cases fwd_contiguous fwd_bwd_contiguous fwd_bwd_causal_zigzag
            for cfg in ${RING_CFGS:-float32:8 float32:4 input:8 input:16}; do  # dK/dV hop dtype : shift CTAs (= SMs left free)
              stage ring-${cfg/:/-} 120 env PK_JAX_RING_ACC_DTYPE=${cfg%:*} PK_JAX_RING_SHIFT_CTAS=${cfg#*:} \
                python3 -m pk_jax.bench context --op ring_attention --cases fwd_contiguous fwd_causal_zigzag \
                fwd_bwd_contiguous fwd_bwd_causal_zigzag \
                --seqs 12288 --reps 10 --out "$OUT/$day-context-ring-${cfg/:/-}.json"
            done ;;
    x4ctxrest) stage context-rest-rows 240 python3 -m pk_jax.bench context --reps 10 --cases fwd_bwd fwd_bwd_causal \
                 fwd_bwd_causal_contiguous --out "$OUT/$day-context-rest.json" ;;
    ulyssesab) stage ulysses-tests 150 env PK_JAX_TIMEOUT_MS=5000 python3 -m pytest -x -q -rs tests/gpu/test_ring_shift_gpu.py \
                 tests/gpu/test_context_gpu.py -k "distances or head_chunks"
               for cfg in ${ULYSSES_CFGS:-1:pk 4:async 4:async:pk 8:async:pk 4:lax}; do  # chunks : exchange [: local]
                 IFS=: read -r chunks a2a local <<< "$cfg"
                 stage ulysses-${cfg//:/-} 120 env PK_JAX_ULYSSES_CHUNKS=$chunks PK_JAX_ULYSSES_A2A=$a2a \
                   PK_JAX_ULYSSES_LOCAL=${local:-default} python3 -m pk_jax.bench context --op ulysses_attention \
                   --cases fwd fwd_bwd --reps 10 --out "$OUT/$day-context-ulysses-${cfg//:/-}.json"
               done ;;
    x4moe) stage moe-overlap-bench 200 python3 -m pk_jax.bench moe --op dispatch_gemm --out "$OUT/$day-moe-dispatch-gemm.json"
           stage moe 420 python3 -m pk_jax.bench moe --out "$OUT/$day-moe.json" ;;
    dqconvert) # the backward's dQ conversion kernel: its bits vs XLA's conversion, the gradient tests, then A/B rows
               stage dq-tests 150 python3 -m pytest tests/gpu/test_attention_bwd_gpu.py -m gpu -q -x -rs \
                 -k "dq_convert or gradients_match"
               for conv in xla kernel; do
                 stage ring-dq-$conv 80 env PK_JAX_ATTENTION_DQ_CONVERT=$conv python3 -m pk_jax.bench context \
                   --op ring_attention --cases fwd_bwd_contiguous fwd_bwd_causal_zigzag --seqs 12288 --reps 10 \
                   --out "$OUT/$day-context-ring-dq-$conv.json"
               done
               stage context-tests 100 python3 -m pytest tests/gpu/test_context_gpu.py -m gpu -q -x -rs -k ring_attention_matches_reference
               for conv in xla kernel; do
                 stage attn-dq-$conv 70 env PK_JAX_ATTENTION_DQ_CONVERT=$conv python3 -m pk_jax.bench attention \
                   --cases fwd_bwd fwd_bwd_causal --seqs 1024 4096 16384 --head-dims 128 --reps 5 \
                   --out "$OUT/$day-attention-dq-$conv.json"
               done ;;
    acctests) accumulate_tests ;;
    copyengine) # (2 GPUs+) tests only; copybench times them (a later call)
                first_then_rest copy "tests/gpu/test_ring_shift_gpu.py::test_shift_alone_small[copy-2]" \
                  tests/gpu/test_ring_shift_gpu.py
                accumulate_tests ;;
    copybench) # (2 GPUs+) after copyengine's tests passed: ring tests with both, a timeline, ring rows per transport
               ring_ab merge "PK_JAX_RING_MERGE=kernel" "fwd_causal_zigzag fwd_bwd_causal_zigzag" copy-engine \
                 pk-copy-acc pk pk-copy pk-acc
               stage copy-ring-bf16acc 100 env PK_JAX_RING_ACC_DTYPE=input python3 -m pk_jax.bench context --op ring_attention \
                 --seqs 12288 --cases fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports pk-copy-acc pk --reps 10 \
                 --out "$OUT/$day-context-ring-copy-engine-bf16acc.json" ;;
    windowtests) # (2 GPUs+) the windowed all-to-all by copy engines: its first test alone (5 s waits), then the rest
                 first_then_rest window "tests/gpu/test_window_exchange_gpu.py::test_window_alone_small" \
                   tests/gpu/test_window_exchange_gpu.py ;;
    dqmerge) # (2 GPUs+) the backward's dQ added in the kernel alone (PK_JAX_RING_MERGE=dq), the final dK/dV sum fused
             ring_ab dq "PK_JAX_RING_MERGE=dq" "fwd_bwd_causal_zigzag fwd_bwd_contiguous" dq pk-copy-dq pk pk-copy pk-dq
             stage dq-ring-24576 150 python3 -m pk_jax.bench context --op ring_attention --seqs 24576 --cases \
               fwd_bwd_causal_zigzag --ring-transports pk-copy-dq pk --reps 5 --out "$OUT/$day-context-ring-dq-24576.json" ;;
    ulyssestimeline) # (2 GPUs+) where Ulysses' time goes at S 2048 per ULYSSES_CFGS "chunks:exchange[:engine]"
                     for cfg in ${ULYSSES_CFGS:-1:pk 2:async:sm 2:async:copy 4:async:sm}; do
                       IFS=: read -r chunks a2a engine <<< "$cfg"
                       stage ulysses-timeline-${cfg//:/-} 40 env PK_JAX_ULYSSES_CHUNKS=$chunks PK_JAX_ULYSSES_A2A=$a2a \
                         PK_JAX_ULYSSES_LOCAL=$([ "$a2a" = async ] && echo pk || echo default) PK_JAX_RING_SHIFT_ENGINE=${engine:-sm} python3 scripts/ring_timeline.py \
                         --op ulysses --seq 2048 --heads 128 --cases fwd fwd_bwd
                     done ;;
    moetimeline) stage moe-timeline 200 python3 scripts/moe_timeline.py ;;
    moesort) # (2 GPUs+) the MoE routing's counted positions (no sort, E 8 top-2): dispatch / combine timelines, then
             # bench rows at H 4096 (session 16 with XLA's sort: dispatch 0.217 ms = 311 GB/s, 39 us of it sorting)
             stage moe-sort-timeline 60 python3 scripts/moe_timeline.py --programs dispatch combine \
               --shape 4096 4096 8 2 128 --min-us 1
             stage moe-sort-bench 120 python3 -m pk_jax.bench moe --op dispatch,combine --sizes 4096 \
               --out "$OUT/$day-moe-exchange-4096.json" ;;
    moeskew) stage moe-skewed 200 python3 -m pk_jax.bench moe --op dispatch,combine --sizes 4096 \
               --out "$OUT/$day-moe-exchange-skewed.json" ;;
    ulyssesreserve) # (2 GPUs+) windowed Ulysses (4 chunks, copy engines, our attention) per SMs it leaves free
                    for r in ${RESERVES:-0 8 16 32}; do
                      stage ulysses-reserve-timeline-$r 40 env PK_JAX_ULYSSES_RESERVE_SMS=$r PK_JAX_ULYSSES_CHUNKS=4 \
                        PK_JAX_ULYSSES_A2A=async PK_JAX_ULYSSES_LOCAL=pk PK_JAX_RING_SHIFT_ENGINE=copy \
                        python3 scripts/ring_timeline.py --op ulysses --seq 2048 --heads 128 --cases fwd fwd_bwd
                    done
                    for r in ${RESERVE_BENCH:-16}; do
                      stage ulysses-reserve-$r ${ULYSSES_LIMIT:-170} env PK_JAX_ULYSSES_RESERVE_SMS=$r \
                        PK_JAX_RING_SHIFT_ENGINE=copy PK_JAX_ULYSSES_CHUNKS=4 PK_JAX_ULYSSES_A2A=async \
                        PK_JAX_ULYSSES_LOCAL=pk python3 -m pk_jax.bench context --op ulysses_attention --cases fwd fwd_bwd \
                        --reps ${ULYSSES_REPS:-10} --out "$OUT/$day-context-ulysses-reserve-$r.json"
                    done ;;
    ulyssesown) # (2 GPUs+) windowed Ulysses, own blocks by XLA: only peer copies on the side stream under the attention
                for r in ${RESERVES:-0 16}; do
                  stage ulysses-own-timeline-$r 40 env PK_JAX_ULYSSES_RESERVE_SMS=$r PK_JAX_ULYSSES_CHUNKS=4 \
                    PK_JAX_ULYSSES_A2A=async PK_JAX_ULYSSES_LOCAL=pk PK_JAX_RING_SHIFT_ENGINE=copy \
                    python3 scripts/ring_timeline.py --op ulysses --seq 2048 --heads 128 --cases fwd fwd_bwd
                done
                for cfg in ${OWN_CFGS:-4:0:pk 8:0:pk}; do
                  IFS=: read -r chunks r local <<< "$cfg"
                  stage ulysses-own-$chunks-$r-$local ${ULYSSES_LIMIT:-170} env PK_JAX_ULYSSES_RESERVE_SMS=$r \
                    PK_JAX_RING_SHIFT_ENGINE=copy PK_JAX_ULYSSES_CHUNKS=$chunks PK_JAX_ULYSSES_A2A=async \
                    PK_JAX_ULYSSES_LOCAL=$local python3 -m pk_jax.bench context --op ulysses_attention --cases fwd fwd_bwd \
                    --reps ${ULYSSES_REPS:-10} --out "$OUT/$day-context-ulysses-own-$chunks-$r-$local.json"
                done ;;
    ulyssesdefault) # (2 GPUs+) Ulysses at defaults (auto: the windowed pipeline at G 2): its GPU tests, then the bench rows
                    stage ulysses-default-tests 160 python3 -m pytest tests/gpu/test_context_gpu.py tests/gpu/test_window_exchange_gpu.py \
                      -m gpu -q -x -rs -k "ulysses"
                    stage ulysses-default ${ULYSSES_LIMIT:-170} python3 -m pk_jax.bench context --op ulysses_attention \
                      --cases fwd fwd_bwd --reps ${ULYSSES_REPS:-10} --out "$OUT/$day-context-ulysses-default.json" ;;
    ulyssestests) # (2 GPUs+) Ulysses' and the windowed exchange's GPU tests on GPUs PAIR
                  stage ulysses-tests 200 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 -m pytest tests/gpu/test_context_gpu.py \
                    tests/gpu/test_window_exchange_gpu.py -m gpu -q -rs -k "ulysses or window" ;;
    ulyssestl) # (2 GPUs+) Ulysses forward timelines at defaults on GPUs PAIR (ULYSSES_TL_SEQS, default "8192 2048")
               for seq in ${ULYSSES_TL_SEQS:-8192 2048}; do
                 stage ulysses-timeline-$seq 90 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 scripts/ring_timeline.py \
                   --op ulysses --seq $seq --heads 128 --cases fwd
               done ;;
    ulysseschunks) # (2 GPUs+) Ulysses forward rows per head-chunk count of the windowed pipeline (ULYSSES_CHUNKS_LIST,
                   # default "8 4 16 8": 8 is the default, measured best on 2x H100 only), same turns per value
                   ulysses_env_rows "$(printf 'PK_JAX_ULYSSES_CHUNKS=%s ' ${ULYSSES_CHUNKS_LIST:-8 4 16 8})" ;;
    ulyssesprefill) # (2 GPUs+) Ulysses forward rows per PK_JAX_ULYSSES_PREFILL value (ULYSSES_PREFILL_LIST, default
                    # "4 0 7 4 0": 4 is the default, 0 places every own block between the attention kernels), same turns
                    ulysses_env_rows "$(printf 'PK_JAX_ULYSSES_PREFILL=%s ' ${ULYSSES_PREFILL_LIST:-4 0 7 4 0})" ;;
    ulyssesenvs) # (2 GPUs+) Ulysses rows (ULYSSES_CASES, default fwd) once per entry of ULYSSES_ENVS: space-separated entries,
                 # each a comma-separated list of VAR=VALUE settings ("-" for the defaults), in that order
                 ulysses_env_rows "${ULYSSES_ENVS:?set ULYSSES_ENVS, e.g. "- PK_JAX_ULYSSES_HALF_ENDS=1"}" ;;
    ulysseshalf) # (2 GPUs+) Ulysses at defaults with half-width first and last chunks (PK_JAX_ULYSSES_HALF_ENDS=1: 9 chunks)
                 stage ulysses-half ${ULYSSES_LIMIT:-170} env PK_JAX_ULYSSES_HALF_ENDS=1 python3 -m pk_jax.bench context \
                   --op ulysses_attention --cases fwd fwd_bwd --reps ${ULYSSES_REPS:-10} --out "$OUT/$day-context-ulysses-half.json" ;;
    ulysseshalf2) # (4 GPUs) issue 26's 2-GPU Ulysses forward rows on GPUs PAIR, defaults then half ends, in one call
                  for half in 0 1; do
                    stage ulysses-fwd-2gpu-half$half 120 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} PK_JAX_ULYSSES_HALF_ENDS=$half \
                      python3 -m pk_jax.bench context --op ulysses_attention --cases fwd --reps 10 \
                      --out "$OUT/$day-context-ulysses-fwd-2gpu-half$half.json"
                  done ;;
    ulyssescopy) # (2 GPUs+) Ulysses per ULYSSES_CFGS "chunks:exchange[:local]" with the async exchanges on copy engines
                 for cfg in ${ULYSSES_CFGS:-1:pk 2:async:pk 4:async:pk 8:async:pk}; do
                   IFS=: read -r chunks a2a local <<< "$cfg"
                   stage ulysses-copy-${cfg//:/-} ${ULYSSES_LIMIT:-120} env PK_JAX_RING_SHIFT_ENGINE=copy \
                     PK_JAX_ULYSSES_CHUNKS=$chunks PK_JAX_ULYSSES_A2A=$a2a PK_JAX_ULYSSES_LOCAL=${local:-default} \
                     python3 -m pk_jax.bench context --op ulysses_attention --cases fwd fwd_bwd --reps ${ULYSSES_REPS:-10} \
                     --out "$OUT/$day-context-ulysses-copy-${cfg//:/-}.json"
                 done ;;
    x4ring2) # (2 GPUs+) the ring after session 13's backward changes: GPU tests, a timeline, then the shift-CTA sweep
             stage shift-tests 90 env PK_JAX_TIMEOUT_MS=5000 python3 -m pytest tests/gpu/test_ring_shift_gpu.py -m gpu -q -x \
               -rs -k "several_buffers"
             stage ring-tests 100 python3 -m pytest tests/gpu/test_context_gpu.py -m gpu -q -x -rs \
               -k "ring_attention_matches_reference or temp_memory"
             stage ringtimeline 60 env PK_JAX_RING_TRANSPORT=pk python3 scripts/ring_timeline.py \
               --cases fwd_causal_zigzag fwd_bwd_causal_zigzag fwd_bwd_contiguous
             stage ring-floor 120 python3 -m pk_jax.bench context --op ring_attention --compute-floor --seqs 12288 \
               --cases fwd_causal_zigzag fwd_bwd_causal_zigzag fwd_contiguous --reps 10 \
               --out "$OUT/$day-context-ring-compute-floor.json"
             for cfg in ${SHIFT_CFGS:-8:4 16:4 8:8 8:16 16:8}; do  # shift CTAs (= SMs the attention leaves free) : loads
               ctas=${cfg%:*} unroll=${cfg#*:}                  # in flight per thread (PK_JAX_RING_SHIFT_UNROLL)
               stage ring-ctas$ctas-unroll$unroll 75 env PK_JAX_RING_SHIFT_CTAS=$ctas PK_JAX_RING_SHIFT_UNROLL=$unroll \
                 python3 -m pk_jax.bench context --op ring_attention --cases fwd_contiguous fwd_causal_zigzag \
                 fwd_bwd_contiguous fwd_bwd_causal_zigzag --seqs 12288 --reps 10 \
                 --out "$OUT/$day-context-ring-ctas$ctas-unroll$unroll.json"
             done ;;
    x4copy) # (4 GPUs) copy engines at G 4, their first run there: the copy shift's first test, ring rows at S 12288 per
            # transport (TRANSPORTS, same turns), then the shift tests of both engines and the window tests (sub-axis too)
            stage copy-first 120 env PK_JAX_TIMEOUT_MS=5000 timeout 110 python3 -m pytest -x -q -rs \
              "tests/gpu/test_ring_shift_gpu.py::test_shift_alone_small[copy-2]"
            if grep -q " passed" "$OUT/copy-first.log" && ! grep -qE "failed|rror" "$OUT/copy-first.log"; then
              stage x4-ring-bench 240 python3 -m pk_jax.bench context --op ring_attention --seqs 12288 --cases fwd_contiguous \
                fwd_causal_zigzag fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports ${TRANSPORTS:-pk-copy pk pk-copy-dq} \
                --reps 10 --out "$OUT/$day-context-ring-x4copy.json"
              stage copy-tests 120 env PK_JAX_TIMEOUT_MS=5000 python3 -m pytest -q -rs tests/gpu/test_ring_shift_gpu.py
              first_then_rest window "tests/gpu/test_window_exchange_gpu.py::test_window_alone_small" \
                tests/gpu/test_window_exchange_gpu.py
            fi ;;
    ulyssesbarrier) # (2 GPUs+) the async backward's barrier over each chunk's output (PK_JAX_ULYSSES_BWD_BARRIER=chunks):
                    # cuDNN gradient and compiled-order tests, then Ulysses fwd+bwd on GPUs PAIR (default 0,1) with and without
                    stage ulysses-barrier-tests 120 python3 -m pytest tests/gpu/test_window_exchange_gpu.py -m gpu -q -rs \
                      -k "cudnn or backward_after"
                    for b in chunks none; do
                      stage ulysses-barrier-$b 150 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} PK_JAX_ULYSSES_BWD_BARRIER=$b \
                        python3 -m pk_jax.bench context --op ulysses_attention --cases fwd_bwd --seqs 2048 4096 --reps 10 \
                        --out "$OUT/$day-context-ulysses-barrier-$b.json"
                    done ;;
    ringcudnn) # the ring's block pairs on cuDNN (PK_JAX_RING_LOCAL=cudnn): the one-GPU probe; if it ran clean, the GPU
               # tests (2 GPUs+) and ring rows at S 12288 against the default in the same turns (2 GPUs+)
               stage cudnn-probe 150 python3 -X faulthandler scripts/probe_cudnn_ring_block.py
               if grep -q "^ring G 1 causal=True" "$OUT/cudnn-probe.log" && ! grep -qE "FAILED|Fatal" "$OUT/cudnn-probe.log"; then
                 stage cudnn-ring-tests 150 python3 -m pytest tests/gpu/test_context_gpu.py -m gpu -q -rs -k cudnn
                 stage cudnn-ring-bench 240 python3 -m pk_jax.bench context --op ring_attention --seqs 12288 --cases \
                   fwd_contiguous fwd_causal_zigzag fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports \
                   pk-copy-dq-cudnn pk-copy-dq --reps 10 --out "$OUT/$day-context-ring-cudnn.json"
               fi ;;
    subaxis) # (4 GPUs) ring attention on the size-2 axis of a (2, 2) mesh: two copy-engine rings at once
             stage subaxis 120 env PK_JAX_TIMEOUT_MS=5000 python3 -m pytest tests/gpu/test_context_gpu.py -m gpu -q -rs -k sub_axis ;;
    ring2) # (4 GPUs) the ring's 2-GPU rows on GPUs PAIR (default 0,1) at defaults: S 12288 and 24576
           stage ring2 ${RING2_LIMIT:-240} env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 -m pk_jax.bench context \
             --op ring_attention --seqs 12288 24576 --cases fwd_contiguous fwd_causal_zigzag fwd_bwd_contiguous \
             fwd_bwd_causal_zigzag --reps 10 ${RING2_TRANSPORTS:+--ring-transports $RING2_TRANSPORTS} \
             --out "$OUT/$day-context-ring-2gpu.json" ;;
    ringnext) # (2 GPUs+; 4 for the 4-GPU rows) deferred merges/sums and bf16 hops against the default, same turns: the
              # deferred GPU tests, ring rows at S 12288 with the compute floor, the 2-GPU causal zigzag fwd+bwd at S 24576
              # (GPUs PAIR), then the S 49152 fwd+bwd rows
              stage deferred-tests 150 python3 -m pytest tests/gpu/test_context_gpu.py -m gpu -q -rs -k "deferred or cudnn"
              if grep -q " passed" "$OUT/deferred-tests.log" && ! grep -qE "failed|rror" "$OUT/deferred-tests.log"; then
                stage ring-next 200 python3 -m pk_jax.bench context --op ring_attention --seqs 12288 --cases fwd_contiguous \
                  fwd_causal_zigzag fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports pk-copy-dq-cudnn \
                  pk-copy-dq-cudnn-deferred pk-copy-dq-cudnn-bf16hops pk-copy-dq-cudnn-split --compute-floor --reps 10 \
                  --out "$OUT/$day-context-ring-next.json"
                stage ring-next-2gpu 150 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 -m pk_jax.bench context \
                  --op ring_attention --seqs 24576 --cases fwd_bwd_causal_zigzag --ring-transports pk-copy-dq-cudnn \
                  pk-copy-dq-cudnn-deferred pk-copy-dq-cudnn-split --reps 10 --out "$OUT/$day-context-ring-next-2gpu.json"
                stage ring-next-timeline 90 python3 scripts/ring_timeline.py --cases fwd_bwd_contiguous fwd_bwd_causal_zigzag
              fi ;;
    ringnextlong) # (4 GPUs) after ringnext: the S 49152 fwd+bwd rows, deferred sums against the default, same turns
              stage ring-next-long 300 python3 -m pk_jax.bench context --op ring_attention --seqs 49152 --cases \
                fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports pk-copy-dq-cudnn pk-copy-dq-cudnn-deferred \
                --reps 5 --out "$OUT/$day-context-ring-next-long.json" ;;
    ringdirect) # see the list above; the transports differ from "default" only in the setting each names
              t=tests/gpu/test_attention_accumulate_gpu.py tr="default split"
              stage direct-first 120 env PK_JAX_ATTENTION_BWD_DEBUG=1 timeout 110 python3 -m pytest "$t" -m gpu -q -x -rs \
                -k "backward_adds_dq_into_rows and in_place and B1-Tq128"
              if grep -q " passed" "$OUT/direct-first.log" && ! grep -qE "failed|rror" "$OUT/direct-first.log"; then
                stage direct-tests 200 python3 -m pytest "$t" tests/gpu/test_context_gpu.py -m gpu -q -rs \
                  -k "backward_adds_dq_into_rows or dq-direct"
                if grep -q " passed" "$OUT/direct-tests.log" && ! grep -qE "failed|rror" "$OUT/direct-tests.log"; then
                  tr="default direct split"  # dq-direct is timed only once its tests passed
                fi
              fi
              stage direct-bench 150 python3 -m pk_jax.bench context --op ring_attention --seqs 12288 --cases \
                fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports $tr --reps 10 \
                --out "$OUT/$day-context-ring-direct.json"
              stage direct-bench-2gpu 150 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 -m pk_jax.bench context \
                --op ring_attention --seqs 24576 --cases fwd_bwd_causal_zigzag --ring-transports $tr \
                --reps 10 --out "$OUT/$day-context-ring-direct-2gpu.json" ;;
    abpy) : "${AB_DIR:?set AB_DIR and AB_COMMIT (scripts/ab_prepare.sh)}" "${AB_COMMIT:?}" "${AB_ARGS:?set AB_ARGS}"
          cp ${AB_SO:-pk_jax}/_pk_jax_ext*.so "$AB_DIR/pk_jax/" || exit 1  # AB_SO: the old side's extension folder
          for i in $(seq "${AB_TURNS:-2}"); do  # $AB_ARGS unquoted on purpose: the bench's own arguments
            stage abpy-old-$i ${AB_LIMIT:-200} env -C "$AB_DIR" PK_JAX_COMMIT="$AB_COMMIT" PYTHONPATH="$PWD/$AB_DIR" \
              python3 -m pk_jax.bench $AB_ARGS --out "$OUT/$day-abpy-old-$i.json"
            stage abpy-new-$i ${AB_LIMIT:-200} python3 -m pk_jax.bench $AB_ARGS --out "$OUT/$day-abpy-new-$i.json"
          done ;;
    splitrows) # where splitting the bottom-right pairs for cuDNN starts to pay (cudnn_block.SPLIT_MIN_ROWS)
               stage splitrows-2gpu 150 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 -m pk_jax.bench context \
                 --op ring_attention --seqs 12288 --cases fwd_causal_zigzag fwd_bwd_causal_zigzag \
                 --ring-transports whole split --reps 20 --out "$OUT/$day-context-ring-splitrows-2gpu.json"
               stage splitrows 150 python3 -m pk_jax.bench context --op ring_attention --seqs 49152 \
                 --cases fwd_bwd_causal_zigzag --ring-transports whole split --reps 5 \
                 --out "$OUT/$day-context-ring-splitrows.json" ;;
    ringpk) # every pair on our kernels with dq-direct against the defaults (cuDNN pairs), G 4 and GPUs PAIR
            stage ringpk 200 python3 -m pk_jax.bench context --op ring_attention --seqs 12288 --cases \
              fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports default pk-direct --reps 10 \
              --out "$OUT/$day-context-ring-pk-direct.json"
            stage ringpk-2gpu 150 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 -m pk_jax.bench context \
              --op ring_attention --seqs 24576 --cases fwd_bwd_contiguous --ring-transports default pk-direct --reps 5 \
              --out "$OUT/$day-context-ring-pk-direct-2gpu.json" ;;
    ringmix) # (2 GPUs+; 4 for the G 4 rows) cudnn-fwd (forward pairs on cuDNN, backward pairs on our kernel) and
             # dq-direct against the defaults: their GPU tests, then G 4 S 12288 fwd+bwd and the GPUs PAIR rows
             stage ringmix-tests 200 env PK_JAX_TIMEOUT_MS=5000 python3 -m pytest tests/gpu/test_context_gpu.py -m gpu \
               -q -x -rs -k "cudnn-fwd or deferred_sums"
             stage ringmix 200 python3 -m pk_jax.bench context --op ring_attention --seqs 12288 --cases \
               fwd_bwd_contiguous fwd_bwd_causal_zigzag --ring-transports default direct cudnn-fwd --reps 20 \
               --out "$OUT/$day-context-ring-mix.json"
             stage ringmix-2gpu 150 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 -m pk_jax.bench context \
               --op ring_attention --seqs 12288 --cases fwd_bwd_causal_zigzag --ring-transports default direct cudnn-fwd \
               --reps 20 --out "$OUT/$day-context-ring-mix-2gpu.json" ;;
    latfloor2) # (4 GPUs) the floor slopes at defaults on GPUs PAIR only: issue 25's 2-GPU rows on a 4-GPU machine
               stage floor-default-2gpu 120 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 scripts/latency_floor.py \
                 --tag default --ops pk_auto psum --bytes $FLOOR_BYTES --out "$OUT/$day-floor-default-2gpu.json" ;;
    ringfloor) # (2 GPUs+) issue 26's compute floor at defaults: the ring with communication off vs our kernel on the
               # member's blocks, S 12288, every ring case (extra.compute_over_floor, target <= 1.05)
               stage ring-floor ${FLOOR_LIMIT:-240} python3 -m pk_jax.bench context --op ring_attention --compute-floor \
                 --seqs 12288 --reps 10 --out "$OUT/$day-context-ring-compute-floor.json" ;;
    timeline49k) # (4 GPUs) where the non-causal ring forward's time goes at S 49152 (issue 26's 1.07x row), at defaults
                 stage timeline49k 150 python3 scripts/ring_timeline.py --seq 49152 --cases fwd_contiguous ;;
    ulysses8k) # (4 GPUs) issue 26's 2-GPU Ulysses rows on GPUs PAIR: timelines at defaults (S 8192 and 2048, fwd), then
               # the forward rows again; session 23 measured S 8192 at 1.14-1.17x where session 19 had 1.28x
               for seq in 8192 2048; do
                 stage ulysses-timeline-$seq 90 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 scripts/ring_timeline.py \
                   --op ulysses --seq $seq --heads 128 --cases fwd
               done
               stage ulysses-fwd-2gpu 150 env CUDA_VISIBLE_DEVICES=${PAIR:-0,1} python3 -m pk_jax.bench context \
                 --op ulysses_attention --cases fwd --reps 10 --out "$OUT/$day-context-ulysses-fwd-2gpu.json" ;;
    gputests) stage gputests 540 bash tests/gpu/run.sh -x -q ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
