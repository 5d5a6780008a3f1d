# slurm_lib.sh - shell functions shared by slurm_up.sh and slurm_down.sh (sourced, not run).
# The caller defines log().

# pid_alive FILE COMM -> true if FILE holds a live pid whose /proc comm is COMM
pid_alive() {
  local f=$1 comm=$2 pid
  [ -s "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$comm" ]
}
# stop_all FILE:COMM ... -> SIGTERM every live, matching pid at once, wait <=10 s, SIGKILL rest
stop_all() {
  local spec f comm pid pids=() i
  for spec in "$@"; do
    f=${spec%%:*}; comm=${spec##*:}
    if pid_alive "$f" "$comm"; then
      pid=$(cat "$f"); log "stopping $comm pid $pid"; kill -TERM "$pid" 2>/dev/null || true; pids+=("$pid")
    fi
    rm -f "$f"
  done
  for i in $(seq 1 100); do
    local alive=0; for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0; sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && { log "SIGKILL pid $pid"; kill -KILL "$pid" 2>/dev/null; }; done
  return 0
}
