#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Install Python >= 3.11, a virtual environment and dspark_jax[tpu] on every worker.
# Idempotent: rerunning it (e.g. after a relaunch) only does what is missing.
set -euo pipefail
USAGE="usage: tpu_scripts/setup.sh --name NAME (--zone Z | --type TYPE) [--project P]
                          [--repo-url URL [--ref REF]] [--python 3.12] [--force] [--dry-run]

Copies tpu_scripts/worker.sh to every worker and runs 'worker.sh setup' there (all workers at
once): uv (a single static binary) installs a standalone CPython --python next to the image's
own Python 3.10, creates ~/dspark_venv and runs pip install -e '~/dspark_jax[tpu]'.
The code is a tarball of this checkout (what you see is what runs, uncommitted edits included),
or a git clone of --repo-url at --ref.
Refuses, before changing anything, while a training job runs on any worker (its code would be
swapped under it): wait for it to end, stop it, or pass --force (the next launch runs the new
code; the running job may import some of it)."
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_flags "$@"
location_flags

worker_args=(setup --python "$PYTHON_VERSION")
files=("$TPU_SCRIPTS_DIR/worker.sh")
if [[ -n $REPO_URL ]]; then
  worker_args+=(--repo-url "$REPO_URL" --ref "$REF")
else
  tarball="/tmp/dspark_jax-src-$NAME.tar.gz"
  excludes=()
  for e in "${TARBALL_EXCLUDES[@]}"; do
    excludes+=("--exclude=$e")
  done
  run tar -czf "$tarball" "${excludes[@]}" -C "$REPO_ROOT" .
  files=("$tarball" "${files[@]}")
  worker_args+=(--tarball "/tmp/$(basename "$tarball")")
fi
# Only /tmp is written so far; the new worker.sh tells whether a job runs on any worker.
run gcloud compute tpus tpu-vm scp "${files[@]}" "$NAME:/tmp/" --worker=all "${LOC[@]}"
if ((FORCE)); then
  worker_args+=(--force)
else
  parse_job_status "$(query "" gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOC[@]}" \
    --command="bash /tmp/worker.sh status")"
  if ((${#JOB_RUNNING[@]})); then
    # shellcheck disable=SC2016  # $(...) runs on the workers
    stop=$(cmdline gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOC[@]}" '--command=kill $(cat dspark_run/train.pid)')
    die "training is running on worker(s) ${JOB_RUNNING[*]} of '$NAME' and setup would swap its code: wait for it to end, stop it ($stop: it checkpoints and exits), or rerun with --force"
  fi
fi
run gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOC[@]}" \
  --command="bash /tmp/worker.sh $(cmdline "${worker_args[@]}")"
