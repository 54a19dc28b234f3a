#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Start the same training command on every worker, in the background (nohup), logging to a
# file on each worker that is copied to <output-dir>/logs/ every minute.
set -euo pipefail
USAGE="usage: tpu_scripts/launch.sh --name NAME (--zone Z | --type TYPE) --output-dir gs://BUCKET/PATH
                           [--config CONFIG] [--project P] [section.key=value ...] [--dry-run]

Runs on all workers at once: python -m dspark_jax.train [CONFIG] OVERRIDES train.output_dir=OUTPUT_DIR.
Nothing multi-host has to be passed: on a pod slice every worker runs the same command;
worker.sh reads the worker list and this worker's number from the TPU metadata server and
exports JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, with which dspark_jax
starts jax.distributed; the global batch is split across hosts.
CONFIG: a preset name, a path in the code on the workers, or a local file; a local file that is
not in the tarball setup.sh ships (outside this checkout, in runs/, or with --repo-url) is
copied to ~/dspark_config-NAME on every worker and that path is passed instead.
Overrides whose value is a gs:// path (data.path, data.heldout_path, target.path, data.prompts)
are copied to local disk on each worker first (datasets are memory-mapped).
Idempotent: a worker whose training is still running is left alone. A relaunch with the same
--output-dir resumes from the latest checkpoint there (train.resume=true by default)."
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NEEDS=(output_dir)
parse_flags "$@"
location_flags

# Is REL (a path relative to the checkout) in the tarball setup.sh makes?
in_tarball() {
  local e part
  local -a parts
  IFS=/ read -ra parts <<<"$1"
  for e in "${TARBALL_EXCLUDES[@]}"; do
    if [[ $e == ./* ]]; then
      [[ ${parts[0]} != "${e#./}" ]] || return 1
    else
      for part in "${parts[@]}"; do
        # shellcheck disable=SC2053  # $e is a glob on purpose ('*.egg-info')
        [[ $part != $e ]] || return 1
      done
    fi
  done
}

# Sets WORKER_CONFIG, the --config the workers get. Not a local file: unchanged (a preset, or a path on the workers,
# resolved in ~/dspark_jax). A local file in the tarball: its path in the checkout. Any other
# local file: copied to every worker's home, passed as ~/dspark_config-BASENAME.
worker_config() {
  local abs rel base parent preset
  WORKER_CONFIG=$CONFIG
  [[ -f $CONFIG ]] || return 0
  abs="$(cd "$(dirname "$CONFIG")" && pwd -P)/$(basename "$CONFIG")"
  rel=${abs#"$REPO_ROOT"/}
  if [[ -z $REPO_URL && $rel != "$abs" ]] && in_tarball "$rel"; then
    WORKER_CONFIG=$rel
    return 0
  fi
  base=$(basename "$abs")
  base="dspark_config-${base//[^A-Za-z0-9._-]/_}"
  run gcloud compute tpus tpu-vm scp "$abs" "$NAME:$base" --worker=all "${LOC[@]}"
  # Only this file is copied: a parent it inherits must be a preset the workers have.
  parent=$(sed -n 's/^inherit:[[:space:]]*//p' "$abs" | tr -d "\"'" | head -n 1)
  parent=${parent%%[[:space:]#]*}
  if [[ -n $parent ]]; then
    preset=$(basename "$parent")
    [[ $preset == *.yaml || $preset == *.yml ]] || preset+=.yaml
    [[ -f $REPO_ROOT/configs/$preset ]] ||
      info "warning: $CONFIG inherits '$parent', which is not a preset in configs/: only $CONFIG itself is copied to the workers"
  fi
  # shellcheck disable=SC2088  # a literal ~/: worker.sh expands it on the worker
  WORKER_CONFIG="~/$base"
}

worker_args=(launch --output-dir "$OUTPUT_DIR")
if [[ -n $CONFIG ]]; then
  worker_config
  worker_args+=(--config "$WORKER_CONFIG")
fi
((${#OVERRIDES[@]} == 0)) || worker_args+=(-- "${OVERRIDES[@]}")
run gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOC[@]}" \
  --command="bash dspark_jax/tpu_scripts/worker.sh $(cmdline "${worker_args[@]}")"
