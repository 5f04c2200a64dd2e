#!/usr/bin/env bash
# A real single-machine SLURM cluster, for brigade's tests and for trying launcher=slurm without one.
#
#   launch/slurm/local_cluster.sh start [--nodes N]   # N = 1 or 2 virtual nodes (default 2)
#   launch/slurm/local_cluster.sh status
#   launch/slurm/local_cluster.sh stop
#   launch/slurm/local_cluster.sh restart-node NODE   # start a node's slurmd again after it died
#
# start: installs the Debian packages if missing (apt-get update once), writes slurm.conf and
# slurmdbd.conf under $BRIGADE_SLURM_DIR (default /tmp/brigade-slurm), then starts, each in the
# background with its PID recorded in $BRIGADE_SLURM_DIR/pids:
#   munged (as the munge user) -> MariaDB on 127.0.0.1 only -> slurmdbd (accounting: submitit needs
#   sacct to see a killed job, else a sweep waits forever) -> slurmctld -> one slurmd per node
# and waits until every node is idle. It prints the `export SLURM_CONF=...` line clients need.
# stop: cancels this cluster's jobs, then stops exactly the recorded PIDs (TERM, then KILL).
# Both are idempotent. A daemon that does not come up is reported with the tail of its log.
#
# Two nodes on one machine use slurmd's multiple-slurmd mode: each node has its own port and spool
# dir (%n), and node names (bn1, bn2) are added to /etc/hosts, since multi-node jobs rendezvous on
# the first node's name. No systemd or cgroups: proctrack/linuxproc and task/none.
#
# Environment: BRIGADE_SLURM_DIR (state dir), BRIGADE_SLURM_PORT_BASE (default 17810: slurmctld
# base, slurmdbd base+1, MariaDB base+2, node i base+10+i), BRIGADE_SLURM_CPUS (CPUs each node
# advertises, default 8: more than this machine's cores, so an 8-rank job (3D 2x2x2) fits on one node).
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin  # the daemons live in sbin

STATE=${BRIGADE_SLURM_DIR:-/tmp/brigade-slurm}
PORT_BASE=${BRIGADE_SLURM_PORT_BASE:-17810}
CPUS=${BRIGADE_SLURM_CPUS:-8}
CLUSTER=brigade
PARTITION=debug
CTLD_PORT=$PORT_BASE
DBD_PORT=$((PORT_BASE + 1))
DB_PORT=$((PORT_BASE + 2))
PIDS=$STATE/pids
CONF=$STATE/etc/slurm.conf
HOST=$(hostname -s)
PACKAGES=(munge slurm-client slurmctld slurmd slurmdbd mariadb-server)

log() { printf '[local_cluster] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

export SLURM_CONF=$CONF

# --- pids -------------------------------------------------------------------------------------
# $PIDS holds "name pid exe" lines; a PID counts as ours only while /proc/PID/exe is still that
# executable, so a recycled PID is never signalled.
alive() {  # alive PID EXE
  [[ -e /proc/$1 ]] && [[ "$(readlink -f "/proc/$1/exe" 2>/dev/null)" == "$2" ]]
}

recorded() { [[ -s $PIDS ]] && cat "$PIDS" || true; }

record_pid() {  # record_pid NAME PID EXE
  echo "$1 $2 $3" >>"$PIDS"
}

all_alive() {
  local n=0 name pid exe
  while read -r name pid exe; do
    alive "$pid" "$exe" || return 1
    n=$((n + 1))
  done < <(recorded)
  ((n > 0))
}

# --- packages ---------------------------------------------------------------------------------
install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  [[ $(id -u) == 0 ]] || die "packages missing (${missing[*]}) and not root: apt-get install them first"
  log "installing ${missing[*]} (apt-get update once, then --no-install-recommends)"
  # The image's policy-rc.d keeps package scripts from starting daemons: we start our own below.
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$STATE/log/apt.log" 2>&1 ||
    { tail -20 "$STATE/log/apt.log" >&2; die "apt-get update failed"; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    >>"$STATE/log/apt.log" 2>&1 || { tail -20 "$STATE/log/apt.log" >&2; die "apt-get install failed"; }
}

# --- config -----------------------------------------------------------------------------------
node_names() { local i; for ((i = 1; i <= $1; i++)); do printf 'bn%d ' "$i"; done; }

write_configs() {  # write_configs NODES
  local nodes=$1 i
  mkdir -p "$STATE"/{etc,log,run,ctld,spool,munge/run,db}
  local dbpass
  dbpass=$(cat "$STATE/etc/dbpass" 2>/dev/null || true)
  if [[ -z $dbpass ]]; then
    dbpass=$(head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9')
    (umask 077 && echo "$dbpass" >"$STATE/etc/dbpass")
  fi
  {
    cat <<EOF
# Written by launch/slurm/local_cluster.sh: a single-machine cluster for brigade's tests.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/run/munge.socket
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# No systemd or cgroups on this machine.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SchedulerType=sched/backfill
# slurmctld refuses to start without a mail program.
MailProg=/bin/true
# Refuse an oversized request at submission, instead of leaving it pending forever.
EnforcePartLimits=ALL
# Finished jobs stay visible to squeue/scontrol for an hour (sacct keeps them for good).
MinJobAge=3600
# A cancelled or timed-out job is SIGKILLed 5 s after its SIGTERM (default 30 s).
KillWait=5
# A task that exits non-zero ends the whole step (its peers would otherwise wait on it).
KillOnBadExit=1
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
# Nodes may advertise more CPUs than the machine has (ranks then time-share the cores).
SlurmdParameters=config_overrides
# Accounting through slurmdbd: submitit reads job states with sacct.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$STATE/munge/run/munge.socket
EOF
    for ((i = 1; i <= nodes; i++)); do
      echo "NodeName=bn$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT_BASE + 10 + i)) CPUs=$CPUS State=UNKNOWN"
    done
    echo "PartitionName=$PARTITION Nodes=$(node_names "$nodes" | xargs | tr ' ' ',') Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF"
  (
    umask 077
    cat >"$STATE/etc/slurmdbd.conf" <<EOF
# Written by launch/slurm/local_cluster.sh (mode 0600: it holds the database password).
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/run/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$dbpass
StorageLoc=slurm_acct_db
EOF
  )
  chmod 600 "$STATE/etc/slurmdbd.conf"
}

hosts_entries() {  # node names must resolve: multi-node jobs rendezvous on the first node's name
  local n missing=()
  for n in $(node_names "$1"); do getent hosts "$n" >/dev/null || missing+=("$n"); done
  ((${#missing[@]} == 0)) && return 0
  [[ -w /etc/hosts ]] || die "node names ${missing[*]} do not resolve and /etc/hosts is not writable"
  log "adding '127.0.0.1 ${missing[*]}' to /etc/hosts"
  echo "127.0.0.1 ${missing[*]}  # brigade local SLURM cluster" >>/etc/hosts
}

# --- daemons ----------------------------------------------------------------------------------
port_busy() { ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }

check_ports() {
  local p
  for p in "$@"; do
    port_busy "$p" && die "port $p is in use (another cluster? set BRIGADE_SLURM_PORT_BASE)"
  done
  return 0
}

start_bg() {  # start_bg NAME EXE LOG CMD... : in the background in its own session, PID recorded.
  # CMD ends by exec'ing EXE (setsid and setpriv exec, they do not fork), so $! is EXE's PID.
  local name=$1 exe=$2 logf=$3
  shift 3
  setsid "$@" </dev/null >>"$logf" 2>&1 9>&- &  # 9>&-: the daemon must not hold our lock
  record_pid "$name" "$!" "$(readlink -f "$exe")"
}

wait_for() {  # wait_for NAME LOG SECONDS TEST...
  local name=$1 logf=$2 secs=$3
  shift 3
  local t0=$SECONDS pid exe
  read -r _ pid exe < <(grep "^$name " "$PIDS" | tail -1)
  until "$@" >"$STATE/log/check.out" 2>&1; do
    local gone=0
    # Past the first second the exec is done: a PID that is no longer EXE has exited.
    ((SECONDS - t0 >= 2)) && ! alive "$pid" "$exe" && gone=1
    if ((gone || SECONDS - t0 > secs)); then
      ((gone)) && log "$name exited; last lines of $logf:" ||
        log "$name did not come up within ${secs}s; last lines of $logf:"
      tail -25 "$logf" >&2 || true
      log "the check '$*' said:"
      tail -5 "$STATE/log/check.out" >&2 || true
      stop_daemons
      exit 1
    fi
    sleep 0.3
  done
}

start_munge() {
  id munge >/dev/null 2>&1 || die "user munge missing (package munge not installed?)"
  local d=$STATE/munge
  chmod 0755 "$STATE"  # munged runs as munge: it must reach its dir (mktemp makes 0700 dirs)
  setpriv --reuid=munge --regid=munge --clear-groups test -x "$d" ||
    die "user munge cannot reach $d: every parent dir of BRIGADE_SLURM_DIR must be searchable by others"
  if [[ ! -s $d/munge.key ]]; then
    mungekey --create --keyfile="$d/munge.key" 2>/dev/null || head -c 1024 /dev/urandom >"$d/munge.key"
  fi
  # munged insists on: key 0400/0600 owned by its user, socket dir 0755 (else "Socket is
  # inaccessible" for clients), no group/world-writable dirs of its own.
  chown -R munge:munge "$d"
  chmod 0755 "$d" "$d/run"
  chmod 0600 "$d/munge.key"
  start_bg munged "$(command -v munged)" "$STATE/log/munged.log" setpriv --reuid=munge --regid=munge --clear-groups \
    "$(command -v munged)" -F --force --socket="$d/run/munge.socket" --key-file="$d/munge.key" \
    --pid-file="$d/run/munged.pid" --seed-file="$d/munge.seed" --log-file="$d/munged.log"
  wait_for munged "$d/munged.log" 20 munge -n -S "$d/run/munge.socket"
}

start_mariadb() {
  local data=$STATE/db/data sock=$STATE/db/mysqld.sock
  if [[ ! -d $data/mysql ]]; then
    mariadb-install-db --no-defaults --user=root --datadir="$data" --auth-root-authentication-method=socket \
      --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 ||
      { tail -20 "$STATE/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  fi
  # Loopback only, no config files read (--no-defaults), everything under the state dir.
  start_bg mariadbd "$(command -v mariadbd)" "$STATE/log/mariadbd.out" "$(command -v mariadbd)" --no-defaults --user=root \
    --datadir="$data" --socket="$sock" --port="$DB_PORT" --bind-address=127.0.0.1 \
    --pid-file="$STATE/run/mariadbd.pid" --log-error="$STATE/log/mariadbd.log" \
    --innodb-buffer-pool-size=64M --skip-name-resolve
  wait_for mariadbd "$STATE/log/mariadbd.log" 60 mariadb --no-defaults --socket="$sock" -u root -e "SELECT 1"
  local pass
  pass=$(cat "$STATE/etc/dbpass")
  mariadb --no-defaults --socket="$sock" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
    ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" ||
    die "could not create the slurm database user"
}

start_slurmdbd() {
  start_bg slurmdbd "$(command -v slurmdbd)" "$STATE/log/slurmdbd.out" "$(command -v slurmdbd)" -D
  wait_for slurmdbd "$STATE/log/slurmdbd.log" 60 sacctmgr -n list cluster
  if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster $CLUSTER failed"
  fi
}

start_slurm() {
  local nodes=$1 n
  start_bg slurmctld "$(command -v slurmctld)" "$STATE/log/slurmctld.out" "$(command -v slurmctld)" -D -f "$CONF"
  wait_for slurmctld "$STATE/log/slurmctld.log" 30 scontrol ping
  for n in $(node_names "$nodes"); do
    start_bg "slurmd-$n" "$(command -v slurmd)" "$STATE/log/slurmd-$n.out" "$(command -v slurmd)" -D -N "$n" -f "$CONF"
  done
  local t0=$SECONDS
  until [[ $(sinfo -h -N -o '%t' 2>/dev/null | grep -cx idle) == "$nodes" ]]; do
    if ((SECONDS - t0 > 60)); then
      log "nodes not idle within 60s:"
      sinfo -N -l >&2 || true
      for n in $(node_names "$nodes"); do
        log "last lines of $STATE/log/slurmd-$n.log:"
        tail -15 "$STATE/log/slurmd-$n.log" >&2 || true
      done
      stop_daemons
      exit 1
    fi
    # A node left DOWN by an earlier run (same state dir) is resumed once its slurmd is up.
    sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /down|drain/ {print $1}' |
      xargs -r -I{} scontrol update NodeName={} State=RESUME >/dev/null 2>&1 || true
    sleep 0.3
  done
}

stop_daemons() {
  [[ -s $PIDS ]] || return 0
  # Reverse start order: slurmds, slurmctld, slurmdbd, MariaDB, munged.
  local lines name pid exe t0
  mapfile -t lines < <(tac "$PIDS")
  for line in "${lines[@]}"; do
    read -r name pid exe <<<"$line"
    alive "$pid" "$exe" || continue
    kill -TERM "$pid" 2>/dev/null || true
    t0=$SECONDS
    while alive "$pid" "$exe" && ((SECONDS - t0 < 15)); do sleep 0.2; done
    if alive "$pid" "$exe"; then
      log "$name ($pid) ignored SIGTERM for 15s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.5
    fi
  done
  for line in "${lines[@]}"; do
    read -r name pid exe <<<"$line"
    alive "$pid" "$exe" && die "$name ($pid) is still running"
  done
  rm -f "$PIDS"
}

cancel_jobs() {  # jobs of this cluster only: their slurmstepd are not our PIDs to kill
  scontrol ping >/dev/null 2>&1 || return 0
  local jobs
  jobs=$(squeue -h -o '%i' 2>/dev/null || true)
  [[ -z $jobs ]] && return 0
  log "cancelling jobs: $(echo $jobs)"
  # shellcheck disable=SC2086
  scancel $jobs 2>/dev/null || true
  local t0=$SECONDS
  while [[ -n $(squeue -h -t all -o '%i %t' 2>/dev/null | awk '$2 !~ /^(CA|CD|F|TO|NF|OOM|PR|BF|DL)$/') ]] &&
    ((SECONDS - t0 < 30)); do sleep 0.5; done
}

print_env() {
  echo "export SLURM_CONF=$CONF"
}

# --- commands ---------------------------------------------------------------------------------
cmd_start() {
  local nodes=2
  while (($#)); do
    case $1 in
      --nodes) nodes=${2:?--nodes needs a number}; shift 2 ;;
      --nodes=*) nodes=${1#--nodes=}; shift ;;
      *) die "unknown option $1 (start [--nodes N])" ;;
    esac
  done
  [[ $nodes == 1 || $nodes == 2 ]] || die "--nodes must be 1 or 2, got $nodes"
  [[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "BRIGADE_SLURM_CPUS must be a positive integer, got '$CPUS'"
  [[ $PORT_BASE =~ ^[1-9][0-9]*$ ]] || die "BRIGADE_SLURM_PORT_BASE must be a port number, got '$PORT_BASE'"
  mkdir -p "$STATE/log"
  exec 9>"$STATE/lock"
  flock -w 120 9 || die "another start/stop holds $STATE/lock"
  if all_alive; then
    local have
    have=$(grep -c '^slurmd-' "$PIDS")
    [[ $have == "$nodes" ]] || die "running with $have node(s); run '$0 stop' first to start $nodes"
    log "already running ($nodes node(s)) in $STATE"
    print_env
    return 0
  fi
  if [[ -s $PIDS ]]; then
    log "some recorded daemons are gone: stopping the rest and starting anew"
    stop_daemons
  fi
  local t0=$SECONDS
  install_packages
  local ports=("$CTLD_PORT" "$DBD_PORT" "$DB_PORT") i
  for ((i = 1; i <= nodes; i++)); do ports+=($((PORT_BASE + 10 + i))); done
  check_ports "${ports[@]}"
  write_configs "$nodes"
  hosts_entries "$nodes"
  # A state dir from a run with another node count: the saved node table would disagree.
  [[ -f $STATE/ctld/nodes ]] && [[ $(cat "$STATE/ctld/nodes") != "$nodes" ]] && rm -rf "$STATE/ctld"/*
  mkdir -p "$STATE/ctld" && echo "$nodes" >"$STATE/ctld/nodes"
  start_munge
  start_mariadb
  start_slurmdbd
  start_slurm "$nodes"
  log "up in $((SECONDS - t0))s: $nodes node(s) idle, partition $PARTITION, state in $STATE"
  print_env
}

cmd_stop() {
  [[ -d $STATE ]] || { log "nothing to stop ($STATE does not exist)"; return 0; }
  exec 9>"$STATE/lock"
  flock -w 120 9 || die "another start/stop holds $STATE/lock"
  if [[ ! -s $PIDS ]]; then
    log "not running"
    return 0
  fi
  cancel_jobs
  stop_daemons
  log "stopped"
}

cmd_restart_node() {  # a node whose slurmd died (a node-failure test): its slurmd again, the node idle
  local node=${1:?restart-node needs a node name (bn1, bn2)} pid exe t0
  exec 9>"$STATE/lock"
  flock -w 120 9 || die "another start/stop holds $STATE/lock"
  read -r _ pid exe < <(grep "^slurmd-$node " "$PIDS" 2>/dev/null | tail -1) || die "no slurmd-$node in $PIDS"
  alive "$pid" "$exe" && { log "slurmd-$node ($pid) is running"; return 0; }
  grep -v "^slurmd-$node " "$PIDS" >"$PIDS.new" || true
  mv "$PIDS.new" "$PIDS"
  start_bg "slurmd-$node" "$(command -v slurmd)" "$STATE/log/slurmd-$node.out" "$(command -v slurmd)" -D -N "$node" -f "$CONF"
  t0=$SECONDS
  until sinfo -h -n "$node" -o '%t' 2>/dev/null | grep -qx idle; do
    ((SECONDS - t0 > 90)) && die "node $node not idle within 90s: $(sinfo -h -n "$node" -o '%t %E')"
    # ReturnToService=2 returns a DOWN node once its slurmd registers; a drained one needs RESUME
    sinfo -h -n "$node" -o '%t' 2>/dev/null | grep -q '^drain' && scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1
    sleep 0.5
  done
  log "slurmd-$node up again, node idle"
}

cmd_status() {
  if all_alive; then
    log "running in $STATE"
    recorded >&2
    sinfo -N -o '%N %t %c %P' >&2 || true
    print_env
    return 0
  fi
  if [[ -s $PIDS ]]; then
    log "partly running (some recorded daemons are gone):"
    local name pid exe
    while read -r name pid exe; do
      if alive "$pid" "$exe"; then log "  $name $pid up"; else log "  $name $pid gone"; fi
    done < <(recorded)
    return 2
  fi
  log "not running"
  return 1
}

case ${1:-} in
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  restart-node) shift; cmd_restart_node "$@" ;;
  *) echo "usage: $0 start [--nodes N] | stop | status | restart-node NODE" >&2; exit 64 ;;
esac
