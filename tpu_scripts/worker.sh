#!/usr/bin/env bash
# Runs ON each TPU VM worker (setup.sh and launch.sh call it over gcloud ssh); not on your
# workstation. Subcommands:
#   setup  [--python 3.12] (--tarball FILE | --repo-url URL [--ref REF]) [--force]
#   launch --output-dir gs://... [--config CONFIG] [-- section.key=value ...]
#   status            one line: dspark-job worker=N state=none|running|exited|lost [code=C]
#   tail [LINES]      the end of the newest training log
# Everything lives in $HOME: dspark_jax/ (code), dspark_venv/, dspark_data/ (gs:// inputs
# copied locally), dspark_run/ (pid, logs, exit code).
set -euo pipefail

SRC="$HOME/dspark_jax"
VENV="$HOME/dspark_venv"
DATA_DIR="$HOME/dspark_data"
RUN_DIR="$HOME/dspark_run"
SELF=$(readlink -f "${BASH_SOURCE[0]}")

# One attribute of this TPU VM from the GCE metadata server (fails off Cloud TPU).
metadata() {
  curl -fs -m 2 -H 'Metadata-Flavor: Google' \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1" 2>/dev/null
}

worker_id() {
  metadata agent-worker-number || hostname
}
WORKER_ID=${DSPARK_WORKER_ID:-$(worker_id)}

log() { echo "[worker $WORKER_ID] $*" >&2; }
die() {
  log "error: $*"
  exit 2
}

# uv is one static binary; it installs a standalone CPython build (python-build-standalone),
# so neither the image's Python 3.10, apt/deadsnakes (PPA availability varies by Ubuntu
# release) nor a compiler (pyenv) matters, and nothing touches the system Python.
ensure_uv() {
  export PATH="$HOME/.local/bin:$PATH"
  if ! command -v uv >/dev/null; then
    log "installing uv"
    python3 -m pip install --user --quiet uv ||
      curl -LsSf https://astral.sh/uv/install.sh | env UV_UNMANAGED_INSTALL="$HOME/.local/bin" sh
  fi
  command -v uv >/dev/null || die "uv could not be installed"
}

# Is the job launch started still running? Its pid must be alive and still be our wrapper
# (a pid file that survived a reboot can name an unrelated process).
job_alive() {
  local pid
  [[ -f $RUN_DIR/train.pid ]] || return 1
  pid=$(<"$RUN_DIR/train.pid")
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  [[ ! -r /proc/$pid/cmdline ]] || tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q 'worker.sh _run '
}

# How the job stands, as one line that setup.sh and watch.sh parse (parse_job_status in
# common.sh). The exit code is written when Python ends (cmd_run) and removed by launch.
cmd_status() {
  local line="dspark-job worker=$WORKER_ID"
  if [[ -f $RUN_DIR/exit_code ]]; then
    echo "$line state=exited code=$(tr -dc 0-9 <"$RUN_DIR/exit_code")"
  elif job_alive; then
    echo "$line state=running pid=$(<"$RUN_DIR/train.pid")"
  elif [[ -f $RUN_DIR/train.pid ]]; then
    echo "$line state=lost" # killed before it could write its exit code
  else
    echo "$line state=none"
  fi
}

cmd_tail() {
  local logs=("$RUN_DIR"/train-*.log) # UTC stamps: the last one is the newest
  [[ -f ${logs[-1]} ]] || die "no training log in $RUN_DIR"
  echo "== worker $WORKER_ID: ${logs[-1]}"
  tail -n "${1:-50}" "${logs[-1]}"
}

# A multi-host slice needs jax.distributed. On GKE the pod environment names the workers
# (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID); on a plain TPU VM reached with gcloud ssh nothing in
# the environment does, and dspark_jax only starts jax.distributed when TPU_WORKER_HOSTNAMES or
# JAX_COORDINATOR_ADDRESS is set. So read what JAX's own GCE detection reads from the metadata
# server (worker-network-endpoints, agent-worker-number) and export it explicitly: coordinator
# = worker 0 on JAX's TPU port 8482, process count = number of workers, process id = this
# worker's number. Single host, or values already set: nothing is exported.
multihost_env() {
  [[ -z ${JAX_COORDINATOR_ADDRESS-} && -z ${TPU_WORKER_HOSTNAMES-} ]] || return 0
  local endpoints id entry coordinator=""
  local -a eps
  endpoints=$(metadata worker-network-endpoints) || return 0
  id=$(metadata agent-worker-number) || return 0
  IFS=, read -ra eps <<<"$endpoints"
  ((${#eps[@]} > 1)) || return 0
  if [[ ! $id =~ ^[0-9]+$ ]] || ((id >= ${#eps[@]})); then
    die "agent-worker-number '$id' does not fit ${#eps[@]} workers"
  fi
  # Entries are NAME:ID:IP (older images) or a hostname, listed in worker order.
  for entry in "${eps[@]}"; do
    if [[ $entry == *:*:* && ${entry#*:} == 0:* ]]; then
      coordinator=${entry##*:}
    fi
  done
  [[ -n $coordinator ]] || coordinator=${eps[0]##*:}
  export JAX_COORDINATOR_ADDRESS="$coordinator:8482" JAX_NUM_PROCESSES=${#eps[@]} JAX_PROCESS_ID=$id
  log "multi-host: process $id of ${#eps[@]}, coordinator $JAX_COORDINATOR_ADDRESS (TPU metadata server)"
}

fetch_source() {
  local tarball=$1 repo_url=$2 ref=$3
  if [[ -n $tarball ]]; then
    # Replace the tree as a whole so files deleted locally disappear here too.
    rm -rf "$SRC.new"
    mkdir -p "$SRC.new"
    tar -xzf "$tarball" -C "$SRC.new"
    rm -rf "$SRC"
    mv "$SRC.new" "$SRC"
  else
    if [[ ! -d $SRC/.git ]]; then
      rm -rf "$SRC"
      git clone --quiet "$repo_url" "$SRC"
    fi
    git -C "$SRC" remote set-url origin "$repo_url"
    git -C "$SRC" fetch --quiet --tags origin
    git -C "$SRC" checkout --quiet --detach "origin/$ref" 2>/dev/null ||
      git -C "$SRC" checkout --quiet --detach "$ref"
  fi
}

cmd_setup() {
  local py=3.12 tarball="" repo_url="" ref=main force=0
  while (($#)); do
    case $1 in
      --force)
        force=1
        shift
        continue
        ;;
      --python) py=$2 ;;
      --tarball) tarball=$2 ;;
      --repo-url) repo_url=$2 ;;
      --ref) ref=$2 ;;
      *) die "setup: unknown argument '$1'" ;;
    esac
    shift 2
  done
  [[ -n $tarball || -n $repo_url ]] || die "setup needs --tarball or --repo-url"
  # Replacing ~/dspark_jax and reinstalling under a live job would hand it new code at its
  # next import (setup.sh checks all workers first; this is the same check per worker).
  if ((!force)) && job_alive; then
    die "training is running here (pid $(<"$RUN_DIR/train.pid")): wait for it to end, stop it (kill $(<"$RUN_DIR/train.pid")), or pass --force"
  fi
  ensure_uv
  uv python install "$py"
  fetch_source "$tarball" "$repo_url" "$ref"
  if ! "$VENV/bin/python" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$py'.split('.'))))" 2>/dev/null; then
    rm -rf "$VENV"
    uv venv --seed --python "$py" "$VENV"
  fi
  # jax[tpu] pulls libtpu matching the jax pinned in pyproject.toml.
  uv pip install --python "$VENV/bin/python" -e "${SRC}[tpu]"
  "$VENV/bin/python" -c 'import sys, jax, dspark_jax; print("python", sys.version.split()[0], "jax", jax.__version__)'
  log "setup done"
}

# Copy a gs:// input (object or folder) to local disk once; print the local path.
stage() {
  local url=$1 dest="$DATA_DIR/${1#gs://}"
  if gcloud storage objects describe "$url" >/dev/null 2>&1; then
    mkdir -p "$(dirname "$dest")"
    gcloud storage cp "$url" "$dest" >&2
  else
    mkdir -p "$dest"
    gcloud storage rsync --recursive "$url" "$dest" >&2
  fi
  printf '%s' "$dest"
}

cmd_launch() {
  local out="" config="" o key value pid
  local args=()
  while (($#)); do
    case $1 in
      --output-dir) out=$2 ;;
      --config) config=$2 ;;
      --)
        shift
        break
        ;;
      *) die "launch: unknown argument '$1'" ;;
    esac
    shift 2
  done
  [[ -n $out ]] || die "launch needs --output-dir"
  [[ -x $VENV/bin/python ]] || die "no $VENV: run tpu_scripts/setup.sh first"
  mkdir -p "$RUN_DIR"
  if job_alive; then
    log "training already running (pid $(<"$RUN_DIR/train.pid")); not starting another"
    return 0
  fi
  # launch.sh copies a config from outside the code tarball to ~/ and passes '~/NAME'.
  # shellcheck disable=SC2088  # the literal ~/ prefix is what is matched here
  if [[ $config == "~/"* ]]; then
    config=$HOME/${config#"~/"}
  elif [[ $config == gs://* ]]; then
    log "copying $config to local disk"
    config=$(stage "$config")
  fi
  [[ -z $config ]] || args+=("$config")
  for o in "$@"; do
    key=${o%%=*}
    value=${o#*=}
    if [[ $value == gs://* ]]; then
      log "copying $value to local disk"
      args+=("$key=$(stage "$value")")
    else
      args+=("$o")
    fi
  done
  args+=("train.output_dir=$out")
  multihost_env
  local stamp log_file
  stamp=$(date -u +%Y%m%dT%H%M%SZ)
  log_file="$RUN_DIR/train-$stamp.log"
  # Only the job started now may leave these (watch.sh reads the exit code).
  rm -f "$RUN_DIR/exit_code" "$RUN_DIR/train.pid"
  # shellcheck disable=SC2094  # the log path is an argument of _run, which only hands it to gcloud
  setsid nohup bash "$SELF" _run "$out" "$log_file" "$stamp" "${args[@]}" >"$log_file" 2>&1 </dev/null &
  # The job writes its pid once it traps SIGTERM; from then on a preemption reaches Python
  # and the job ends with an exit code. Return only then.
  local i
  for ((i = 0; i < 300; i++)); do
    [[ ! -s $RUN_DIR/train.pid ]] || break
    sleep 0.1
  done
  [[ -s $RUN_DIR/train.pid ]] || die "the training job did not start: see $log_file"
  pid=$(<"$RUN_DIR/train.pid")
  log "started (pid $pid): log $log_file, copied to $out/logs/$stamp-worker-$WORKER_ID.log"
}

# The background job: training plus a loop that copies the log to gs:// every minute.
# SIGTERM (preemption) is passed on to Python, which checkpoints and exits; then the log is
# copied one last time.
cmd_run() {
  local out=$1 log_file=$2 stamp=$3
  shift 3
  local dest="$out/logs/$stamp-worker-$WORKER_ID.log" rc=0 py="" uploader stopping=0 interrupted=1
  # Trapped from the start, so that a SIGTERM arriving before Python runs still reaches it
  # and the job still leaves an exit code.
  trap 'stopping=1 interrupted=1; [[ -z $py ]] || kill -TERM "$py" 2>/dev/null || true' TERM INT
  echo "$$" >"$RUN_DIR/train.pid.tmp"
  mv -f "$RUN_DIR/train.pid.tmp" "$RUN_DIR/train.pid"
  upload() { gcloud storage cp --quiet "$log_file" "$dest" >/dev/null 2>&1 || true; }
  (
    trap 'kill "$!" 2>/dev/null; exit 0' TERM
    while :; do
      sleep 60 &
      wait "$!"
      upload
    done
  ) &
  uploader=$!
  cd "$SRC"
  echo "+ python -m dspark_jax.train $*"
  PYTHONUNBUFFERED=1 "$VENV/bin/python" -m dspark_jax.train "$@" &
  py=$!
  ((!stopping)) || kill -TERM "$py" 2>/dev/null || true
  while ((interrupted)); do # a trap ends wait early: wait again while Python checkpoints
    interrupted=0
    rc=0
    wait "$py" || rc=$?
  done
  echo "training exited with code $rc"
  echo "$rc" >"$RUN_DIR/exit_code.tmp" # whole or absent for status readers
  mv -f "$RUN_DIR/exit_code.tmp" "$RUN_DIR/exit_code"
  kill "$uploader" 2>/dev/null || true
  upload
}

case ${1-} in
  setup) shift && cmd_setup "$@" ;;
  launch) shift && cmd_launch "$@" ;;
  status) cmd_status ;;
  tail) shift && cmd_tail "$@" ;;
  _run) shift && cmd_run "$@" ;;
  *) die "usage: worker.sh setup|launch|status|tail ... (run by tpu_scripts/*.sh over gcloud ssh)" ;;
esac
