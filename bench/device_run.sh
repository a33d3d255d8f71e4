#!/usr/bin/env bash
# What a lent GPU machine (the workplace's device tool: one GPU, 16 cores, no network, none of the
# build's dependencies) checks in one call: unpacks bench/gpu_bundle.sh's bundle, then runs the
# phases asked for, in the order asked, each bounded by what is left of BUDGET seconds (a phase
# is skipped under 20 s left), and packs each phase's files into OUT as it ends (so a call cut
# short still brings back what finished):
#   tests    the GPU tests (bench/gpu_checks.sh --steps tests)
#   train    every device compressor's config trained on the GPU (gpu_checks.sh --steps train)
#   retrain  sketch_second_round and sbc on both devices (within a point of each other), then
#            sketch_fetchsgd and allreduce mode's device contribution on the GPU
#   delay    train.overlap: delay on the GPU: cnn with and without it, quickstart on both devices
#   bench    sparseps_gpu_bench's selections and sketch insertions, 3 repetitions
#   goal4    configs/compare_short_1gbit.yaml (issue 21's goals 1, 3 and 4 on cores of their own)
#   goal5    configs/compare_scaling_short_1gbit.yaml at W = 2 and 8 (goal 5)
#   pytorch  tests/python/test_gpu.py under the machine's own python3 and PyTorch (sparseps.capi
#            over the bundle's client library, and the pybind11 module built there by
#            python/build_module.sh): the example on the GPU against the CPU, DDP's
#            sparse_allreduce_hook on CUDA tensors (with fp16 autocast and torch's GradScaler), the
#            example under --amp fp16, overlap through both layers
#   step     the GPU step split (bench/gpu_step.py): cnn and the 5.8M MLP (the C++ worker,
#            train.device=cuda) and resnet18 (the example, --device cuda), each with PS top-k 1%
#            and SparDL, 2 workers on loopback, next to PyTorch's own step of each model
#   gpucompare configs/compare_torch_gpu_1gbit.yaml: ResNet-18 on 4 GPU workers at 1 Gbit/s,
#            torch DDP (Gloo, fp16, PowerSGD hooks) against sparseps (issue 41, point 5)
#            (GPU_ONLY: its settings; default all but the _seed ones)
#   gpuseeds the same comparison's seeds 43 and 44 (DDP, DDP fp16, PS top-k and its compact
#            setting), into the same folder (with gpucompare in the same call: one table)
#   gpucompare10 the same at 10 Gbit/s (sparseps-compare --rate 10gbit)
#   gpulm    configs/compare_lm_gpu_1gbit.yaml: the language model on 4 GPU workers at 1 Gbit/s
#   mlpcores configs/compare_torch_mlp_cores_1gbit.yaml: issue 44's 1 Gbit/s MLP goal rows with
#            CPU workers on cores of their own (MLPCORES_ONLY; default seed 42's four rows)
#   scaling46 issue 46 on the 16 cores: configs/compare_advise.yaml's calibration on loopback and
#            its settings (ADVISE_ONLY) at W = ADVISE_WORKERS (2 4 8) and ADVISE_RATE (1gbit)
#   sanitize the GPU tests, then under compute-sanitizer's memcheck, racecheck and synccheck
#            (SANITIZERS: which of the three)
# RESUME=1: the comparison phases go on with the runs already in their /tmp/cN (c4 to c10)
# (sparseps-compare --resume: finished settings kept, the others run).
# STEP_MODELS (cnn,mlp,resnet18), STEP_METHODS (ps_topk,spardl) and STEP_WORKERS (2) narrow the
# step phase; with one worker the GPU is no worker's to share.
#
#   PHASES=tests,train,bench BUDGET=340 OUT=DIR bench/device_run.sh      # from the repository root
#
# Needs .devrun/bundle.tar.xz and .devrun/data (bench/gpu_bundle.sh). The network phases need
# root (ip netns); where the machine lacks ip or tc, NET_TOOLS (default: the bundle's net/, which
# bench/gpu_bundle.sh copies from the Debian machine) holds bin/ip, bin/tc and their libraries.
set -u
T0=$SECONDS
BUDGET=${BUDGET:-560}
PHASES=${PHASES:-tests,train,bench}
R=$PWD
OUT=${OUT:-$R/runs/device-$(date +%Y%m%d-%H%M%S)}
NET_TOOLS=${NET_TOOLS:-$R/.devrun/x/net}
mkdir -p "$OUT"
want() { [[ ",$PHASES," == *",$1,"* ]]; }
left() { echo $((BUDGET - (SECONDS - T0))); }
# At most $1 seconds, and no more than the budget's rest (at least 1: `timeout 0` never ends).
cap() { local l; l=$(left); [[ $l -lt 1 ]] && l=1; [[ $l -lt $1 ]] && echo "$l" || echo "$1"; }
pack() {
  for d in "$@"; do
    [[ -d /tmp/$d ]] && tar --exclude='*.safetensors' --exclude='*.ckpt' -czf "$OUT/$d.tar.gz" -C /tmp "$d"
  done
}
exec > >(tee "$OUT/console.log") 2>&1
echo "== setup at $(date -u +%T); phases $PHASES"
mkdir -p .devrun/x && tar -xJf .devrun/bundle.tar.xz -C .devrun/x || exit 1
export LD_LIBRARY_PATH=$R/.devrun/x/lib:/usr/local/cuda/lib64:$R/.devrun/x/lib-cuda
B=$R/.devrun/x/build
D=$R/.devrun/data
# The comparison job reads Fashion-MNIST where Debian's package puts it.
mkdir -p /usr/share/datasets/fashion-mnist && cp "$D"/*.gz /usr/share/datasets/fashion-mnist/
# The language model's, where Debian's fortunes package puts them.
if [[ -d $D/fortunes ]]; then
  mkdir -p /usr/share/games/fortunes && cp "$D"/fortunes/* /usr/share/games/fortunes/
fi
nproc
nvidia-smi -L
grep PRETTY /etc/os-release
uname -r
for t in ip tc; do
  if ! command -v $t >/dev/null && [[ -x "$NET_TOOLS/bin/$t" ]]; then
    mkdir -p /tmp/wrap
    # Prepends, so that what `ip netns exec` starts keeps the bundle's libraries.
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s:$LD_LIBRARY_PATH exec %s "$@"\n' "$NET_TOOLS/lib" \
      "$NET_TOOLS/bin/$t" >/tmp/wrap/$t
    chmod +x /tmp/wrap/$t
    echo "carried $t"
  fi
done
export PATH=$PATH:/tmp/wrap
net=0
if bash deploy/netns.sh check && bash deploy/netns.sh up --prefix probe --hosts 2 --rate 1gbit; then
  bash deploy/netns.sh exec --prefix probe 1 ip -br addr && net=1
fi
bash deploy/netns.sh down --prefix probe
echo "netns works: $net"

# The Python phases: the machine's own python3 and PyTorch, sparseps.capi over the bundle's
# client library (the CMake build's pybind11 module is Debian's Python's; the pytorch phase builds
# one for this Python).
export PYTHONPATH=$R/python SPARSEPS_BUILD_DIR=$B SPARSEPS_CLIENT_LIBRARY=$B/client/libsparseps_client.so
export PYTHONUNBUFFERED=1
phase_pytorch() {
  echo "== pytorch at $(date -u +%T), $(left) s left"
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  mkdir -p /tmp/p1
  # The pybind11 module for this machine's python3 (python/build_module.sh over the bundle's
  # client library): test_gpu.py's module cases run with it, and skip where it cannot be built.
  local path=$R/python
  python/build_module.sh --client-lib "$B/client" --out /tmp/pymod --dlpack "$R/.devrun/x/include" \
    > /tmp/p1/build_module.log 2>&1
  local built=$?
  cat /tmp/p1/build_module.log
  [[ $built -eq 0 ]] && path=/tmp/pymod
  PYTHONPATH=$path timeout "$(cap 260)" python3 -m pytest -v -s -p no:cacheprovider tests/python/test_gpu.py \
    2>&1 | tee /tmp/p1/test_gpu.log | grep -E "PASS|FAIL|SKIP|ERROR|accuracy|passed|failed|Error"
  pack p1
}
phase_step() {
  echo "== step at $(date -u +%T), $(left) s left"
  STEP_METHODS=${STEP_METHODS:-ps_topk,spardl}
  mkdir -p /tmp/s1
  for run in cnn:configs/cnn.yaml mlp:configs/compare_job.yaml resnet18:examples/torch_cnn.yaml; do
    model=${run%%:*}
    cfg=${run#*:}
    [[ ",${STEP_MODELS:-cnn,mlp,resnet18}," == *",$model,"* ]] || continue
    for method in ${STEP_METHODS//,/ }; do
      sets=(--set train.device=cuda --set train.max_steps=150
        --set "cluster.num_workers=${STEP_WORKERS:-2}"
        --set "data.dir=$D" --set data.max_test_samples=1000 --set train.eval_every_steps=0)
      [[ $method == spardl ]] && sets+=(--set aggregation=allreduce --set collective.algorithm=spardl)
      worker=()
      [[ $model == resnet18 ]] && worker=(--worker-command
        "python3 $R/examples/fashion_mnist.py --capi --model resnet18 --device cuda --profile-memcpy 20")
      timeout "$(cap 60)" bash deploy/launch.sh --config "$cfg" --build-dir "$B" --quiet \
        "${sets[@]}" "${worker[@]}" --run-dir "/tmp/s1/$model-$method" 2>&1 | tail -n 2
    done
  done
  timeout "$(cap 60)" python3 bench/gpu_step.py --runs /tmp/s1/*-* --out /tmp/s1/gpu_step.json \
    2>&1 | tee /tmp/s1/table.md
  pack s1
}
phase_sanitize() {
  echo "== sanitize at $(date -u +%T), $(left) s left"
  timeout "$(cap 90)" bash bench/gpu_checks.sh --build-dir "$B" --data "$D" --out /tmp/z1 --steps tests
  for tool in ${SANITIZERS:-memcheck racecheck synccheck}; do
    echo "-- $tool at $(date -u +%T), $(left) s left"
    timeout "$(cap 200)" bash bench/gpu_checks.sh --build-dir "$B" --data "$D" --out /tmp/z1/$tool \
      --steps $tool
  done
  pack z1
}
phase_tests() {
  echo "== tests at $(date -u +%T), $(left) s left"
  timeout "$(cap 170)" bash bench/gpu_checks.sh --build-dir "$B" --data "$D" --out /tmp/g1 --steps tests
  pack g1
}
phase_train() {
  echo "== train at $(date -u +%T), $(left) s left"
  timeout "$(cap 200)" bash bench/gpu_checks.sh --build-dir "$B" --data "$D" --out /tmp/g2 --steps train \
    --devices cuda
  pack g2
}
phase_retrain() {
  echo "== retrain at $(date -u +%T), $(left) s left"
  ar="quickstart:aggregation=allreduce:collective.algorithm"
  timeout "$(cap 130)" bash bench/gpu_checks.sh --build-dir "$B" --data "$D" --out /tmp/g4 --steps train \
    --train "sketch_second_round sbc" --devices "cuda cpu"
  pack g4
  timeout "$(cap 90)" bash bench/gpu_checks.sh --build-dir "$B" --data "$D" --out /tmp/g5 --steps train \
    --train "sketch_fetchsgd $ar=topk_allgather $ar=gtopk $ar=gtopk:compression.selection=scaled_threshold $ar=exdyna $ar=spardl" \
    --devices cuda
  pack g5
}
phase_delay() {
  # train.overlap: delay with a GPU model: the CNN with and without it on the GPU, the quickstart
  # MLP with it on both devices (within a point of each other).
  timeout "$(cap 90)" bash bench/gpu_checks.sh --build-dir "$B" --data "$D" --out /tmp/g6 --steps train \
    --train "cnn cnn:train.overlap=delay" --devices cuda
  timeout "$(cap 60)" bash bench/gpu_checks.sh --build-dir "$B" --data "$D" --out /tmp/g7 --steps train \
    --train "quickstart:train.overlap=delay" --devices "cuda cpu"
  pack g6 g7
}
phase_bench() {
  echo "== bench at $(date -u +%T), $(left) s left"
  mkdir -p /tmp/g3
  timeout "$(cap 70)" "$B/bench/sparseps_gpu_bench" --benchmark_repetitions=3 \
    --benchmark_report_aggregates_only=true \
    --benchmark_filter='BM_OneRead|BM_TopK|BM_ThresholdSelect|BM_SampledThresholdSelect|BM_CountSketchInsert' \
    --benchmark_out=/tmp/g3/gpu_bench.json --benchmark_out_format=json 2>&1 |
    tee /tmp/g3/gpu_bench.log | grep -E "median"
  pack g3
}
# One comparison phase: compare NAME DIR CAP_S ARGS... runs bench/sparseps-compare ARGS into
# /tmp/DIR for at most CAP_S seconds (and the budget's rest) and packs it; skipped without netns.
compare() {
  local name=$1 dir=$2 cap_s=$3
  shift 3
  [[ $net -eq 1 ]] || { echo "== $name skipped: no network namespaces here"; return; }
  echo "== $name at $(date -u +%T), $(left) s left"
  timeout "$(cap "$cap_s")" python3 bench/sparseps-compare "$@" --out "/tmp/$dir" --build-dir "$B" \
    ${RESUME:+--resume}
  pack "$dir"
}
phase_goal4() { compare "goal 4" c4 150 --config configs/compare_short_1gbit.yaml; }
phase_goal5() {
  compare "goal 5" c5 400 --config configs/compare_scaling_short_1gbit.yaml \
    --only "${SCALING:-ps_topk_w2,ps_topk_w8,ps_topk_stk_w2,ps_topk_stk_w8,gtopk_w2,gtopk_w8,spardl_w2,spardl_w8,exdyna_w2,exdyna_w8,gloo_w2,gloo_w8}"
}
GPU_ONLY=${GPU_ONLY:-torch_ddp_gloo,torch_ddp_fp16,torch_ddp_powersgd,torch_powersgd,torch_ps_topk,torch_ps_topk_overlap,torch_ps_topk_compact}
phase_gpucompare() {
  compare gpucompare c6 480 --config configs/compare_torch_gpu_1gbit.yaml --only "$GPU_ONLY"
}
phase_gpuseeds() {
  local seeds=()
  for s in 43 44; do
    for n in torch_ddp_gloo torch_ddp_fp16 torch_ps_topk torch_ps_topk_compact; do seeds+=("${n}_seed$s"); done
  done
  compare gpuseeds c6 560 --config configs/compare_torch_gpu_1gbit.yaml --resume \
    --only "$(IFS=,; echo "${seeds[*]}")"
}
phase_gpucompare10() {
  compare gpucompare10 c7 480 --config configs/compare_torch_gpu_1gbit.yaml --rate 10gbit \
    --only "$GPU_ONLY"
}
phase_gpulm() { compare gpulm c8 480 --config configs/compare_lm_gpu_1gbit.yaml; }
phase_mlpcores() {
  compare mlpcores c10 400 --config configs/compare_torch_mlp_cores_1gbit.yaml \
    --only "${MLPCORES_ONLY:-torch_ddp_gloo,torch_ddp_fp16,torch_powersgd,torch_ps_topk_server_topk_compact}"
}
phase_scaling46() {
  # Issue 46: the simulator against runs on 16 cores. sparseps-advise's calibration (the
  # comparison on loopback, W = 4) and the same settings measured at W = ADVISE_WORKERS on
  # emulated hosts at ADVISE_RATE; the simulation and bench/advise_scaling_check.py run on the
  # Debian machine afterwards (python3-simgrid), from what comes back.
  [[ $net -eq 1 ]] || { echo "== $FUNCNAME skipped: no network namespaces here"; return; }
  echo "== scaling46 at $(date -u +%T), $(left) s left"
  local only=${ADVISE_ONLY:-gloo,ps_topk,ps_topk_server_topk,topk_allgather,gtopk,spardl,exdyna}
  mkdir -p /tmp/c9
  timeout "$(cap 150)" python3 bench/sparseps-compare --config configs/compare_advise.yaml \
    --no-netns --only "$only" --out /tmp/c9/calibration --build-dir "$B" ${RESUME:+--resume}
  for w in ${ADVISE_WORKERS:-2 4 8}; do
    timeout "$(cap 200)" python3 bench/sparseps-compare --config configs/compare_advise.yaml \
      --only "$only" --workers "$w" --rate "${ADVISE_RATE:-1gbit}" --out "/tmp/c9/w$w" \
      --build-dir "$B" ${RESUME:+--resume}
  done
  pack c9
}
for phase in ${PHASES//,/ }; do
  if ! declare -F "phase_$phase" >/dev/null; then
    echo "== unknown phase '$phase' (see the list at the top of bench/device_run.sh)"
  elif [[ $(left) -lt 20 ]]; then
    echo "== $phase skipped: $(left) s of the budget left"
  else
    "phase_$phase"
  fi
done
bash deploy/netns.sh down --prefix spsc >/dev/null 2>&1
echo "== end at $(date -u +%T), $(left) s left"
