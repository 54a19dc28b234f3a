#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Keep a training run alive on spot (or any) capacity: create + set up + launch, then poll the
# queued resource; when it was preempted (SUSPENDED/FAILED/gone), delete it, recreate it and
# set up + launch again. Training resumes from the latest checkpoint in --output-dir.
set -euo pipefail
USAGE="usage: tpu_scripts/watch.sh --name NAME --type TYPE --output-dir gs://BUCKET/PATH [--spot]
                          [--config CONFIG] [--poll 300] [--delete-when-done] [section.key=value ...]
                          [--dry-run]

Runs in the foreground until training has finished (<output-dir>/summary.json says
\"preempted\": false); run it in tmux/screen or with nohup on a small always-on machine.
Every step is one of the idempotent scripts (create.sh, setup.sh, launch.sh, delete.sh) called
with the same flags. --dry-run prints one cycle: bring-up, one poll, and the recovery that a
preempted queued resource triggers."
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NEEDS=(type output_dir)
parse_flags "$@"
location_flags

step() {
  "$TPU_SCRIPTS_DIR/$1" ${ORIG_ARGS[@]+"${ORIG_ARGS[@]}"}
}

bring_up() {
  step create.sh
  step setup.sh
  step launch.sh
}

finished() {
  local summary
  summary=$(query "" gcloud storage cat "$OUTPUT_DIR/summary.json")
  [[ $summary == *'"preempted": false'* ]]
}

bring_up
while true; do
  state=$(qr_state SUSPENDED)
  case $state in
    ACTIVE)
      if finished; then
        info "training finished: $OUTPUT_DIR/summary.json"
        ((!DELETE_WHEN_DONE)) || step delete.sh
        exit 0
      fi
      ;;
    "" | SUSPENDED | SUSPENDING | FAILED)
      info "'$NAME' is ${state:-gone} (preempted): recreating it and resuming from the latest checkpoint"
      step delete.sh
      bring_up
      ;;
    *) info "'$NAME' is $state" ;;
  esac
  ((!DRY_RUN)) || exit 0
  sleep "$POLL_S"
done
