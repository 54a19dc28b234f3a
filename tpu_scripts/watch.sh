#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Keep a training run alive on spot (or any) capacity: create + set up + launch, then poll the
# queued resource and the job; when the slice was preempted (SUSPENDED/FAILED/gone), delete it,
# recreate it and set up + launch again (training resumes from the latest checkpoint in
# --output-dir). Stops when the job has ended: finished (exit 0) or failed (its exit code).
set -euo pipefail
USAGE="usage: tpu_scripts/watch.sh --name NAME --type TYPE --output-dir gs://BUCKET/PATH [--spot]
                          [--config CONFIG] [--poll 300] [--delete-when-done | --delete-on-exit]
                          [section.key=value ...] [--dry-run]

Runs in the foreground until the job has ended; run it in tmux/screen or with nohup on a small
always-on machine. Each poll reads the queued resource's state and, while it is ACTIVE, every
worker's job state over ssh (worker.sh status: the exit code the job left in ~/dspark_run/):
  - every worker exited 0 and <output-dir>/summary.json says \"preempted\": false: finished,
    exit 0 (--delete-when-done or --delete-on-exit: delete the slice first);
  - a worker exited nonzero (or its job vanished without a code) while the slice stays ACTIVE:
    crashed; print the end of that worker's log and exit with its code (--delete-on-exit:
    delete the slice first; otherwise it stays up, and billed, for you to look at);
  - exited 0 without finishing (SIGTERM: a preemption whose slice is still ACTIVE, or a
    maintenance event): wait one poll for the slice to go, then relaunch (resumes).
Every step is one of the idempotent scripts (create.sh, setup.sh, launch.sh, delete.sh) called
with the same flags. --dry-run prints one cycle: bring-up, one poll, and the recovery that a
preempted queued resource triggers."
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NEEDS=(type output_dir)
parse_flags "$@"
location_flags
# A preempted job can leave its exit code a little before the slice leaves ACTIVE: look
# at the state once more, this long after, before calling a nonzero code a crash.
SETTLE_S=$((POLL_S < 60 ? POLL_S : 60))

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

worker_ssh() { # WORKER COMMAND: a read-only command on the workers; its output
  query "" gcloud compute tpus tpu-vm ssh "$NAME" --worker="$1" "${LOC[@]}" --command="$2"
}

end_job() { # CODE: the job has ended; delete the slice if asked to, exit with CODE
  local code=$1
  if ((DELETE_ON_EXIT || (DELETE_WHEN_DONE && code == 0))); then
    step delete.sh
  else
    info "'$NAME' is still up, and billed: $(cmdline tpu_scripts/delete.sh --name "$NAME" "${LOC[@]}")"
  fi
  exit "$code"
}

bring_up
stopped_polls=0
while true; do
  state=$(qr_state SUSPENDED)
  case $state in
    ACTIVE)
      parse_job_status "$(worker_ssh all "bash dspark_jax/tpu_scripts/worker.sh status")"
      if [[ -n $JOB_FAILED ]]; then
        sleep "$SETTLE_S"
        if [[ $(qr_state ACTIVE) == ACTIVE ]]; then
          info "training failed on worker $JOB_FAILED ($JOB_WHY); the end of its log:"
          worker=$JOB_FAILED
          [[ $worker =~ ^[0-9]+$ ]] || worker=all
          worker_ssh "$worker" "bash dspark_jax/tpu_scripts/worker.sh tail 50" >&2
          info "all logs: $OUTPUT_DIR/logs/"
          end_job "$JOB_CODE"
        fi
        info "'$NAME' is no longer ACTIVE: the job was stopped by a preemption"
      elif ((${#JOB_RUNNING[@]})); then
        stopped_polls=0
      elif finished; then # every worker exited 0, or their state could not be read
        info "training finished: $OUTPUT_DIR/summary.json"
        end_job 0
      elif ((JOB_DONE)); then
        if ((stopped_polls++)); then
          info "the job stopped early (SIGTERM) and '$NAME' is still ACTIVE: relaunching it"
          step launch.sh
          stopped_polls=0
        else
          info "the job stopped early (SIGTERM, summary.json is not final): waiting a poll for '$NAME' to be preempted"
        fi
      fi
      ;;
    "" | SUSPENDED | SUSPENDING | FAILED)
      info "'$NAME' is ${state:-gone} (preempted): recreating it and resuming from the latest checkpoint"
      stopped_polls=0
      step delete.sh
      bring_up
      ;;
    *) info "'$NAME' is $state" ;;
  esac
  ((!DRY_RUN)) || exit 0
  sleep "$POLL_S"
done
