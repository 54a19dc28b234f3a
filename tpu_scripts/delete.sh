#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Delete the queued resource and its TPU VMs. Idempotent: nothing to delete is not an error.
# The gs:// output directory (checkpoints, logs) is never touched.
set -euo pipefail
USAGE="usage: tpu_scripts/delete.sh --name NAME (--zone Z | --type TYPE) [--project P] [--dry-run]

Deletes queued resource NAME together with its TPU VM(s) (--force) and waits until it is gone.
Checkpoints and logs under --output-dir stay in Cloud Storage.
--dry-run prints the commands for the case where the queued resource exists."
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_flags "$@"
location_flags

state=$(qr_state ACTIVE)
if [[ -z $state ]]; then
  info "queued resource '$NAME' does not exist in $ZONE; nothing to delete"
  exit 0
fi
run gcloud compute tpus queued-resources delete "$NAME" "${LOC[@]}" --force --quiet
