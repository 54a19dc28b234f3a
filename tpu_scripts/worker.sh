#!/usr/bin/env bash
# Runs ON each TPU VM worker (setup.sh and launch.sh call it over gcloud ssh); not on your
# workstation. Subcommands:
#   setup  [--python 3.12] (--tarball FILE | --repo-url URL [--ref REF])
#   launch --output-dir gs://... [--config CONFIG] [-- section.key=value ...]
# Everything lives in $HOME: dspark_jax/ (code), dspark_venv/, dspark_data/ (gs:// inputs
# copied locally), dspark_run/ (pid, logs, exit code).
set -euo pipefail

SRC="$HOME/dspark_jax"
VENV="$HOME/dspark_venv"
DATA_DIR="$HOME/dspark_data"
RUN_DIR="$HOME/dspark_run"
SELF=$(readlink -f "${BASH_SOURCE[0]}")

worker_id() {
  curl -fs -m 2 -H 'Metadata-Flavor: Google' \
    http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number 2>/dev/null ||
    hostname
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
  local py=3.12 tarball="" repo_url="" ref=main
  while (($#)); do
    case $1 in
      --python) py=$2 ;;
      --tarball) tarball=$2 ;;
      --repo-url) repo_url=$2 ;;
      --ref) ref=$2 ;;
      *) die "setup: unknown argument '$1'" ;;
    esac
    shift 2
  done
  [[ -n $tarball || -n $repo_url ]] || die "setup needs --tarball or --repo-url"
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
  if [[ -f $RUN_DIR/train.pid ]] && kill -0 "$(cat "$RUN_DIR/train.pid")" 2>/dev/null; then
    log "training already running (pid $(cat "$RUN_DIR/train.pid")); not starting another"
    return 0
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
  local stamp log_file
  stamp=$(date -u +%Y%m%dT%H%M%SZ)
  log_file="$RUN_DIR/train-$stamp.log"
  # shellcheck disable=SC2094  # the log path is an argument of _run, which only hands it to gcloud
  setsid nohup bash "$SELF" _run "$out" "$log_file" "$stamp" "${args[@]}" >"$log_file" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$RUN_DIR/train.pid"
  log "started (pid $pid): log $log_file, copied to $out/logs/$stamp-worker-$WORKER_ID.log"
}

# The background job: training plus a loop that copies the log to gs:// every minute.
# SIGTERM (preemption) is passed on to Python, which checkpoints and exits; then the log is
# copied one last time.
cmd_run() {
  local out=$1 log_file=$2 stamp=$3
  shift 3
  local dest="$out/logs/$stamp-worker-$WORKER_ID.log" rc=0 py uploader
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
  local interrupted=1
  trap 'interrupted=1; kill -TERM "$py" 2>/dev/null || true' TERM INT
  while ((interrupted)); do # a trap ends wait early: wait again while Python checkpoints
    interrupted=0
    rc=0
    wait "$py" || rc=$?
  done
  echo "training exited with code $rc"
  echo "$rc" >"$RUN_DIR/exit_code"
  kill "$uploader" 2>/dev/null || true
  upload
}

case ${1-} in
  setup) shift && cmd_setup "$@" ;;
  launch) shift && cmd_launch "$@" ;;
  _run) shift && cmd_run "$@" ;;
  *) die "usage: worker.sh setup|launch ... (run by tpu_scripts/setup.sh and launch.sh over gcloud ssh)" ;;
esac
