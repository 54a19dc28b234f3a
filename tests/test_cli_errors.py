"""Every command answers a user's mistake with one line on stderr and status 2, never a traceback
(`dspark_jax.cli.report_user_errors`); each concept has one flag name, and an old spelling is refused."""

from __future__ import annotations

import pytest

from dspark_jax.__main__ import main

NOPE = "/nonexistent/dspark_jax_test"

CASES = {
    "train": [f"{NOPE}.yaml"],
    "plan train": ["train", f"{NOPE}.yaml"],
    "regenerate": ["--target", NOPE, "--out", f"{NOPE}/out"],
    "prepare": [f"{NOPE}.jsonl", "--out", f"{NOPE}/out"],
    "eval": ["--target", NOPE, "--drafter", NOPE],
    "calibrate": ["--traces", f"{NOPE}.npz", "--drafter", NOPE],
    "convert": ["export", NOPE, f"{NOPE}/ref", "--target", NOPE],
    "generate": ["--target", NOPE, "--prompts", f"{NOPE}.txt"],
    "serve": ["--target", NOPE],
    "convert gguf": ["gguf", f"{NOPE}.gguf", f"{NOPE}/out"],
    "simulate": ["--costs", f"{NOPE}.json", "--synthetic-traces", "--out", f"{NOPE}/o"],
    "bench": ["engine", "--target", NOPE],
    "bench regen": ["regen", "--target", NOPE],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_missing_path_is_one_line(name, capsys, monkeypatch):
    monkeypatch.delenv("DSPARK_JAX_TRACEBACK", raising=False)
    try:
        rc = main([name.split()[0], *CASES[name]])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, (rc, err)
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in err, err
    assert NOPE in err  # it names what is missing


def test_debugging_shows_the_traceback(monkeypatch):
    from dspark_jax.config.loader import ConfigError
    monkeypatch.setenv("DSPARK_JAX_TRACEBACK", "1")
    with pytest.raises(ConfigError):
        main(["train-plan", f"{NOPE}.yaml"])


# every required option, so that the old spelling is the only thing argparse refuses
REQUIRED = {"simulate": ["--costs", NOPE, "--synthetic-traces", "--out", NOPE],
            "calibrate": ["--traces", NOPE, "--drafter", NOPE],
            "eval": ["--target", NOPE, "--drafter", NOPE],
            "regenerate": ["--out", NOPE]}


@pytest.mark.parametrize("command,old,new", [
    ("simulate", "--drafter-dir", "--drafter"),
    ("simulate", "--out-dir", "--out"),
    ("calibrate", "--drafter-dir", "--drafter"),
    ("eval", "--traces-dir", "--traces"),
    ("regenerate", "--num", "--num-prompts"),
    ("regenerate", "--model", "--model-name"),
])
def test_one_name_per_concept_old_spellings_are_refused(command, old, new, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = capsys.readouterr().out.replace(",", " ")
    assert f"{new} " in help_text and f"{old} " not in help_text
    with pytest.raises(SystemExit) as e:
        main([command, *REQUIRED[command], old, "x"])
    assert e.value.code == 2 and f"unrecognized arguments: {old} x" in capsys.readouterr().err


FAST_HELP = ["train", "regenerate", "prepare", "eval", "calibrate", "convert", "generate", "serve", "plan",
             "engine-plan", "embedded", "models", "recipe", "bench"]


def test_help_of_the_user_commands_does_not_import_jax():
    """`--help` answers at once: the user-facing commands build their parsers without importing
    jax (about a second on these machines). One subprocess per command, all in one script."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from dspark_jax.__main__ import main\n"
        "try:\n"
        "    main([sys.argv[1], '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.stderr.write('JAX=%s\\n' % ('jax' in sys.modules))\n")
    slow = []
    for mod in FAST_HELP:
        r = subprocess.run([sys.executable, "-c", code, mod], capture_output=True, text=True, timeout=120)
        assert "usage" in r.stdout.lower(), (mod, r.stdout[-300:], r.stderr[-300:])
        if "JAX=True" in r.stderr:
            slow.append(mod)
    assert not slow, f"--help imports jax: {slow}"


def test_kind_names_match_the_registry():
    from dspark_jax.drafter.registry import KINDS
    from dspark_jax.names import KIND_NAMES

    assert tuple(KINDS) == KIND_NAMES


def test_train_help_lists_the_loaders_presets():
    from dspark_jax.commands.train import _preset_names
    from dspark_jax.config.loader import preset_names

    assert _preset_names() == preset_names() and "smollm2_135m_dspark" in preset_names()
