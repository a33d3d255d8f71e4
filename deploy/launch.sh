#!/usr/bin/env bash
# Runs a whole local cluster for one config: 1 scheduler, S servers, W workers (S and W from the
# config), each a process of its own with its log in the run directory. Streams the leading
# worker's progress lines, stops every process it started on exit or Ctrl-C, fails fast (showing the
# failing process's log) if one dies, and prints the run directory at the end: --run-dir, else
# the config's (or a --set) run.dir, else a new runs/<run.name>-<date>-<pid>.
#
#   deploy/launch.sh [--config F] [--set key=value ...] [--run-dir D] [--build-dir B] [--quiet]
#                    [--netns PREFIX [--servers-per-host K]] [--worker-command "CMD ARGS"]
#                    [--resume RUN_DIR] [--max-restarts N]
#   deploy/launch.sh --hosts FILE [--ssh "ssh OPTIONS"] [--remote-dir D] [--remote-bin-dir D]
#                    [-x NAME[=VALUE] ...] [--config F] [--set key=value ...] [--run-dir D]
#
# --hosts FILE starts each process on a host of its own over OpenSSH. One line per host: how ssh
# reaches it ([user@]host[:port]), then its roles, each `scheduler`, `server` or `worker`, with an
# optional count (`worker:2`), and optionally `addr=A`, the address the other hosts reach it at
# (default: the host name resolved here); '#' starts a comment:
#     10.0.0.1   scheduler server
#     10.0.0.2   server worker
#     alice@gpu3:2222   worker:2   addr=192.168.1.3
# Ranks follow the order of the file; the counts must be the config's (1 scheduler, S servers,
# W workers; no servers with allreduce). Every host needs the daemons (at the paths of this build,
# or in --remote-bin-dir, e.g. /usr/bin for the Debian package) and the data at the config's path;
# the config goes to each host with the job. Each process runs in --remote-dir (default
# /tmp/sparseps-runs/<run directory name>) with its log streamed live into the local run
# directory; worker 0's progress is printed here; a process that fails, or Ctrl-C, stops every
# process on every host (a host that loses its ssh connection stops its own processes); at the
# end every host's files (logs, metrics CSVs, summary.json, the model) are copied into the local
# run directory. ssh runs with BatchMode (keys or an agent, never a password prompt) and
# keep-alives (a host that does not answer for 30 s fails the job); --ssh gives the command and
# its options (default: $SPARSEPS_SSH, else ssh), e.g. --ssh "ssh -F cluster/ssh_config".
# -x NAME=VALUE (or -x NAME, this shell's value) sets a variable for every remote process, as
# mpirun -x does. The remote login shell must be a POSIX sh. deploy/ssh/local-ssh.sh starts
# emulated hosts with an sshd each to try it on one machine.
#
# --max-restarts N supervises the job as torchrun's elastic agent does, at most N restarts in all,
# each printed and logged to RUN_DIR/restarts.log: a worker killed by a signal in ps mode with
# cluster.on_worker_failure: continue (the default) is started again with --rejoin (the others go
# on meanwhile; the replacement gets the current parameters and joins at the next iteration);
# a server killed by a signal in ps mode is started again with --rejoin: it takes the dead one's key
# range and every node goes back to the newest complete checkpoint (with checkpoint.every_steps
# set, that costs at most that many steps); when any other process dies, or the job cannot roll
# back, every process is stopped and the whole job restarts from its newest complete checkpoint
# (from the start when there is none yet). Once the scheduler has exited 0 the job has ended and
# nothing is restarted: a process that exits with code 3 then (the scheduler's SHUTDOWN did not
# reach it) is reported, any other code fails the launch.
#
# --resume RUN_DIR restarts a stopped or crashed job from the newest complete checkpoint in
# RUN_DIR/checkpoints (checkpoint.every_steps or every_s must have been set): same config and
# overrides as that run (RUN_DIR/config.yaml, overrides.txt; more --set may follow, e.g. a larger
# train.epochs), and the run goes on writing into RUN_DIR (logs appended, CSV rows after the
# checkpoint replaced). With --hosts (the same hosts file) each host first gets back from RUN_DIR
# its processes' logs and CSVs and the newest complete checkpoint's manifest and files of its
# processes (not with checkpoint.dir set: those stay on the hosts). --max-restarts goes with
# --hosts too: a replacement starts on the host of the process it replaces, and a whole-job
# restart takes the way of --resume. --netns does not go with --hosts.
#
# --worker-command starts each worker as CMD ARGS --config F --set ... instead of sparseps-worker:
# a Python training loop that joins the job through the sparseps module (examples/fashion_mnist.py;
# <build>/python is put on PYTHONPATH), for instance
#   deploy/launch.sh --config examples/torch_cnn.yaml \
#     --worker-command "python3 examples/fashion_mnist.py --model cnn"
# Each worker gets SPARSEPS_LOCAL_RANK, its rank among the workers on its host (with --hosts; else
# its rank): on a host with several GPUs, sparseps-worker (train.cuda_device -1) and
# sparseps.local_rank() take GPU SPARSEPS_LOCAL_RANK modulo their number.
#
# --netns PREFIX places each process on an emulated host made by `deploy/netns.sh up --prefix
# PREFIX` (needs S + W hosts): server s on host 1+s, worker w on host S+1+w, the scheduler on
# host 1; every process binds and advertises its host's address. --servers-per-host K puts the S
# servers on H = ceil(S / K) hosts in turn (server s on host 1 + s mod H, so that consecutive key
# ranges are on different hosts; workers from host H+1): BytePS's partitions, with
# cluster.push_window.
#
# A worker killed by a signal (kill -9, a crash) in ps mode with cluster.on_worker_failure: continue
# (the default) does not end the job: the scheduler drops it and the others go on (with
# --max-restarts, a replacement joins as above). So does a worker whose host was cut off for longer
# than cluster.heartbeat_timeout_s (it exits with code 3, naming the scheduler it lost), or that
# was stopped that long (SIGSTOP, a suspended VM: the scheduler removed it, and it exits with
# code 3 once it runs again); with --max-restarts a server that exits so is replaced as one
# killed. A worker that exits with an
# error (bad data, a diverging loss) ends the job as before.
#
# Exit code: 0 when the job finished, 2 for a bad config, 1 when a process failed.
set -uo pipefail

# (Through a link too: the package's /usr/bin/sparseps-launch.)
here="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
config="$here/configs/quickstart.yaml"
build_dir="${SPARSEPS_BUILD_DIR:-$here/build}"
run_dir=""
quiet=0
netns=""
servers_per_host=1
worker_command=""
resume=""
config_given=""
max_restarts=0
hosts_file=""
ssh_cmd="${SPARSEPS_SSH:-ssh}"
remote_dir=""
remote_bin_dir=""
remote_env=()
sets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="$2"; config_given=1; shift 2 ;;
    --config=*) config="${1#*=}"; config_given=1; shift ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    --set=*) sets+=(--set "${1#*=}"); shift ;;
    --run-dir) run_dir="$2"; shift 2 ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    --quiet) quiet=1; shift ;;
    --netns) netns="$2"; shift 2 ;;
    --servers-per-host) servers_per_host="$2"; shift 2 ;;
    --worker-command) worker_command="$2"; shift 2 ;;
    --resume) resume="$2"; shift 2 ;;
    --max-restarts) max_restarts="$2"; shift 2 ;;
    --hosts) hosts_file="$2"; shift 2 ;;
    --ssh) ssh_cmd="$2"; shift 2 ;;
    --remote-dir) remote_dir="$2"; shift 2 ;;
    --remote-bin-dir) remote_bin_dir="$2"; shift 2 ;;
    -x|--env)
      if [[ "$2" == *=* ]]; then remote_env+=("$2")
      elif [[ -v "$2" ]]; then remote_env+=("$2=${!2}")
      else echo "launch.sh: -x $2: not set here (give -x $2=VALUE)" >&2; exit 2; fi
      shift 2 ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) echo "launch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if [[ -n "$resume" ]]; then
  [[ -d "$resume" ]] || { echo "launch.sh: --resume $resume: no such run directory" >&2; exit 2; }
  run_dir="$resume"
  [[ -z "$config_given" ]] && config="$resume/config.yaml"
  if [[ -s "$resume/overrides.txt" ]]; then
    read -r -a saved_sets <"$resume/overrides.txt"
    sets=("${saved_sets[@]}" "${sets[@]}")
  fi
fi

# The daemons: SPARSEPS_BIN_DIR, else this build tree, else PATH (an installed package).
daemon_path() {  # daemon_path scheduler|server|worker
  if [[ -n "${SPARSEPS_BIN_DIR:-}" ]]; then echo "$SPARSEPS_BIN_DIR/sparseps-$1"
  elif [[ ! -x "$build_dir/$1/sparseps-$1" ]] && command -v "sparseps-$1" >/dev/null; then
    command -v "sparseps-$1"
  else echo "$build_dir/$1/sparseps-$1"; fi
}
scheduler_bin="$(daemon_path scheduler)"
server_bin="$(daemon_path server)"
worker_bin="$(daemon_path worker)"
for b in "$scheduler_bin" "$server_bin" "$worker_bin"; do
  [[ -x "$b" ]] || { echo "launch.sh: $b not found; build first (deploy/quickstart.sh does)" >&2; exit 1; }
done
[[ -f "$config" ]] || { echo "launch.sh: config $config not found" >&2; exit 2; }

# Read the resolved settings through the daemons' own strict loader (bad configs fail here).
if ! resolved="$("$worker_bin" --config "$config" "${sets[@]}" \
      --get cluster.num_servers --get cluster.num_workers --get run.name \
      --get aggregation --get checkpoint.dir --get cluster.on_worker_failure \
      --get checkpoint.keep --get cluster.heartbeat_interval_s --get run.dir 2>&1)"; then
  echo "$resolved" >&2
  exit 2
fi
{ read -r num_servers; read -r num_workers; read -r job_name; read -r aggregation; read -r checkpoint_dir; read -r on_worker_failure; read -r checkpoint_keep; read -r heartbeat_interval; read -r config_run_dir || :; } <<<"$resolved"
[[ "$max_restarts" =~ ^[0-9]+$ ]] || { echo "launch.sh: --max-restarts needs a number" >&2; exit 2; }
# With allreduce the workers aggregate among themselves: no servers.
[[ "$aggregation" == "allreduce" ]] && num_servers=0
[[ "$servers_per_host" =~ ^[1-9][0-9]*$ ]] ||
  { echo "launch.sh: --servers-per-host must be a positive integer, not '$servers_per_host'" >&2; exit 2; }
[[ "$servers_per_host" == 1 || -n "$netns" ]] ||
  { echo "launch.sh: --servers-per-host goes with --netns (with --hosts, list a host's servers as server:K)" >&2; exit 2; }
# The emulated hosts that hold servers (--netns).
server_hosts=$(((num_servers + servers_per_host - 1) / servers_per_host))

if [[ -n "$hosts_file" ]]; then
  [[ -z "$netns" ]] || { echo "launch.sh: --hosts does not go with --netns" >&2; exit 2; }
  # shellcheck source=deploy/lib/remote.sh
  source "$here/deploy/lib/remote.sh"
  parse_hosts "$hosts_file" || exit 2
fi

# The run directory: --run-dir, else the config's or a --set run.dir, else a new one under runs/.
# Every process gets it as run.dir (after the --set arguments: the directory whose
# scheduler.port this script reads is the one the scheduler writes).
if [[ -n "$run_dir" && -n "$config_run_dir" && -z "$resume" &&
      "$(realpath -m "$run_dir")" != "$(realpath -m "$config_run_dir")" ]]; then
  echo "launch.sh: --run-dir $run_dir takes the place of run.dir = $config_run_dir" >&2
fi
[[ -z "$run_dir" ]] && run_dir="$config_run_dir"
if [[ -z "$run_dir" ]]; then
  runs="$here/runs"
  # An installed launcher (/usr/share/sparseps, no source tree) writes under the current directory.
  [[ -f "$here/CMakeLists.txt" && -w "$here" ]] || runs="$PWD/runs"
  run_dir="$runs/${job_name}-$(date +%Y%m%d-%H%M%S)-$$"
fi
mkdir -p "$run_dir"
run_dir="$(cd "$run_dir" && pwd)"
# A run directory used before holds the last scheduler's port (the workers would dial it) and the
# last PyTorch DDP job's file store (examples/torch_job.py: its ranks would count the old ones).
rm -f "$run_dir/scheduler.port" "$run_dir/summary.json" "$run_dir/ddp.init"
if [[ -z "$resume" ]]; then
  cp "$config" "$run_dir/config.yaml"
  printf '%s\n' "${sets[@]}" | paste -sd' ' > "$run_dir/overrides.txt"
else
  echo "sparseps: resuming the job in $run_dir from its newest complete checkpoint"
fi

# One BLAS thread per process: the processes share the machine's cores.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
# The Python module, for --worker-command.
export PYTHONPATH="$build_dir/python${PYTHONPATH:+:$PYTHONPATH}"
# What the processes are started with: this machine's paths, or with --hosts the hosts' (the
# daemons at the same paths or in --remote-bin-dir, the config and run directory in --remote-dir).
job_config="$config"
job_dir="$run_dir"
if [[ -n "$hosts_file" ]]; then
  [[ -n "$remote_dir" ]] || remote_dir="/tmp/sparseps-runs/$(basename "$run_dir")"
  job_config="$remote_dir/config.yaml"
  job_dir="$remote_dir"
  if [[ -n "$remote_bin_dir" ]]; then
    scheduler_bin="$remote_bin_dir/sparseps-scheduler"
    server_bin="$remote_bin_dir/sparseps-server"
    worker_bin="$remote_bin_dir/sparseps-worker"
  fi
fi
worker_argv=("$worker_bin")
if [[ -n "$worker_command" ]]; then
  read -r -a worker_argv <<<"$worker_command"
fi

pids=()
names=()
tail_pid=""
stop_all() {
  local sig="${1:-TERM}"
  for p in "${pids[@]}"; do kill -"$sig" "$p" 2>/dev/null; done
}
# await_exit N: waits up to N tenths of a second for every process started to have exited.
await_exit() {
  local alive p
  for _ in $(seq "$1"); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && { alive=1; break; }; done
    ((alive)) || return 0
    sleep 0.1
  done
}
cleanup() {
  # With --hosts the remote processes are signalled, and their ssh ends when they have.
  if [[ -n "$hosts_file" ]]; then remote_signal TERM; else stop_all TERM; fi
  # Give the processes up to 5 s to exit (10 s on remote hosts), then kill what is left.
  await_exit "$([[ -n "$hosts_file" ]] && echo 100 || echo 50)"
  [[ -n "$hosts_file" ]] && remote_signal KILL
  stop_all KILL
  # Ending tail closes the pipe, so the filter behind it ends too.
  [[ -n "$tail_pid" ]] && kill "$tail_pid" 2>/dev/null
  for p in "${pids[@]}" $tail_pid; do wait "$p" 2>/dev/null; done
  [[ -n "$hosts_file" ]] && remote_collect
}
# After a process failed, the others were told (the scheduler's FATAL) or notice it themselves (a
# scheduler gone silent, within a heartbeat interval of whoever noticed first): they get up to two
# heartbeat intervals (at least 1 s) to end on their own, their reason in their logs, before
# cleanup stops them.
let_the_others_end() {
  await_exit "$(awk -v i="$heartbeat_interval" 'BEGIN { g = 2 * i; if (g < 1) g = 1; print int(10 * g + 0.5) }')"
}
on_signal() {
  echo "launch.sh: interrupted; stopping every process" >&2
  cleanup
  exit 130
}
trap on_signal INT TERM
trap cleanup EXIT

# Host placement: proc_host NAME prints where process NAME (scheduler, server-S, worker-W) runs:
# its emulated host's number with --netns (the scheduler on 1, server s on 1 + s, worker w on
# S + 1 + w), its host's index in the hosts file with --hosts, nothing on this machine.
netns_sh="$here/deploy/netns.sh"
proc_host() {
  local name="$1" rank="${1#*-}"
  if [[ -n "$hosts_file" ]]; then
    case "$name" in
      scheduler) echo "$sched_on" ;;
      server-*) echo "${server_on[$rank]}" ;;
      worker-*) echo "${worker_on[$rank]}" ;;
    esac
  elif [[ -n "$netns" ]]; then
    case "$name" in
      scheduler) echo 1 ;;
      server-*) echo $((1 + rank % server_hosts)) ;;
      worker-*) echo $((server_hosts + 1 + rank)) ;;
    esac
  fi
}
# host_set NAME KEY: "--set KEY=<the address of NAME's host>" with --netns or --hosts, nothing
# without (the config's).
host_set() {
  local h
  h="$(proc_host "$1")"
  [[ -z "$h" ]] && return
  if [[ -n "$hosts_file" ]]; then echo "--set $2=${host_addr[$h]}"
  else echo "--set $2=$("$netns_sh" addr --prefix "$netns" "$h")"; fi
}
if [[ -n "$netns" ]]; then
  need=$((server_hosts + num_workers))
  for ((h = 1; h <= need; h++)); do
    ip netns list | grep -q "^${netns}-h$h\b" || {
      echo "launch.sh: --netns $netns needs $need hosts; ${netns}-h$h is missing (deploy/netns.sh up --prefix $netns --hosts $need)" >&2
      exit 2
    }
  done
fi
# With --hosts: each host reached, given the config, and checked for the daemons before anything
# starts.
[[ -n "$hosts_file" ]] && { remote_prepare || exit 1; }
# Resuming there: each host gets back what its processes left in the run directory (logs, CSVs)
# and, from the newest complete checkpoint, the manifest and their files.
[[ -n "$hosts_file" && -n "$resume" ]] && { remote_push_back || exit 1; }

append_logs=""
[[ -n "$resume" ]] && append_logs=1
start() {  # start NAME COMMAND...: runs COMMAND where proc_host NAME says
  local name="$1"; shift
  if [[ -n "$hosts_file" ]]; then
    remote_start "$(proc_host "$name")" "$name" "$@"
    return
  fi
  [[ -n "$netns" ]] && set -- ip netns exec "${netns}-h$(proc_host "$name")" "$@"
  if [[ -n "$append_logs" ]]; then
    "$@" >>"$run_dir/$name.log" 2>&1 &
  else
    "$@" >"$run_dir/$name.log" 2>&1 &
  fi
  pids+=("$!")
  names+=("$name")
}

start_server() {  # start_server RANK COMMON_ARGS...
  local s="$1"; shift
  # shellcheck disable=SC2046
  start "server-$s" "$server_bin" "$@" \
    --set "cluster.scheduler_port=$port" --set "node.rank=$s" $(host_set "server-$s" node.host)
}

# local_rank W: worker W's rank among the workers on its host, SPARSEPS_LOCAL_RANK in its
# environment (its GPU, train.cuda_device -1, where the host has several): with --hosts among
# the hosts file's workers on its host; else W (the emulated --netns hosts share this machine).
local_rank() {
  local w="$1" i n=0
  [[ -z "$hosts_file" ]] && { echo "$w"; return; }
  for ((i = 0; i < w; i++)); do [[ "${worker_on[$i]}" == "${worker_on[$w]}" ]] && n=$((n + 1)); done
  echo "$n"
}

start_worker() {  # start_worker RANK COMMON_ARGS...
  local w="$1"; shift
  # shellcheck disable=SC2046
  start "worker-$w" env "SPARSEPS_LOCAL_RANK=$(local_rank "$w")" "${worker_argv[@]}" "$@" \
    --set "cluster.scheduler_port=$port" --set "node.rank=$w" $(host_set "worker-$w" node.host)
}

restart_with_rejoin() {  # restart_with_rejoin INDEX RC WHAT: starts names[INDEX] again, --rejoin
  local name="${names[$1]}"
  restarts=$((restarts + 1))
  local msg
  msg="$(date '+%F %T') restart $restarts of $max_restarts: $name exited with code $2; $3 (--rejoin)"
  echo "launch.sh: $msg" >&2
  echo "$msg" >>"$run_dir/restarts.log"
  # shellcheck disable=SC2046
  local args=(--config "$job_config" --rejoin $(host_set scheduler cluster.scheduler_host)
    "${sets[@]}" --set "run.dir=$job_dir")
  local saved_append="$append_logs"
  append_logs=1
  if [[ $name == server-* ]]; then
    start_server "${name#server-}" "${args[@]}"
  else
    start_worker "${name#worker-}" "${args[@]}"
  fi
  append_logs="$saved_append"
}

run_job() {  # starts every process, waits; sets $failed to the name of a process that failed
  failed=""
  job_ended=""  # the scheduler exited 0: the job ended normally
  # shellcheck disable=SC2046
  resume_args=()
  [[ -n "$resume" ]] && resume_args=(--resume "$job_dir")
  common=(--config "$job_config" "${resume_args[@]}" --set cluster.scheduler_port=0
    $(host_set scheduler cluster.scheduler_host) "${sets[@]}" --set "run.dir=$job_dir")
  # shellcheck disable=SC2046
  start scheduler "$scheduler_bin" "${common[@]}" $(host_set scheduler node.host)
  # The scheduler binds a free port and writes it to the run directory (deadline 30 s).
  port=""
  local deadline=$((SECONDS + 30))
  while ((SECONDS < deadline)); do
    if [[ -n "$hosts_file" ]]; then port="$(remote_read "$sched_on" scheduler.port)"
    else port="$(cat "$run_dir/scheduler.port" 2>/dev/null)"; fi
    [[ -n "$port" ]] && break
    kill -0 "${pids[0]}" 2>/dev/null || break
    sleep 0.1
  done
  if [[ -z "$port" ]]; then
    echo "launch.sh: the scheduler did not start; its log ($run_dir/scheduler.log):" >&2
    tail -n 30 "$run_dir/scheduler.log" >&2
    exit 1
  fi
  for ((s = 0; s < num_servers; s++)); do
    start_server "$s" "${common[@]}"
  done
  for ((w = 0; w < num_workers; w++)); do
    start_worker "$w" "${common[@]}"
  done
  echo "sparseps: ${job_name}: 1 scheduler (port $port), $num_servers servers, $num_workers workers; logs in $run_dir"
  [[ -n "$hosts_file" ]] && echo "sparseps: on ${#host_target[@]} hosts over ssh: $(hosts_summary)"

  if [[ $quiet -eq 0 ]]; then
    # Every worker's log: only the leader (worker 0, or the one that took over when it was lost)
    # prints progress and evaluations. An appended log is followed from its end. --pid: it ends
    # with this script, even when that is killed with SIGKILL.
    worker_logs=()
    for ((w = 0; w < num_workers; w++)); do worker_logs+=("$run_dir/worker-$w.log"); done
    tail --pid=$$ -n "$([[ -n "$append_logs" ]] && echo 0 || echo +1)" -F "${worker_logs[@]}" 2>/dev/null > >(
      grep --line-buffered -E "\] progress epoch|\] eval epoch|\] training done.*final test|\[error\]" |
        sed -u -E 's/^\[[^]]*\] \[[^]]*\] \[[a-z]*\] //') &
    tail_pid=$!
  fi

  failed=""
  # Poll rather than `wait -n`: bash 5.2's `wait -n PID...` can miss children that exit together.
  declare -A exited=()
  while [[ ${#exited[@]} -lt ${#pids[@]} && -z "$failed" ]]; do
    for i in "${!pids[@]}"; do
      p="${pids[$i]}"
      [[ -n "${exited[$p]:-}" ]] && continue
      kill -0 "$p" 2>/dev/null && continue
      wait "$p"
      rc=$?
      exited[$p]=$rc
      if [[ ${names[$i]} == scheduler && $rc -eq 0 ]]; then
        job_ended=1  # every live worker was done and the scheduler wrote summary.json
        continue
      fi
      if [[ -n "$job_ended" && $rc -ne 0 ]]; then
        # After the end nothing is restarted. Code 3: the scheduler fell silent before its
        # SHUTDOWN reached this process (a connection that broke as the job ended), or a
        # replacement started just before the end found no scheduler listening any more.
        if [[ $rc -eq 3 ]]; then
          echo "launch.sh: ${names[$i]} exited with code 3 after the job had ended (the" \
            "scheduler's SHUTDOWN did not reach it, or it came after the scheduler had gone);" \
            "the job finished" >&2
          continue
        fi
        failed="${names[$i]}"
        echo "launch.sh: ${names[$i]} exited with code $rc after the job had ended; its log" \
          "($run_dir/${names[$i]}.log):" >&2
        tail -n 30 "$run_dir/${names[$i]}.log" >&2
        break
      fi
      # Exit code 3: the daemon heard nothing from the scheduler for cluster.heartbeat_timeout_s
      # (its host was cut off, or the scheduler died), or the scheduler removed it (it was
      # stopped that long): lost to the job, as if killed. A dead scheduler is seen here too and
      # ends the job.
      if [[ ($rc -gt 128 || $rc -eq 3) && ${names[$i]} == server-* &&
            $restarts -lt $max_restarts ]]; then
        # Killed by a signal or cut off: a replacement takes its key range and the job rolls back
        # to its newest complete checkpoint (the scheduler ends the job if it cannot, and then
        # the whole job restarts below).
        restart_with_rejoin "$i" "$rc" \
          "a replacement takes its key range and the job rolls back to its newest checkpoint"
        continue
      fi
      if [[ ($rc -gt 128 || $rc -eq 3) && ${names[$i]} == worker-* && $aggregation != allreduce &&
            $on_worker_failure == continue ]]; then
        # Killed by a signal or cut off: the scheduler drops it and the others go on (it ends the
        # job below min_workers). A worker that exits with an error reports it, and that ends
        # the job.
        if [[ $restarts -lt $max_restarts ]]; then
          restart_with_rejoin "$i" "$rc" "a replacement joins the running job"
        else
          echo "launch.sh: ${names[$i]} exited with code $rc; the job goes on without it" \
            "(cluster.on_worker_failure: continue)" >&2
        fi
        continue
      fi
      if [[ $rc -ne 0 ]]; then
        failed="${names[$i]}"
        echo "launch.sh: ${names[$i]} exited with code $rc; its log ($run_dir/${names[$i]}.log):" >&2
        tail -n 30 "$run_dir/${names[$i]}.log" >&2
        break
      fi
    done
    [[ -z "$failed" && ${#exited[@]} -lt ${#pids[@]} ]] && sleep 0.2
  done
}

# The newest checkpoint folder with a manifest, if any.
have_checkpoint() {
  local dir="${checkpoint_dir:-$run_dir/checkpoints}"
  compgen -G "$dir/iter-*/MANIFEST.json" >/dev/null
}

restarts=0
while true; do
  run_job
  [[ -z "$failed" || $restarts -ge $max_restarts || -n "$job_ended" ]] && break
  restarts=$((restarts + 1))
  let_the_others_end
  echo "launch.sh: stopping the other processes" >&2
  cleanup
  pids=()
  names=()
  tail_pid=""
  rm -f "$run_dir/scheduler.port" "$run_dir/summary.json"
  append_logs=1
  if have_checkpoint; then
    resume="$run_dir"
    what="from the newest complete checkpoint"
  else
    resume=""
    what="from the start (no complete checkpoint yet)"
  fi
  msg="$(date '+%F %T') restart $restarts of $max_restarts after $failed failed: the whole job, $what"
  echo "launch.sh: $msg" >&2
  echo "$msg" >>"$run_dir/restarts.log"
  if [[ -n "$hosts_file" ]]; then
    # cleanup copied every host's files here and removed them there: the hosts again, as for
    # --resume (from the start, only the logs go back).
    remote_prepared="" remote_collected=""
    remote_prepare || exit 1
    remote_push_back || exit 1
  fi
done
sleep 0.3  # let the progress stream print its last lines
if [[ -n "$failed" ]]; then
  let_the_others_end
  echo "launch.sh: stopping the other processes" >&2
fi
# With --hosts: every host's files (summary.json among them) into the run directory now.
[[ -n "$hosts_file" ]] && cleanup
[[ -n "$failed" ]] && exit 1
acc="$(grep -o '"final_test_accuracy": *[0-9.eE+-]*' "$run_dir/summary.json" 2>/dev/null | grep -o '[0-9.eE+-]*$')"
wall="$(grep -o '"wall_clock_s": *[0-9.eE+-]*' "$run_dir/summary.json" 2>/dev/null | grep -o '[0-9.eE+-]*$')"
if [[ -n "$acc" ]]; then
  printf 'sparseps: %s finished in %.1f s: final test accuracy %.2f%%\n' "$job_name" "$wall" \
    "$(awk -v a="$acc" 'BEGIN { print 100 * a }')"
fi
echo "sparseps: run directory $run_dir"
