#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Start the same training command on every worker, in the background (nohup), logging to a
# file on each worker that is copied to <output-dir>/logs/ every minute.
set -euo pipefail
USAGE="usage: tpu_scripts/launch.sh --name NAME (--zone Z | --type TYPE) --output-dir gs://BUCKET/PATH
                           [--config CONFIG] [--project P] [section.key=value ...] [--dry-run]

Runs on all workers at once: python -m dspark_jax.train [CONFIG] OVERRIDES train.output_dir=OUTPUT_DIR.
Nothing multi-host has to be passed: on a pod slice every worker runs the same command and
dspark_jax joins them with jax.distributed.initialize(); the global batch is split across hosts.
Overrides whose value is a gs:// path (data.path, data.heldout_path, target.path, data.prompts)
are copied to local disk on each worker first (datasets are memory-mapped).
Idempotent: a worker whose training is still running is left alone. A relaunch with the same
--output-dir resumes from the latest checkpoint there (train.resume=true by default)."
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NEEDS=(output_dir)
parse_flags "$@"
location_flags

worker_args=(launch --output-dir "$OUTPUT_DIR")
[[ -z $CONFIG ]] || worker_args+=(--config "$CONFIG")
((${#OVERRIDES[@]} == 0)) || worker_args+=(-- "${OVERRIDES[@]}")
run gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOC[@]}" \
  --command="bash dspark_jax/tpu_scripts/worker.sh $(cmdline "${worker_args[@]}")"
