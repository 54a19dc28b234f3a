# shellcheck shell=bash
# shellcheck disable=SC2034  # the variables set here are read by the scripts that source this file
# Sourced by every tpu_scripts/*.sh: one flag parser for all of them (so watch.sh can pass
# its own arguments on to create/setup/launch/delete), per-generation defaults, and the
# command runner behind --dry-run. Nothing here talks to the cloud by itself.

TPU_SCRIPTS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO_ROOT=$(cd "$TPU_SCRIPTS_DIR/.." && pwd)
SCRIPT_NAME=$(basename "$0")

NAME=""
ZONE=""
PROJECT=""
ACCEL=""
RUNTIME=""
SPOT=0
RESERVED=0
CONFIG=""
OUTPUT_DIR=""
REPO_URL=""
REF="main"
PYTHON_VERSION="3.12"
POLL_S=300
DELETE_WHEN_DONE=0
DELETE_ON_EXIT=0
FORCE=0
DRY_RUN=0
OVERRIDES=()
ORIG_ARGS=("$@")
# What the tarball of this checkout leaves out (setup.sh); a --config file in there is copied
# to the workers on its own (launch.sh). Entries starting with ./ are top-level folders.
TARBALL_EXCLUDES=(./.git ./.venv ./.ci-venv ./runs __pycache__ .pytest_cache '*.egg-info')
# Each script sets NEEDS (e.g. NEEDS=(type output_dir)) before parse_flags for its required flags.

# Dry-run lines go to the caller's stdout even from inside $(...).
exec 3>&1

COMMON_HELP="Common flags (every script accepts all of them; each uses what it needs):
  --name NAME             queued resource and TPU VM name (required), e.g. dspark-v5p
  --type TYPE             accelerator type: v5litepod-N (v5e), v5p-N or v6e-N
  --zone ZONE             default per generation: v5e us-west4-a, v5p us-east5-a, v6e us-east5-b
  --project PROJECT       default: gcloud's configured project
  --runtime-version V     default per generation: v2-alpha-tpuv5-lite, v2-alpha-tpuv5, v2-alpha-tpuv6e
  --spot                  spot capacity (cheaper, preemptible) through a queued resource
  --reserved              use a reservation (not with --spot)
  --config CONFIG         training preset or YAML path passed to python -m dspark_jax.train; a local
                          file outside the tarball of this checkout is copied to every worker
  --output-dir gs://...   train.output_dir: checkpoints, drafter export, logs
  --repo-url URL          install from this git URL (default: a tarball of this checkout)
  --ref REF               git branch, tag or commit with --repo-url (default: main)
  --python VERSION        Python installed on the workers with uv (default: 3.12; >= 3.11)
  --poll SECONDS          watch.sh: seconds between state checks (default: 300)
  --delete-when-done      watch.sh: delete the TPU once training has finished
  --delete-on-exit        watch.sh: delete the TPU once the job has ended, finished or failed
  --force                 setup.sh: install even while a training job runs on the workers
  --dry-run               print the commands ('+ ' prefix), run nothing
  -h, --help              this help
  section.key=value ...   extra training overrides (train.output_dir comes from --output-dir)"

die() {
  echo "$SCRIPT_NAME: error: $*" >&2
  exit 2
}

usage() {
  printf '%s\n\n%s\n' "$USAGE" "$COMMON_HELP"
}

# Shell-quote one word only when it needs it, so the printed line can be pasted back.
shquote() {
  local s=$1
  if [[ $s =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

cmdline() {
  local out="" w
  for w in "$@"; do
    out+="${out:+ }$(shquote "$w")"
  done
  printf '%s' "$out"
}

# Run a command that changes something; with --dry-run only print it.
run() {
  if ((DRY_RUN)); then
    echo "+ $(cmdline "$@")" >&3
    return 0
  fi
  echo "+ $(cmdline "$@")" >&2
  "$@"
}

# query DRY_VALUE CMD...: print a read-only command's stdout ("" when it fails).
# With --dry-run it prints the command and answers DRY_VALUE instead of running it.
query() {
  local dry_value=$1
  shift
  if ((DRY_RUN)); then
    echo "+ $(cmdline "$@")" >&3
    printf '%s' "$dry_value"
    return 0
  fi
  "$@" 2>/dev/null || true
}

parse_flags() {
  local key val inline
  while (($#)); do
    if [[ $1 == --*=* ]]; then
      key=${1%%=*}
      val=${1#*=}
      inline=1
    else
      key=$1
      val=""
      inline=0
    fi
    case $key in
      -h | --help)
        usage
        exit 0
        ;;
      --dry-run | --spot | --reserved | --delete-when-done | --delete-on-exit | --force)
        ((inline)) && die "$key takes no value"
        case $key in
          --dry-run) DRY_RUN=1 ;;
          --spot) SPOT=1 ;;
          --reserved) RESERVED=1 ;;
          --delete-when-done) DELETE_WHEN_DONE=1 ;;
          --delete-on-exit) DELETE_ON_EXIT=1 ;;
          --force) FORCE=1 ;;
        esac
        shift
        continue
        ;;
      --name | --type | --accelerator-type | --zone | --project | --runtime-version | --config | \
        --output-dir | --repo-url | --ref | --python | --poll)
        if ((!inline)); then
          (($# >= 2)) && [[ $2 != --* ]] || die "$key needs a value"
          val=$2
          shift
        fi
        shift
        [[ -n $val ]] || die "$key needs a non-empty value"
        case $key in
          --name) NAME=$val ;;
          --type | --accelerator-type) ACCEL=$val ;;
          --zone) ZONE=$val ;;
          --project) PROJECT=$val ;;
          --runtime-version) RUNTIME=$val ;;
          --config) CONFIG=$val ;;
          --output-dir) OUTPUT_DIR=${val%/} ;;
          --repo-url) REPO_URL=$val ;;
          --ref) REF=$val ;;
          --python) PYTHON_VERSION=$val ;;
          --poll) POLL_S=$val ;;
        esac
        continue
        ;;
      -*) die "unknown flag '$1' (see --help)" ;;
      *=*)
        [[ $1 =~ ^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*= ]] ||
          die "override '$1' is not section.key=value"
        [[ $1 != train.output_dir=* ]] || die "set the output directory with --output-dir, not train.output_dir="
        OVERRIDES+=("$1")
        shift
        ;;
      *) die "unexpected argument '$1': overrides look like section.key=value (see --help)" ;;
    esac
  done
  validate_flags
}

# Defaults that depend on the TPU generation, and checks every script shares.
validate_flags() {
  [[ -n $NAME ]] || die "--name is required (e.g. --name dspark-v5p)"
  [[ $NAME =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    die "--name '$NAME' must be lowercase letters, digits and '-', starting with a letter"
  local gen_zone="" gen_runtime=""
  if [[ -n $ACCEL ]]; then
    case $ACCEL in
      v5litepod-[0-9]*) gen_zone=us-west4-a gen_runtime=v2-alpha-tpuv5-lite ;;
      v5p-[0-9]*) gen_zone=us-east5-a gen_runtime=v2-alpha-tpuv5 ;;
      v6e-[0-9]*) gen_zone=us-east5-b gen_runtime=v2-alpha-tpuv6e ;;
    esac
    [[ $ACCEL =~ ^(v5litepod|v5p|v6e)-[0-9]+$ && -n $gen_zone ]] ||
      die "--type '$ACCEL' is not supported: use v5litepod-N (v5e), v5p-N or v6e-N, e.g. v5p-64"
  fi
  local need
  for need in ${NEEDS[@]+"${NEEDS[@]}"}; do
    "require_$need"
  done
  [[ -n $ZONE ]] || ZONE=$gen_zone
  [[ -n $RUNTIME ]] || RUNTIME=$gen_runtime
  [[ -n $ZONE ]] || die "--zone is required (or pass --type to use that generation's default zone)"
  ((!(SPOT && RESERVED))) || die "--spot and --reserved exclude each other: choose one"
  [[ $POLL_S =~ ^[1-9][0-9]*$ ]] || die "--poll '$POLL_S' must be a positive number of seconds"
  [[ $PYTHON_VERSION =~ ^3\.(1[1-9]|[2-9][0-9])$ ]] ||
    die "--python '$PYTHON_VERSION' must be 3.11 or newer (e.g. 3.12)"
  if [[ -n $OUTPUT_DIR && $OUTPUT_DIR != gs://?* ]]; then
    die "--output-dir '$OUTPUT_DIR' must be a gs:// path (every worker and every relaunch must see it)"
  fi
}

require_type() {
  [[ -n $ACCEL ]] || die "--type is required (v5litepod-N, v5p-N or v6e-N, e.g. --type v5p-64)"
}

require_output_dir() {
  [[ -n $OUTPUT_DIR ]] || die "--output-dir is required (a gs:// path, e.g. --output-dir gs://my-bucket/runs/dspark)"
}

# --zone/--project as gcloud wants them, in a fixed order.
location_flags() {
  LOC=(--zone="$ZONE")
  [[ -z $PROJECT ]] || LOC+=(--project="$PROJECT")
}

qr_state() {
  location_flags
  query "${1-}" gcloud compute tpus queued-resources describe "$NAME" "${LOC[@]}" '--format=value(state.state)'
}

info() {
  echo "$SCRIPT_NAME: $*" >&2
}

# What `worker.sh status` printed on the workers (one line each; gcloud may add prefixes):
#   dspark-job worker=N state=none|running|exited|lost [code=C]
# Sets JOB_RUNNING (the workers whose job runs), JOB_DONE (how many exited with 0) and, for the
# first worker whose job failed (a nonzero exit code, or gone without one: killed), JOB_FAILED
# (its worker id, "" when none failed), JOB_CODE (its exit code; 1 for a lost job) and JOB_WHY.
parse_job_status() {
  local re='dspark-job worker=([^ ]+) state=([a-z]+)( code=([0-9]+))?' line w state code lost=""
  JOB_RUNNING=() JOB_DONE=0 JOB_FAILED="" JOB_CODE=0 JOB_WHY=""
  while IFS= read -r line; do
    [[ $line =~ $re ]] || continue
    w=${BASH_REMATCH[1]} state=${BASH_REMATCH[2]} code=${BASH_REMATCH[4]:-1}
    case $state in
      running) JOB_RUNNING+=("$w") ;;
      exited)
        if ((code == 0)); then
          JOB_DONE=$((JOB_DONE + 1))
        elif [[ -z $JOB_FAILED ]]; then
          JOB_FAILED=$w JOB_CODE=$code JOB_WHY="exit code $code"
        fi
        ;;
      lost) [[ -n $lost ]] || lost=$w ;;
    esac
  done <<<"$1"
  if [[ -z $JOB_FAILED && -n $lost ]]; then
    JOB_FAILED=$lost JOB_CODE=1 JOB_WHY="no exit code: the job was killed, or the VM restarted"
  fi
}
