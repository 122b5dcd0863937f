#!/usr/bin/env bash
# Issue 9's benchmarks in one command on one GPU (docs/benchmarks.md, "Running the GPU suite (issue 9)").
#
#   bash tools/bench/gpu_suite.sh                       # every default step, most important first (~9 min, H100)
#   bash tools/bench/gpu_suite.sh moe_layer dispatch    # a subset, in the order given
#   bash tools/bench/gpu_suite.sh train_mfu_full        # MFU with compile off and on at full size (~5-6 min)
#   bash tools/bench/gpu_suite.sh attention             # gpt-oss sink / window attention vs SDPA and transformers
#   bash tools/bench/gpu_suite.sh --smoke               # CPU (or GPU) script check at tiny sizes (CI)
#   bash tools/bench/gpu_suite.sh --list
#
# Options: --smoke; --budget SECONDS (560: no step starts past it, and each step's timeout is cut to what
# is left, so the whole run stays inside a 10-minute command limit); --out DIR (default "${OUT:-bench-results}").
# Environment: PYTHON (default python3, the interpreter that holds torch), OUT (the device tool's folder).
#
# Output: DIR/suite.log (everything printed), and every step's JSON / log / trace in a raw folder. When OUT
# is set (the device tool brings back at most 8 files from it, 2 folders deep), the raw folder lives
# outside it and is packed into DIR/results.tar.gz after every step, so a run cut short still returns
# what it measured; DIR then holds suite.log, summary.txt, summary.json and results.tar.gz. Otherwise
# the raw folder is DIR/raw. The run ends with suite_summary.py: issue 9's targets next to the numbers.
# Nothing here asserts a timing: a step that fails or times out is reported and the suite goes on.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
DEFAULT_STEPS=(env tests moe_layer grouped_gemm dispatch profile train_mfu)
ALL_STEPS=(env tests moe_layer grouped_gemm dispatch profile train_mfu train_mfu_full tune grouped_gemm_tuned
           grouped_gemm_quick train_mfu_tma attention router_balance linear_attention lm_loss linear_attention_scan
           train_mfu_ab train_mfu_fused grouped_gemm_mixtral1b batch_generate ac_compile)
SMOKE=0
BUDGET=560
RESULTS=${OUT:-bench-results}
STEPS=()

describe() {
  cat <<'EOF'
env             device, driver, torch / CUDA / triton / transformers versions, moekit commit
tests           the GPU test tier, pytest -m gpu (kernels vs float64, layer, training, FSDP bf16, compile),
                with MOEKIT_AUTOTUNE=first (one compile per kernel, not one per candidate config),
                4 pytest-xdist workers where installed                                      (cap 300 s)
moe_layer       MoE layer fwd+bwd at 8192 and 32768 tokens, bf16: moekit vs torchtitan-style vs transformers;
                per-phase times, router host syncs, activation memory vs minimum          (cap 210 s)
grouped_gemm    Triton grouped GEMM / expert MLP vs torch grouped_mm, loop, dense; 4 shapes x 8192/32768
                tokens x uniform/Zipf routing, fwd and fwd+bwd                              (cap 160 s)
dispatch        local permute / unpermute GB/s vs a plain copy of the same bytes, fwd and bwd and the kernels behind each op (cap 70 s)
profile         torch.profiler of training steps of the ~1B preset at train_mfu's micro-batch (16 x 2048): chrome
                trace + time by category (cap 150 s: building and initialising 1B parameters takes most of it)
train_mfu       tools/bench/train_mfu.py, compile off, shortened (15 steps)                 (what is left)
train_mfu_full  tools/bench/train_mfu.py at its defaults (compile off and on); not in the default set
tune            tools/bench/tune_kernels.py: tile-config sweep of every expert-MLP kernel call, backward
                first, per shape (what is left); not in the default set. Its candidates compile in
                background workers from the suite's start (while `tests` runs), the sweep then only times
grouped_gemm_tuned
                grouped_gemm at 8192 tokens, uniform routing, with the sweep's winners added to the
                autotuner's lists (MOEKIT_KERNEL_CONFIGS=tune_kernels.json); after `tune`  (cap 160 s)
grouped_gemm_quick
                grouped_gemm's 4 shapes at 8192 tokens, uniform routing, one round: the triton_tma peer
                against triton and torch in about half the default step's time; writes grouped_gemm.json
                (use it instead of grouped_gemm)                                            (cap 120 s)
train_mfu_tma   tools/bench/train_mfu.py, compile off, 12 steps, the Triton experts with MOEKIT_TMA=never and
                always: TMA's end-to-end effect; writes train_mfu.json                     (what is left)
router_balance  tools/bench/router_balance.py: a DeepSeek-V3-sized router (H 7168, top-8 sigmoid) fwd+bwd with no
                balance loss, the batch-wise one and the sequence-wise one (balance="sequence"), 8192 / 32768
                tokens, 64 / 256 experts, bf16; not in the default set                    (cap 60 s)
linear_attention  tools/bench/linear_attention.py: Qwen3.5-35B-A3B's Gated DeltaNet layer (H 2048, 16 / 32 heads
                of 128) fwd+bwd against transformers' layer (its torch path), S 4096 / 16384, bf16; not in the
                default set                                                                (cap 90 s)
lm_loss         tools/bench/lm_loss.py: the LM-head loss fwd+bwd, N 32768, H 1024 / 4096, V 32000 / 151936, bf16:
                the fused cross-entropy kernel against torch's chunked passes and the plain logits path; not in
                the default set                                                            (cap 90 s)
linear_attention_scan
                linear_attention's run with the delta-rule scan kernels (MOEKIT_DELTA_SCAN=auto, opt-in): against
                the linear_attention step's (the loop); writes linear_attention_scan.json; not in the default
                set                                                                        (cap 90 s)
train_mfu_ab    tools/bench/train_mfu.py, compile on, 12 steps, --variants base and legacy (MOEKIT_LM_LOSS=never,
                MOEKIT_SPLIT_ROUTER=never, --train.residual_dtype=float32): the fused loss's, the router GEMM's and
                the bf16 residual stream's end-to-end effect in one run; writes train_mfu.json; not in the default
                set                                                                        (what is left)
train_mfu_fused tools/bench/train_mfu.py as train_mfu_ab's base with MOEKIT_FUSED_PERMUTE=always (after
                train_mfu_ab on the same machine: the fused permute's end-to-end effect); writes
                train_mfu_fused.json; not in the default set                               (what is left)
grouped_gemm_mixtral1b
                grouped_gemm at train_mfu's model (H 1024, F 3072, E 8, k 2), 32768 tokens, uniform: the fused
                expert MLP against the plain one and torch; writes grouped_gemm_mixtral1b.json; not in the
                default set                                                                (cap 120 s)
batch_generate  tools/bench/batch_generate.py: mixtral-1b (random weights, bf16), 64 prompts of 32-512 tokens, 64
                new tokens each: one at a time vs batches of 16 and 64 vs transformers' batched generate; not in
                the default set                                                            (cap 150 s)
ac_compile      tools/bench/ac_memory.py --compile: mixtral-1b (4 layers, bf16, 2 x 4096 tokens) compiled, under
                none / selective / full and selective-no-copies (the compiled matmuls recomputed, as before
                they were kept by copy); peak memory and step time; not in the default set  (cap 240 s)
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --budget) BUDGET=$2; shift ;;
    --out) RESULTS=$2; shift ;;
    --list) describe; exit 0 ;;
    -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "gpu_suite.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) if [[ " ${ALL_STEPS[*]} " == *" $1 "* ]]; then STEPS+=("$1")
       else echo "gpu_suite.sh: unknown step '$1'; steps: ${ALL_STEPS[*]}" >&2; exit 2; fi ;;
  esac
  shift
done
[ ${#STEPS[@]} -eq 0 ] && STEPS=("${DEFAULT_STEPS[@]}")
case "$RESULTS" in /*) ;; *) RESULTS=$PWD/$RESULTS ;; esac  # relative to where the suite was called

export PYTHONUNBUFFERED=1
cd "$REPO" || exit 2
# moekit must be importable as installed (moekit.* maps folders of this checkout): on a bare GPU machine,
# install this checkout in place, without touching its dependencies (no network is needed). Found, not imported:
# importing moekit.moe imports torch and triton (seconds), which every step does again anyway.
if ! "$PY" -c "import importlib.util as u; u.find_spec('moekit.moe').origin; u.find_spec('moekit.bench').origin" \
    2>/dev/null; then
  echo "gpu_suite.sh: installing this checkout (pip install --no-deps --no-build-isolation -e .)"
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e "$REPO" >/dev/null 2>&1 ||
    "$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO" ||
    { echo "gpu_suite.sh: cannot install moekit from $REPO; install it first (README)" >&2; exit 2; }
fi

HAS_CUDA=0  # nvidia-smi answers in milliseconds where importing torch to ask takes seconds
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && HAS_CUDA=1
if [ "$SMOKE" = 1 ]; then
  [ "$HAS_CUDA" = 1 ] || export TRITON_INTERPRET=1   # Triton kernels in the CPU interpreter
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}      # a script check: no thread oversubscription on small boxes
elif [ "$HAS_CUDA" != 1 ]; then
  echo "gpu_suite.sh: nvidia-smi lists no GPU; run with --smoke to check the scripts on CPU" >&2
  exit 2
fi
mkdir -p "$RESULTS"
if [ -n "${OUT:-}" ]; then PACK=1; RAW=${BENCH_RAW:-${TMPDIR:-/tmp}/moekit-bench-raw}; else PACK=0; RAW=$RESULTS/raw; fi
rm -rf "$RAW" && mkdir -p "$RAW"
exec > >(tee "$RESULTS/suite.log") 2>&1
TEE_PID=$!

START=$(date +%s)
DEADLINE=$((START + BUDGET))
STATUS=()

pack() {
  [ "$PACK" = 1 ] && tar -czf "$RESULTS/results.tar.gz.tmp" -C "$RAW" . && mv "$RESULTS/results.tar.gz.tmp" "$RESULTS/results.tar.gz"
  return 0
}

# run_step NAME CAP_SECONDS CMD...: run with a timeout of min(CAP, time left), log to RAW/NAME.log,
# echo the log's tail (the tables), record the outcome, pack.
run_step() {
  local name=$1 cap=$2; shift 2
  local left=$((DEADLINE - $(date +%s) - 5))
  if [ "$left" -lt 20 ]; then
    STATUS+=("$name: skipped (budget of ${BUDGET}s spent; run 'bash tools/bench/gpu_suite.sh $name')"); return
  fi
  local limit=$((cap < left ? cap : left)) t0 rc
  t0=$(date +%s)
  echo "=== $name (timeout ${limit}s): $*"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$RAW/$name.log" 2>&1
  rc=$?
  tail -n "${TAIL_LINES:-40}" "$RAW/$name.log"
  local took=$(($(date +%s) - t0)) what="ok"
  [ "$rc" -ne 0 ] && what="exit $rc"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && what="timed out after ${limit}s (partial JSON kept)"
  STATUS+=("$name: $what, ${took}s")
  pack
}

step_env() {
  {
    date -u
    echo "moekit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version() if torch.cuda.is_available() else None)
for name in ("triton", "transformers", "numpy"):  # versions from the metadata: importing them takes seconds
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"sm{p.major}{p.minor}", p.multi_processor_count, "SMs", f"{p.total_memory / 2**30:.1f} GiB",
          "F.grouped_mm:", hasattr(torch.nn.functional, "grouped_mm"))
EOF
  } >"$RAW/env.txt" 2>&1
  cat "$RAW/env.txt"
  STATUS+=("env: ok")
  pack
}

mfu_flags() {  # train_mfu.py is another tool's file: pass only the flags it declares
  local f=tools/bench/train_mfu.py flag out=()
  for flag in "$@"; do grep -q -- "\"${flag%%=*}\"" "$f" && out+=("${flag%%=*}" ${flag#*=}); done
  echo "${out[@]}"
}

# With `tune` asked for, its candidates compile in the background from the start (Triton's on-disk cache;
# compiling is CPU work, the GPU tier and the sweep's compiles would otherwise take turns); every timed
# step waits for it first, so nothing is timed against 10 compiling processes.
PRE_PID=
if [[ " ${STEPS[*]} " == *" tune "* ]] && [ "$SMOKE" = 0 ]; then
  cores=$(nproc 2>/dev/null || echo 4)
  "$PY" tools/bench/tune_kernels.py --precompile-only --jobs $((cores > 8 ? cores - 6 : 2)) \
    --budget $((BUDGET / 2)) >"$RAW/precompile.log" 2>&1 &
  PRE_PID=$!
fi
wait_precompile() {
  if [ -n "$PRE_PID" ]; then
    wait "$PRE_PID"; PRE_PID=
    echo "=== tune's candidates precompiled: $(tail -n 1 "$RAW/precompile.log")"
  fi
}

for step in "${STEPS[@]}"; do
  case "$step" in env|tests) ;; *) wait_precompile ;; esac
  case "$step" in
    env) step_env ;;
    tests)
      if [ "$SMOKE" = 1 ]; then STATUS+=("tests: skipped (--smoke: the GPU tier needs a GPU)"); continue; fi
      # One config per kernel: the tier checks correctness, and every candidate is a separate compile (the
      # first H200 run spent >345 s on the tier with full autotuning); test_gpu.py's every-config test
      # pins each candidate itself. Where pytest-xdist is installed (the GPU image has it), 4 workers
      # share the GPU: the tier's time is mostly Triton / inductor compiles, which are CPU work.
      xdist=()
      "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 4)
      run_step tests 300 env MOEKIT_AUTOTUNE=first "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfEs \
        ${xdist[@]+"${xdist[@]}"} --durations=12 tests/test_gpu.py tests/test_compile.py::test_inductor_matches_eager \
        tests/test_compile.py::test_inductor_gated_deltanet_gradients_match_eager \
        tests/test_compile.py::test_inductor_selective_keeps_what_eager_selective_keeps --junitxml="$RAW/gpu_tests.xml" ;;
    moe_layer)
      if [ "$SMOKE" = 1 ]; then size=(--tokens 16 --hidden 16 --shapes 16x4x2 --warmup 0 --repeats 1 --hf-impl eager)
      else size=(--device cuda --dtype bfloat16 --tokens 8192 32768 --shapes 4096x14336x8x2 2048x768x128x8
                 1536x256x128x8 --warmup 1 --repeats 5); fi
      run_step moe_layer 210 "$PY" tools/bench/moe_layer.py "${size[@]}" --out "$RAW/moe_layer.json" ;;
    grouped_gemm)
      if [ "$SMOKE" = 1 ]; then size=(--smoke)
      else size=(--shapes fine-grained,qwen3-30b-a3b,deepseek-v3-ep8,mixtral-8x7b --tokens 8192,32768
                 --routings uniform,zipf1.2 --rounds 2); fi
      run_step grouped_gemm 160 "$PY" tools/bench/grouped_gemm.py "${size[@]}" --out "$RAW/grouped_gemm.json" ;;
    dispatch)
      if [ "$SMOKE" = 1 ]; then size=(--tokens 64 --configs small --warmup 1 --repeats 2)
      else size=(--device cuda --dtype bfloat16 --tokens 16384 --configs mixtral qwen3-30b-a3b deepseek-v3
                 --repeats 20); fi
      run_step dispatch 70 "$PY" tools/bench/dispatch_bandwidth.py "${size[@]}" --out "$RAW/dispatch_bandwidth.json" ;;
    attention)  # gpt-oss's sink / window attention against plain SDPA and transformers' eager (time, peak memory)
      if [ "$SMOKE" = 1 ]; then size=(--device cpu --seqs 32 --batch 1 --heads 4 --kv-heads 2 --head-dim 16 --window 8
                                      --warmup 0 --repeats 1)
      else size=(--device cuda --dtype bfloat16 --seqs 1024 4096 --batch 1 --heads 64 --kv-heads 8 --head-dim 64
                 --window 128 --warmup 1 --repeats 5); fi
      run_step attention 90 "$PY" tools/bench/attention_sinks.py "${size[@]}" --out "$RAW/attention_sinks.json" ;;
    router_balance)  # what the sequence-wise balance loss costs against the batch-wise one
      if [ "$SMOKE" = 1 ]; then size=(--device cpu --tokens 256 --experts 8 --seq-len 64 --hidden 32 --top-k 2
                                      --warmup 0 --repeats 1)
      else size=(--device cuda --dtype bfloat16 --tokens 8192 32768 --experts 64 256 --seq-len 4096 --hidden 7168
                 --repeats 20); fi
      run_step router_balance 60 "$PY" tools/bench/router_balance.py "${size[@]}" --out "$RAW/router_balance.json" ;;
    linear_attention|linear_attention_scan)  # Qwen3.5's Gated DeltaNet against transformers' layer; _scan: with
      # the delta-rule scan kernels (opt-in), the same cases
      if [ "$SMOKE" = 1 ]; then size=(--device cpu --seq-len 40 --batch 1 --hidden 32 --key-heads 1 --value-heads 2
                                      --head-dim 8 --chunk 16 --warmup 0 --repeats 1)
      else size=(--device cuda --dtype bfloat16 --seq-len 4096 16384 --batch 1 --hidden 2048 --key-heads 16
                 --value-heads 32 --head-dim 128 --repeats 5); fi
      scan=never; [ "$step" = linear_attention_scan ] && scan=auto
      run_step "$step" 90 env MOEKIT_DELTA_SCAN=$scan "$PY" tools/bench/linear_attention.py "${size[@]}" \
        --out "$RAW/$step.json" ;;
    grouped_gemm_mixtral1b)
      if [ "$SMOKE" = 1 ]; then size=(--smoke)
      else size=(--shapes mixtral-1b --tokens 32768 --routings uniform --rounds 1); fi
      run_step grouped_gemm_mixtral1b 120 "$PY" tools/bench/grouped_gemm.py "${size[@]}" \
        --out "$RAW/grouped_gemm_mixtral1b.json" ;;
    batch_generate)  # many prompts: left-padded batches over one KV cache against one at a time and transformers
      if [ "$SMOKE" = 1 ]; then size=(--device cpu --presets mixtral-tiny --prompts 4 --prompt-len 2 8 --new-tokens 4
                                      --batch-sizes 2 --max-seq-len 32 --repeats 1)
      else size=(--device cuda --dtype bfloat16 --presets mixtral-1b --max-seq-len 1024 --prompts 64
                 --prompt-len 32 512 --new-tokens 64 --batch-sizes 16 64 --repeats 1); fi
      run_step batch_generate 150 "$PY" tools/bench/batch_generate.py "${size[@]}" --out "$RAW/batch_generate.json" ;;
    ac_compile)  # selective checkpointing of compiled blocks: kept compiled matmuls against recomputed ones
      if [ "$SMOKE" = 1 ]; then size=(--device cpu --layers 1 --batch-size 1 --seq-len 32 --warmup 0 --repeats 1)
      else size=(--device cuda --dtype bfloat16 --preset mixtral-1b --layers 4 --batch-size 2 --seq-len 4096
                 --warmup 1 --repeats 5); fi
      run_step ac_compile 240 "$PY" tools/bench/ac_memory.py --compile --modes none selective full "${size[@]}" \
        --json "$RAW/ac_compile.json" ;;
    lm_loss)  # the fused cross-entropy kernel against torch's passes and the plain logits
      if [ "$SMOKE" = 1 ]; then size=(--smoke)
      else size=(--device cuda --dtype bfloat16 --tokens 32768 --hidden 1024 4096 --vocab 32000 151936 --repeats 5); fi
      run_step lm_loss 90 "$PY" tools/bench/lm_loss.py "${size[@]}" --out "$RAW/lm_loss.json" ;;
    profile)
      if [ "$SMOKE" = 1 ]; then size=(--preset mixtral-tiny --batch-size 2 --seq-len 32 --warmup 1 --steps 1)
      else size=(--preset auto --batch-size 16 --seq-len 2048 --warmup 2 --steps 3); fi  # train_mfu's micro-batch
      run_step profile 150 "$PY" tools/bench/profile_step.py "${size[@]}" --out-dir "$RAW/profile" ;;
    tune)
      if [ "$SMOKE" = 1 ]; then size=(--smoke)
      else left=$((DEADLINE - $(date +%s) - 45)); size=(--budget $((left > 10 ? left : 10)))
        [ -f "$RAW/precompile.log" ] && size+=(--jobs 0)  # the cache is warm
        if [[ " ${STEPS[*]} " == *" grouped_gemm_tuned "* ]]; then  # leave grouped_gemm_tuned its time
          left=$((left - 100)); size=(--budget $((left > 10 ? left : 10)) "${size[@]:2}"); fi
      fi
      run_step tune 560 "$PY" tools/bench/tune_kernels.py "${size[@]}" --out "$RAW/tune_kernels.json" ;;
    grouped_gemm_quick)
      if [ "$SMOKE" = 1 ]; then size=(--smoke)
      # the shapes the last rounds' time cap left unmeasured first
      else size=(--shapes mixtral-8x7b,deepseek-v3-ep8,fine-grained,qwen3-30b-a3b --tokens 8192 --routings uniform
                 --rounds 1); fi
      run_step grouped_gemm_quick 120 "$PY" tools/bench/grouped_gemm.py "${size[@]}" --out "$RAW/grouped_gemm.json" ;;
    grouped_gemm_tuned)
      if ! "$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get("winners") else 1)' \
          "$RAW/tune_kernels.json" 2>/dev/null; then
        STATUS+=("grouped_gemm_tuned: skipped (no winners in $RAW/tune_kernels.json: run the tune step first)"); continue
      fi
      if [ "$SMOKE" = 1 ]; then size=(--smoke)
      else size=(--shapes fine-grained,qwen3-30b-a3b,deepseek-v3-ep8,mixtral-8x7b --tokens 8192 --routings uniform
                 --rounds 1); fi
      run_step grouped_gemm_tuned 160 env MOEKIT_KERNEL_CONFIGS="$RAW/tune_kernels.json" \
        "$PY" tools/bench/grouped_gemm.py "${size[@]}" --out "$RAW/grouped_gemm_tuned.json" ;;
    train_mfu|train_mfu_full|train_mfu_tma|train_mfu_ab|train_mfu_fused)
      if [ ! -f tools/bench/train_mfu.py ]; then STATUS+=("$step: skipped (tools/bench/train_mfu.py not present)"); continue; fi
      # its own per-configuration timeout ends inside the suite's, so it still writes its JSON
      mfu_limit=$((DEADLINE - $(date +%s) - 30))
      if [ "$SMOKE" = 1 ]; then flags=$(mfu_flags --smoke=); [ "$step" = train_mfu_tma ] && flags+=" $(mfu_flags "--tma=off on")"
        [ "$step" = train_mfu_ab ] && flags+=" $(mfu_flags "--variants=base legacy:MOEKIT_LM_LOSS=never,--train.residual_dtype=float32")"
        [ "$step" = train_mfu_fused ] && flags+=" $(mfu_flags "--variants=fused:MOEKIT_FUSED_PERMUTE=always")"
      elif [ "$step" = train_mfu ]; then flags=$(mfu_flags --compile=off --steps=15 --warmup=3 --timeout=$mfu_limit)
      elif [ "$step" = train_mfu_ab ]; then
        flags=$(mfu_flags --compile=on --steps=12 --warmup=2 --timeout=$((mfu_limit / 2)) \
                "--variants=base legacy:MOEKIT_LM_LOSS=never,MOEKIT_SPLIT_ROUTER=never,--train.residual_dtype=float32")
      elif [ "$step" = train_mfu_fused ]; then
        flags=$(mfu_flags --compile=on --steps=12 --warmup=2 --timeout=$mfu_limit "--variants=fused:MOEKIT_FUSED_PERMUTE=always")
      elif [ "$step" = train_mfu_tma ]; then
        flags=$(mfu_flags --compile=off "--tma=off on" --steps=12 --warmup=3 --timeout=$((mfu_limit / 2)))
      else flags=$(mfu_flags --timeout=$((mfu_limit / 2))); fi
      # shellcheck disable=SC2086  # flags are words built by mfu_flags
      out=train_mfu.json; [ "$step" = train_mfu_fused ] && out=train_mfu_fused.json
      run_step "$step" 560 "$PY" tools/bench/train_mfu.py $flags --out "$RAW/$out" ;;
  esac
done

"$PY" tools/bench/suite_summary.py "$RAW" >"$RAW/summary.txt" 2>&1
{ echo; echo "=== steps ($(($(date +%s) - START))s of a ${BUDGET}s budget)"; printf '  %s\n' "${STATUS[@]}"; } >>"$RAW/summary.txt"
cat "$RAW/summary.txt"
if [ "$PACK" = 1 ]; then
  pack
  cp "$RAW/summary.txt" "$RAW/summary.json" "$RESULTS/" 2>/dev/null
  echo "results: $RESULTS (suite.log, summary.txt, summary.json, results.tar.gz)"
else
  echo "results: $RAW"
fi
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null  # suite.log complete before the script returns
exit 0
