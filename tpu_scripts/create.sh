#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Create a TPU VM or pod slice through a queued resource (on-demand, --spot or --reserved)
# and wait until it is ACTIVE. Idempotent: an existing queued resource is reused.
set -euo pipefail
USAGE="usage: tpu_scripts/create.sh --name NAME --type TYPE [--zone Z] [--project P] [--spot|--reserved] [--dry-run]

Creates queued resource NAME holding one TPU VM (or pod slice) of the same name, then waits
until it is ACTIVE (spot capacity may queue for a while). Describes it first: when it already
exists and is queued or ACTIVE, nothing is created. A SUSPENDED/FAILED one (preempted spot)
is an error: run watch.sh (which recreates it) or delete.sh first.
--dry-run prints the commands for the case where nothing exists yet."
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NEEDS=(type)
parse_flags "$@"
location_flags

state=$(qr_state "")
case $state in
  "")
    capacity=()
    ((SPOT)) && capacity=(--spot)
    ((RESERVED)) && capacity=(--reserved)
    run gcloud compute tpus queued-resources create "$NAME" --node-id="$NAME" "${LOC[@]}" \
      --accelerator-type="$ACCEL" --runtime-version="$RUNTIME" ${capacity[@]+"${capacity[@]}"}
    ;;
  SUSPENDED | SUSPENDING | FAILED)
    die "queued resource '$NAME' exists in state $state (preempted or failed): run tpu_scripts/watch.sh to recreate it, or tpu_scripts/delete.sh"
    ;;
  *) info "queued resource '$NAME' already exists ($state); not creating it" ;;
esac

# Wait for capacity: ACCEPTED / WAITING_FOR_RESOURCES / PROVISIONING -> ACTIVE.
while true; do
  state=$(qr_state ACTIVE)
  case $state in
    ACTIVE) break ;;
    FAILED | SUSPENDED | SUSPENDING | "") die "queued resource '$NAME' is ${state:-gone} instead of ACTIVE: see gcloud compute tpus queued-resources describe $NAME --zone=$ZONE" ;;
    *)
      info "waiting for '$NAME' ($state)"
      sleep 30
      ;;
  esac
done
info "'$NAME' is ACTIVE"
