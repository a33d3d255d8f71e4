# shellcheck shell=bash
# shellcheck disable=SC2154
# The --hosts part of deploy/launch.sh (sourced by it): reads the hosts file, and starts, stops and
# collects the job's processes on those hosts over OpenSSH. Uses launch.sh's variables (run_dir,
# remote_dir, ssh_cmd, remote_env, num_servers, num_workers, aggregation, the daemons' paths,
# append_logs, pids, names, resume, checkpoint_dir, checkpoint_keep).
#
# How a remote process is run: one ssh per process, whose command (a POSIX sh script) starts the
# process in the background with its log in --remote-dir, writes its pid next to the log, streams
# the log back on ssh's stdout (so the local run directory has every log live) until the process
# ends, and exits with the process's exit code, which ssh returns here. The script's stdin is a
# FIFO that launch.sh holds open and never writes, and ssh gets SIGTERM when launch.sh ends
# (setpriv --pdeathsig): when launch.sh ends, even by SIGKILL, or ssh's connection is lost, the
# remote side reads end-of-file and stops the process (TERM, then KILL 5 s later). launch.sh
# stops processes itself by signalling the pids written next to the logs.

remote_err() { echo "launch.sh: $*" >&2; }

# sq ARG: ARG quoted for a POSIX sh.
sq() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

host_target=()   # what ssh reaches: [user@]host
host_port=()     # ssh port, or ''
host_addr=()     # the address the other hosts reach it at (node.host)
host_spec=()     # the hosts file's first column, for messages
host_line=()     # its line in the hosts file
host_names=()    # the processes it runs: " scheduler server-0 worker-1"
host_local=()    # 1 when its --remote-dir is this machine's run directory (a shared filesystem)
sched_on="" server_on=() worker_on=()

# parse_hosts FILE: fills the arrays above and sched_on / server_on[s] / worker_on[w] (indices into
# them); returns 1 naming the file, line and token of the first error, or a role count that is not
# the config's.
parse_hosts() {
  local file="$1" line n=0 t i count spec target port addr k role hostpart
  local -a tok roles
  [[ -f "$file" && -r "$file" ]] || { remote_err "--hosts $file: no such readable file"; return 1; }
  while IFS= read -r line || [[ -n "$line" ]]; do
    n=$((n + 1))
    line="${line%%#*}"
    read -r -a tok <<<"$line"
    ((${#tok[@]} == 0)) && continue
    spec="${tok[0]}" addr="" roles=()
    for t in "${tok[@]:1}"; do
      case "$t" in
        addr=?*) addr="${t#addr=}" ;;
        scheduler | server | worker) roles+=("$t") ;;
        scheduler:* | server:* | worker:*)
          count="${t#*:}"
          [[ "$count" =~ ^[1-9][0-9]*$ ]] ||
            { remote_err "$file:$n: '$t': the count after ':' must be a positive number"; return 1; }
          for ((i = 0; i < count; i++)); do roles+=("${t%%:*}"); done
          ;;
        *)
          remote_err "$file:$n: '$t' is neither a role (scheduler, server, worker, with an optional :COUNT) nor addr=ADDRESS"
          return 1
          ;;
      esac
    done
    ((${#roles[@]} > 0)) || { remote_err "$file:$n: host '$spec' has no role (scheduler, server, worker)"; return 1; }
    target="$spec" port=""
    if [[ "$spec" =~ ^(.+):([0-9]+)$ ]]; then target="${BASH_REMATCH[1]}" port="${BASH_REMATCH[2]}"; fi
    hostpart="${target#*@}"
    if [[ -z "$addr" ]]; then
      if [[ "$hostpart" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
        addr="$hostpart"
      else
        addr="$(getent ahostsv4 "$hostpart" | awk 'NR == 1 { print $1 }')"
        [[ -n "$addr" ]] ||
          { remote_err "$file:$n: cannot resolve '$hostpart' here; give its address with addr=ADDRESS"; return 1; }
      fi
    fi
    k=${#host_target[@]}
    host_target+=("$target") host_port+=("$port") host_addr+=("$addr") host_spec+=("$spec")
    host_line+=("$n") host_names+=("") host_local+=("")
    for role in "${roles[@]}"; do
      case "$role" in
        scheduler)
          [[ -z "$sched_on" ]] ||
            { remote_err "$file:$n: a second scheduler (the first is on line ${host_line[$sched_on]})"; return 1; }
          sched_on=$k
          host_names[k]+=" scheduler"
          ;;
        server) host_names[k]+=" server-${#server_on[@]}"; server_on+=("$k") ;;
        worker) host_names[k]+=" worker-${#worker_on[@]}"; worker_on+=("$k") ;;
      esac
    done
  done <"$file"
  [[ -n "$sched_on" ]] || { remote_err "$file: no host has the scheduler role"; return 1; }
  if ((${#server_on[@]} != num_servers || ${#worker_on[@]} != num_workers)); then
    local why=""
    [[ "$aggregation" == allreduce ]] && why=" (it aggregates by allreduce: no servers)"
    remote_err "$file lists ${#server_on[@]} server(s) and ${#worker_on[@]} worker(s); the config has $num_servers and $num_workers$why"
    return 1
  fi
}

# hosts_summary: "10.0.0.1: scheduler server-0; 10.0.0.2: worker-0".
hosts_summary() {
  local k sep=""
  for k in "${!host_target[@]}"; do
    printf '%s%s:%s' "$sep" "${host_spec[$k]}" "${host_names[$k]}"
    sep="; "
  done
  echo
}

# ssh_args K: sets ssh_args to the ssh command line that reaches host K (the command follows).
# BatchMode: never a password prompt; keep-alives: a host silent for 30 s ends its ssh with 255;
# one connection per host that every ssh of the job shares (ControlMaster: a connection costs a
# key exchange, 0.1 to 1 s; the master ends 30 s after its last session, or at remote_collect).
# Options given with --ssh come first and so win over these.
ssh_args() {
  local -a base
  read -r -a base <<<"$ssh_cmd"
  ssh_args=("${base[@]}" -o BatchMode=yes -o ConnectTimeout=15 -o ServerAliveInterval=10
    -o ServerAliveCountMax=3 -o ControlMaster=auto -o "ControlPath=$remote_keep/cm-%C"
    -o ControlPersist=30)
  [[ -n "${host_port[$1]}" ]] && ssh_args+=(-p "${host_port[$1]}")
  ssh_args+=("${host_target[$1]}")
}

# remote_prepare: on every host, makes --remote-dir, puts the job's config there and checks that
# the daemons it runs are there; returns 1 naming the host that failed. Opens the FIFO that the
# remote processes watch.
remote_prepare() {
  local k n bins d waits=() failed=0
  d="$(sq "$remote_dir")"
  remote_keep="$(mktemp -d)"
  # Every host at once (each answer in a file of its own).
  for k in "${!host_target[@]}"; do
    bins=""
    for n in ${host_names[$k]}; do
      case "$n" in
        scheduler) bins+=" $(sq "$scheduler_bin")" ;;
        server-*) bins+=" $(sq "$server_bin")" ;;
        worker-*) [[ -z "$worker_command" ]] && bins+=" $(sq "$worker_bin")" ;;
      esac
    done
    ssh_args "$k"
    # A temporary name of the host's own: hosts that share a file system (NFS, or test hosts
    # on one machine) write at the same time, and each renames only its own copy.
    timeout 60 "${ssh_args[@]}" "mkdir -p $d && cat >$d/.config.yaml.tmp-$k &&
        mv $d/.config.yaml.tmp-$k $d/config.yaml && : >$d/.sparseps-host-$k &&
        for b in$bins; do [ -x \"\$b\" ] || { echo \"\$b: not found on \$(hostname)\"; exit 3; }; done" \
      <"$run_dir/config.yaml" >"$remote_keep/prepare-$k" 2>&1 &
    waits[k]=$!
  done
  for k in "${!host_target[@]}"; do
    if ! wait "${waits[$k]}"; then
      remote_err "host ${host_spec[$k]} (${hosts_file}:${host_line[$k]}): $(cat "$remote_keep/prepare-$k" 2>/dev/null || echo ssh failed)"
      failed=1
    fi
  done
  ((failed == 0)) || return 1
  for k in "${!host_target[@]}"; do
    [[ -e "$run_dir/.sparseps-host-$k" ]] && host_local[k]=1
  done
  mkfifo "$remote_keep/stdin"
  exec {remote_keep_fd}<>"$remote_keep/stdin"
  remote_prepared=1
}

# remote_push_back: for --resume with --hosts, and a whole-job restart. The run directory here
# holds what every host left in it (remote_collect copied each host's files back and removed
# them there): each host gets back its own processes' files (NAME.log, *-NAME.csv and the like:
# the logs go on and the CSVs keep their rows up to the checkpoint), and, when resuming ($resume)
# with the checkpoints under the run directory (checkpoint.dir unset), the newest complete
# checkpoint's manifest and its processes' files, the only ones their --resume reads. Nothing
# goes to a host whose --remote-dir is this run directory. One host at a time (hosts may share
# --remote-dir). Returns 1 naming the host that failed.
remote_push_back() {
  local k n f iter="" files
  if [[ -n "$resume" && -z "$checkpoint_dir" ]]; then
    for f in "$run_dir"/checkpoints/iter-*/MANIFEST.json; do
      [[ -f "$f" ]] && iter="$(basename "$(dirname "$f")")"
    done
    [[ -n "$iter" ]] || echo "launch.sh: $run_dir/checkpoints has no complete checkpoint" >&2
  fi
  for k in "${!host_target[@]}"; do
    [[ -n "${host_local[$k]}" ]] && continue
    files=()
    for n in ${host_names[$k]}; do
      for f in "$run_dir/$n".* "$run_dir"/*-"$n".*; do
        [[ -f "$f" && "$f" != *.safetensors ]] && files+=("${f#"$run_dir"/}")
      done
      [[ -n "$iter" && -f "$run_dir/checkpoints/$iter/$n.safetensors" ]] &&
        files+=("checkpoints/$iter/$n.safetensors")
    done
    [[ -n "$iter" ]] && files+=("checkpoints/$iter/MANIFEST.json")
    ((${#files[@]} > 0)) || continue
    ssh_args "$k"
    if ! tar -C "$run_dir" -cf - "${files[@]}" |
        timeout 600 "${ssh_args[@]}" "cd $(sq "$remote_dir") && tar -xf -" >/dev/null 2>&1; then
      remote_err "host ${host_spec[$k]} (${hosts_file}:${host_line[$k]}): could not copy the job's files back into $remote_dir"
      return 1
    fi
  done
}

# remote_start K NAME COMMAND...: starts COMMAND on host K as process NAME (see the top); its
# log streams into $run_dir/NAME.log; the local ssh's pid goes to pids.
remote_start() {
  local k="$1" name="$2"; shift 2
  local d="$remote_dir" log pidf cmd="" a out="$run_dir/$name.log" truncate=""
  log="$(sq "$d/$name.log")" pidf="$(sq "$d/$name.pid")"
  for a in "OPENBLAS_NUM_THREADS=$OPENBLAS_NUM_THREADS" "PYTHONPATH=$PYTHONPATH" \
    "${remote_env[@]}" "$@"; do
    cmd+=" $(sq "$a")"
  done
  [[ -z "$append_logs" ]] && truncate=": >$log"
  local script="cd $(sq "$PWD") 2>/dev/null || cd $(sq "$d") || exit 1
$truncate
n=\$(wc -c 2>/dev/null <$log || echo 0)
exec 3<&0
env$cmd >>$log 2>&1 </dev/null 3<&- &
p=\$!
echo \$p >$pidf
(cat <&3 >/dev/null; kill -TERM \$p; sleep 5; kill -KILL \$p) >/dev/null 2>&1 &
w=\$!
exec 3<&-
tail -c +\$((n + 1)) -f --pid=\$p $log &
t=\$!
wait \$p
rc=\$?
rm -f $pidf
wait \$t
kill \$w 2>/dev/null
exit \$rc"
  # A run directory that is also the remote one gets the log from the process itself.
  [[ -n "${host_local[$k]}" ]] && out=/dev/null
  ssh_args "$k"
  # ssh ends with launch.sh (parent-death signal), even when launch.sh is killed with SIGKILL.
  command -v setpriv >/dev/null && ssh_args=(setpriv --pdeathsig TERM "${ssh_args[@]}")
  if [[ -n "$append_logs" ]]; then
    "${ssh_args[@]}" "$script" <"$remote_keep/stdin" >>"$out" 2>&1 {remote_keep_fd}>&- &
  else
    "${ssh_args[@]}" "$script" <"$remote_keep/stdin" >"$out" 2>&1 {remote_keep_fd}>&- &
  fi
  pids+=("$!")
  names+=("$name")
}

# remote_read K FILE: prints FILE of host K's --remote-dir (nothing when it is not there).
remote_read() {
  ssh_args "$1"
  timeout 20 "${ssh_args[@]}" "cat $(sq "$remote_dir/$2") 2>/dev/null" </dev/null 2>/dev/null
}

# remote_signal SIG: sends SIG to every process still running, on every host at once (20 s
# deadline per host).
remote_signal() {
  local i k script waits=() running=()
  for i in "${!pids[@]}"; do
    kill -0 "${pids[$i]}" 2>/dev/null || continue
    running[$(proc_host "${names[$i]}")]+=" ${names[$i]}"
  done
  for k in "${!running[@]}"; do
    script="cd $(sq "$remote_dir") 2>/dev/null || exit 0
for n in${running[$k]}; do [ -s \$n.pid ] && kill -$1 \$(cat \$n.pid) 2>/dev/null; done; exit 0"
    ssh_args "$k"
    timeout 20 "${ssh_args[@]}" "$script" </dev/null >/dev/null 2>&1 &
    waits+=("$!")
  done
  ((${#waits[@]} > 0)) && wait "${waits[@]}"
}

# remote_collect: copies every host's --remote-dir into the run directory and removes it there
# (once; directories that hosts share are copied once, the run directory itself not at all).
remote_collect() {
  [[ -n "${remote_prepared:-}" && -z "${remote_collected:-}" ]] || { remote_disconnect; return 0; }
  remote_collected=1
  exec {remote_keep_fd}>&-
  local k j first d remote_copied=()
  d="$(sq "$remote_dir")"
  for k in "${!host_target[@]}"; do
    [[ -n "${host_local[$k]}" ]] && continue
    ssh_args "$k"
    # The hosts' markers in this directory: the one of the lowest host is the one that copies it.
    first="$k"
    for j in $(timeout 30 "${ssh_args[@]}" "ls -a $d" </dev/null 2>/dev/null |
      sed -n 's/^\.sparseps-host-\([0-9]*\)$/\1/p'); do
      ((j < first)) && first="$j"
    done
    ((first == k)) || continue
    if timeout 600 "${ssh_args[@]}" "cd $d && tar -cf - --exclude='./*.pid' \
        --exclude='./.sparseps-host-*' --exclude='./.config.yaml.tmp*' ." </dev/null |
        tar -C "$run_dir" -xf -; then
      remote_copied+=("$k")
    else
      remote_err "could not copy host ${host_spec[$k]}'s files ($remote_dir) into $run_dir"
    fi
  done
  # Copied: the hosts keep nothing of the job (removed only after every host was looked at, as
  # hosts may share the directory).
  for k in "${remote_copied[@]}"; do
    ssh_args "$k"
    timeout 60 "${ssh_args[@]}" "rm -rf $d" </dev/null >/dev/null 2>&1 ||
      remote_err "could not remove $remote_dir on host ${host_spec[$k]}"
  done
  [[ -z "$checkpoint_dir" ]] && prune_checkpoints "$run_dir/checkpoints" "${checkpoint_keep:-0}"
  remote_disconnect
}

# prune_checkpoints DIR KEEP: checkpoint.keep over the folders collected into DIR, where those of
# an earlier attempt (--resume, a whole-job restart) are too: the newest KEEP complete ones (with
# MANIFEST.json) and any newer one stay, the others are deleted, as the scheduler and every node
# prune their own folders (storage/checkpoint.h, PruneCheckpoints). KEEP 0: all stay.
prune_checkpoints() {
  local dir="$1" keep="$2" complete=0 f
  [[ "$keep" =~ ^[1-9][0-9]*$ && -d "$dir" ]] || return 0
  while IFS= read -r f; do
    if [[ -f "$dir/$f/MANIFEST.json" ]] && ((complete < keep)); then
      complete=$((complete + 1))
    elif ((complete > 0)); then
      rm -rf "${dir:?}/$f"
    fi
  done < <(find "$dir" -mindepth 1 -maxdepth 1 -type d -name 'iter-[0-9]*' -printf '%f\n' | sort -r)
}

# remote_disconnect: ends the hosts' shared connections (once).
remote_disconnect() {
  [[ -n "${remote_keep:-}" ]] || return 0
  local k
  for k in "${!host_target[@]}"; do
    ssh_args "$k"
    timeout 10 "${ssh_args[@]:0:${#ssh_args[@]}-1}" -O exit "${ssh_args[-1]}" >/dev/null 2>&1
  done
  rm -rf "$remote_keep"
  remote_keep=""
}
