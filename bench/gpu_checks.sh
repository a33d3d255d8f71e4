#!/usr/bin/env bash
# Every check that needs a CUDA device, in one go (issue 5): the GPU tests, the GPU kernel
# benchmarks, the torch.topk baseline on the same problem, and the CNN and MLP trained through the
# PS on the GPU and on the CPU (same config, same machine) for the accuracy and time comparison.
#
#   bench/gpu_checks.sh [--build-dir B] [--out DIR] [--data DIR] [--steps LIST] [--reps R]
#                       [--train "CFG[:KEY=VALUE...] ..."] [--devices "cuda cpu"]
#                       [--skip-train] [--ncu]
#
# B: a build with CUDA (default build/); DIR: where the logs go (default runs/gpu-checks-<time>);
# --data: Fashion-MNIST (default /usr/share/datasets/fashion-mnist); --steps: which checks, comma
# separated, in this order: tests, memcheck, racecheck, synccheck, bench, torch, ncu, train (default
# tests,bench,torch,train; --skip-train drops train, --ncu adds ncu); --train: the runs, each a
# config in configs/ with optional --set's (default: every device compressor: cnn, quickstart
# (topk) with each selection mode, sbc (exact and sampled threshold), sketch, sketch_second_round,
# sketch_fetchsgd; and allreduce mode's device contribution: quickstart with topk_allgather,
# gtopk, gtopk + scaled threshold, exdyna, spardl); --devices: train.device of each run (default
# "cuda cpu": the GPU run and its CPU reference).
# Everything takes longer than the device tool's 10 minutes a call: split it with --steps and
# --devices, e.g. tests,memcheck / bench,torch,ncu / train --devices cuda / train --devices cpu.
# Writes, under DIR:
#   summary.txt        device, pass/fail of each step, the last lines of each log
#   gpu_tests.log      gpu_kernels_test, gpu_models_test, collectives_test's GPU test, worker_test's
#                      device tests, integration_test's GPU overlap and resume cases (gtest)
#   memcheck.log       the same tests under compute-sanitizer's memcheck (leaks too; not the
#                      overlap and resume cases, whose GPU work runs in the workers they start,
#                      nor the training run, GpuModels.TrainingReachesTheCpuAccuracy);
#                      racecheck.log and synccheck.log the same under racecheck and synccheck
#   gpu_bench.json/.log sparseps_gpu_bench (Google Benchmark, R repetitions, CUDA-event times)
#   torch_topk.log     bench/torch_topk_baseline.py (when python3 has torch with CUDA)
#   train.log          the training runs' final lines; train-runs.tar.gz their run directories
#   ncu.log            with --ncu: Nsight Compute's speed-of-light and memory sections for the
#                      kernels of BM_TopK, BM_ThresholdSelect and BM_CountSketchInsertDense
# Exit code: 0 when every test passed and every run finished (on both devices within a point of
# final test accuracy of each other), 1 otherwise.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="$here/build"
out=""
data="/usr/share/datasets/fashion-mnist"
steps="tests,bench,torch,train"
devices="cuda cpu"
reps=5
ar="quickstart:aggregation=allreduce:collective.algorithm"
train_runs="cnn quickstart quickstart:compression.selection=sampled_threshold"
train_runs+=" quickstart:compression.selection=scaled_threshold"
train_runs+=" sbc sbc:compression.selection=sampled_threshold"
train_runs+=" sketch sketch_second_round sketch_fetchsgd"
train_runs+=" $ar=topk_allgather $ar=gtopk $ar=gtopk:compression.selection=scaled_threshold"
train_runs+=" $ar=exdyna $ar=spardl"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build_dir="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --data) data="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --skip-train) steps="${steps//train/}"; shift ;;
    --reps) reps="$2"; shift 2 ;;
    --ncu) steps+=",ncu"; shift ;;
    --train) train_runs="$2"; shift 2 ;;
    --devices) devices="$2"; shift 2 ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) echo "gpu_checks.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for s in ${steps//,/ }; do
  case "$s" in
    tests|memcheck|racecheck|synccheck|bench|torch|ncu|train) ;;
    *) echo "gpu_checks.sh: unknown step '$s' in --steps (tests, memcheck, racecheck, synccheck, bench, torch, ncu, train)" >&2
       exit 2 ;;
  esac
done
for d in $devices; do
  [[ "$d" == cuda || "$d" == cpu ]] ||
    { echo "gpu_checks.sh: unknown device '$d' in --devices (cuda, cpu)" >&2; exit 2; }
done
want() { [[ ",$steps," == *",$1,"* ]]; }
[[ -n "$out" ]] || out="$here/runs/gpu-checks-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
failed=0
note() { echo "$*" | tee -a "$summary"; }
step() {  # step NAME LOG CMD...: runs CMD with its output in LOG (appended), notes the result
  local name="$1" log="$2"; shift 2
  local t0=$SECONDS
  "$@" >>"$log" 2>&1
  local rc=$?
  if [[ $rc -eq 0 ]]; then note "PASS $name ($((SECONDS - t0)) s)"; else
    note "FAIL $name (exit $rc, $((SECONDS - t0)) s; see $(basename "$log"))"; failed=1; fi
  return $rc
}

note "== $(date -u +%FT%TZ) $(uname -n)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
  --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$summary"

# The GPU tests: NAME BINARY GTEST_FILTER.
gpu_tests=("gpu_kernels_test tests/gpu_kernels_test *"
  "gpu_models_test tests/gpu_models_test *"
  "gpu_allreduce_test tests/collectives_test GpuContribution.*"
  "gpu_device_test tests/worker_test Device.*:DeviceCopies.*:ScopedCudaDevice.*"
  "gpu_overlap_test tests/integration_test *OverlapTest*cuda*"
  "gpu_resume_test tests/integration_test *ResumeTest*cuda*")
# integration_test starts the daemons of the build it was given (not the one it was built in).
export SPARSEPS_TEST_BINARY_DIR="$build_dir"
if want tests; then
  for t in "${gpu_tests[@]}"; do
    read -r name bin filter <<<"$t"
    step "$name" "$out/gpu_tests.log" timeout 300 env SPARSEPS_FASHION_MNIST_DIR="$data" \
      "$build_dir/$bin" --gtest_filter="$filter"
  done
  grep -E "^\[  (SKIPPED|FAILED) \]|Failure|Skipped" "$out/gpu_tests.log" | head -20 | tee -a "$summary"
  # The tests skip without a device; here that is a failure, not a pass.
  skipped=$(grep -o "^\[  SKIPPED \] [A-Za-z][A-Za-z0-9_./]*" "$out/gpu_tests.log" | sort -u | wc -l)
  if [[ $skipped -gt 0 ]]; then
    note "FAIL $skipped GPU tests skipped (no CUDA device?)"
    failed=1
  fi
fi

# compute-sanitizer: memcheck (out-of-bounds and misaligned accesses, device memory still
# allocated at exit), racecheck (shared-memory hazards), synccheck (barriers not every thread
# reaches). A skipped test would pass unseen: the GPU must be there (the tests step says so).
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck synccheck; do
  want $tool || continue
  flags=(--tool "$tool" --error-exitcode 1)
  [[ $tool == memcheck ]] && flags+=(--leak-check full)
  for t in "${gpu_tests[@]}"; do
    read -r name bin filter <<<"$t"
    # The overlap and resume tests' GPU work runs in the workers they start, which the sanitizer
    # does not see.
    [[ $name == gpu_overlap_test || $name == gpu_resume_test ]] && continue
    [[ "$filter" == "*" ]] && filter="*-GpuModels.TrainingReachesTheCpuAccuracy"
    step "$tool $name" "$out/$tool.log" timeout 500 env SPARSEPS_FASHION_MNIST_DIR="$data" \
      "$sanitizer" "${flags[@]}" "$build_dir/$bin" --gtest_filter="$filter"
  done
  grep -E "ERROR SUMMARY|LEAK SUMMARY|RACECHECK SUMMARY|not supported|^\[  (SKIPPED|FAILED) \]" \
    "$out/$tool.log" | head -20 | tee -a "$summary"
done

if want bench; then
  step sparseps_gpu_bench "$out/gpu_bench.log" timeout 300 "$build_dir/bench/sparseps_gpu_bench" \
    --benchmark_repetitions="$reps" --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/gpu_bench.json" --benchmark_out_format=json
  grep -E "_median|_mean" "$out/gpu_bench.log" | tee -a "$summary"
fi
if want torch; then
  # Without the caller's LD_LIBRARY_PATH: PyTorch brings its own libraries.
  step torch_topk_baseline "$out/torch_topk.log" timeout 300 env -u LD_LIBRARY_PATH python3 \
    "$here/bench/torch_topk_baseline.py"
  tee -a "$summary" <"$out/torch_topk.log"
fi

if want ncu; then
  for b in TopK ThresholdSelect CountSketchInsertDense; do
    before=$(grep -c "Section: GPU Speed Of Light" "$out/ncu.log" 2>/dev/null)
    # --clock-control none: profile at the clocks the benchmarks ran at.
    step "ncu BM_$b" "$out/ncu.log" timeout 300 ncu --clock-control none --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --launch-skip 40 --launch-count 12 \
      "$build_dir/bench/sparseps_gpu_bench" --benchmark_filter="^BM_$b/" \
      --benchmark_min_time=0.05
    # ncu exits 0 when the filter matched nothing: a profile without kernels is a failure.
    if [[ $(grep -c "Section: GPU Speed Of Light" "$out/ncu.log") -eq ${before:-0} ]]; then
      note "FAIL ncu BM_$b: no kernel profiled"
      failed=1
    fi
  done
fi

if want train; then
  runs="$out/train-runs"
  mkdir -p "$runs"
  for spec in $train_runs; do
    IFS=: read -r -a parts <<<"$spec"
    cfg="${parts[0]}"
    extra=()
    name="$cfg"
    for kv in "${parts[@]:1}"; do
      extra+=(--set "$kv")
      name+="-${kv##*=}"
    done
    declare -A acc=()
    for dev in $devices; do
      step "train $spec on $dev" "$out/train.log" timeout 300 "$here/deploy/launch.sh" \
        --config "$here/configs/$cfg.yaml" --build-dir "$build_dir" --quiet \
        --set "train.device=$dev" --set "data.dir=$data" "${extra[@]}" \
        --run-dir "$runs/$name-$dev"
      grep -h -m2 -i -E "device|compression on|contribution on" "$runs/$name-$dev/worker-0.log" | tee -a "$summary"
      tail -n 2 "$out/train.log" | tee -a "$summary"
      acc[$dev]=$(tail -n 2 "$out/train.log" | sed -n 's/.*final test accuracy \([0-9.]*\)%.*/\1/p')
    done
    # The same job on both devices ends within a point (float rounding differs, not the method).
    if [[ -n "${acc[cuda]:-}" && -n "${acc[cpu]:-}" ]]; then
      if awk -v a="${acc[cuda]}" -v b="${acc[cpu]}" 'BEGIN { d = a - b; exit !(d > 1 || d < -1) }'; then
        note "FAIL train $spec: cuda ${acc[cuda]}% against cpu ${acc[cpu]}% (more than a point apart)"
        failed=1
      else
        note "same accuracy $spec: cuda ${acc[cuda]}%, cpu ${acc[cpu]}%"
      fi
    fi
  done
  tar -czf "$out/train-runs.tar.gz" -C "$out" train-runs && rm -rf "$runs"
fi
note "== done: $([[ $failed -eq 0 ]] && echo all passed || echo FAILURES)"
exit $failed
