#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Install Python >= 3.11, a virtual environment and dspark_jax[tpu] on every worker.
# Idempotent: rerunning it (e.g. after a relaunch) only does what is missing.
set -euo pipefail
USAGE="usage: tpu_scripts/setup.sh --name NAME (--zone Z | --type TYPE) [--project P]
                          [--repo-url URL [--ref REF]] [--python 3.12] [--dry-run]

Copies tpu_scripts/worker.sh to every worker and runs 'worker.sh setup' there (all workers at
once): uv (a single static binary) installs a standalone CPython --python next to the image's
own Python 3.10, creates ~/dspark_venv and runs pip install -e '~/dspark_jax[tpu]'.
The code is a tarball of this checkout (what you see is what runs, uncommitted edits included),
or a git clone of --repo-url at --ref."
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
  run tar -czf "$tarball" --exclude=./.git --exclude=./.venv --exclude=./.ci-venv --exclude=./runs \
    --exclude=__pycache__ --exclude=.pytest_cache --exclude='*.egg-info' -C "$REPO_ROOT" .
  files=("$tarball" "${files[@]}")
  worker_args+=(--tarball "/tmp/$(basename "$tarball")")
fi
run gcloud compute tpus tpu-vm scp "${files[@]}" "$NAME:/tmp/" --worker=all "${LOC[@]}"
run gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOC[@]}" \
  --command="bash /tmp/worker.sh $(cmdline "${worker_args[@]}")"
