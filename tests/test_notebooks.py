"""Both notebooks run top to bottom in their shrunken mode and write results that make sense.

Cells run in one namespace, in order, as Jupyter would; lines starting with `%` or `!`
(Colab installs) are skipped; the cell tagged `parameters` is followed by the overrides.
The notebooks' programs compiled for Colab's TPU chips (the cell tagged `chip-memory`) are
checked once, with the TPU compiler, in `test_notebook_programs_compile_for_colab_chips`; the
full runs skip that cell's compiles (`CHIPS = ()`). Nothing here downloads anything.
"""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("quickstart.ipynb", "byo_qwen3_tpu.ipynb")


def run_notebook(name: str, params: dict, stop_after: str | None = None) -> dict:
    """Execute the notebook's code cells; with `stop_after`, up to the cell with that tag."""
    nb = json.loads((NOTEBOOKS / name).read_text())
    ns: dict = {"__name__": "__notebook__"}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(line for line in cell["source"] if not line.lstrip().startswith(("%", "!")))
        exec(compile(src, f"{name}:cell", "exec"), ns)
        tags = cell["metadata"].get("tags", [])
        if "parameters" in tags:
            ns.update(params)
        if stop_after in tags:
            break
    return ns


def test_quickstart_notebook(embedded_tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_notebook("quickstart.ipynb", {"SHRINK": True, "OUT": str(tmp_path / "q"), "CHIPS": ()})
    res = json.loads((tmp_path / "q" / "results.json").read_text())
    assert res["tau"] >= 1.0 and res["measured_tau"] >= 1.0
    assert res["tau_ci95"][0] <= res["tau"] <= res["tau_ci95"][1]
    assert (tmp_path / "q" / "acceptance.png").is_file()
    # the acceptance plot pools the package's held-out prompts of three domains, with intervals
    assert res["prompts"] >= 16 and set(res["by_domain"]) == {"code", "math", "prose"}
    pos = res["acceptance_by_position"]
    assert pos["requests"] == res["prompts"] and len(pos["rate"]) == len(pos["lo"]) == len(pos["hi"]) == 4
    assert pos["rounds"][0] > 0 and pos["lo"][0] <= pos["rate"][0] <= pos["hi"][0]
    assert res["chip_memory"] is None and res["target"] == "embedded"
    from dspark_jax.io import drafter_dir as drafter_io
    from dspark_jax.io.hf import load_target

    assert not Path(res["drafter"]).is_absolute()  # shown in the stored outputs: no machine path
    drafter_io.load(res["drafter"], load_target(embedded_tiny_dir).model)  # the checkpoint loads


def test_byo_qwen3_notebook(embedded_tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_notebook("byo_qwen3_tpu.ipynb", {"SHRINK": True, "OUT": str(tmp_path / "b"), "CHIPS": ()})
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["tau"] >= 1.0 and res["reimported_kind"] == "dspark"
    assert {"config.json", "model.safetensors"} <= set(res["reference_files"])


# the two chips Colab gives, one per notebook: the quickstart (Colab's notebook) on v5e, the v6e VM
# notebook on its v6e chip (the same kinds of program at the same shapes: one compile per chip is
# the CI budget; the table's loop over CHIPS is the same for one chip as for two)
@pytest.mark.parametrize("name,chips", [("quickstart.ipynb", ("v5e-1",)), ("byo_qwen3_tpu.ipynb", ("v6e-1",))])
def test_notebook_programs_compile_for_colab_chips(name, chips, embedded_tiny_dir, tmp_path, monkeypatch, capsys):
    """The SHRINK programs (drafter train step, engine round) compile with XLA:TPU for one v5e and
    one v6e chip, and the notebook prints their per-chip peaks next to each chip's HBM."""
    pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu: pip install -e '.[aot]'")
    monkeypatch.chdir(tmp_path)
    ns = run_notebook(name, {"SHRINK": True, "OUT": str(tmp_path / "o"), "CHIPS": chips}, stop_after="chip-memory")
    rows = ns["chip_rows"]
    assert tuple(r["chip"] for r in rows) == chips
    assert [r["hbm_gib"] for r in rows] == [{"v5e-1": 16, "v6e-1": 32}[c] for c in chips]
    for r in rows:
        assert r["devices"] == 1
        assert 0 < r["train"] < r["hbm_gib"] * 2**30 and 0 < r["round"] < r["hbm_gib"] * 2**30, r
    out = capsys.readouterr().out
    assert all(f"{c} peak" in out for c in chips) and "chip HBM" in out
    assert "drafter train step (4 x 128 tokens)" in out and "engine round" in out


def test_quickstart_hub_target_is_downloaded_then_loaded_locally(embedded_tiny_dir, tmp_path, monkeypatch):
    """TARGET = a hub id: snapshot_download into checkpoints/<name>, then the project's loader;
    a real Qwen3 trains in bfloat16. The download is faked (no network in tests)."""
    import huggingface_hub

    calls = []

    def fake_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(embedded_tiny_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.chdir(tmp_path)
    ns = run_notebook("quickstart.ipynb", {"SHRINK": True, "OUT": str(tmp_path / "q"), "CHIPS": (),
                                           "TARGET": "Qwen/Qwen3-0.6B"}, stop_after="chip-memory")
    assert calls and calls[0][0] == "Qwen/Qwen3-0.6B" and calls[0][1]["local_dir"] == "checkpoints/Qwen3-0.6B"
    assert "*.safetensors" in calls[0][1]["allow_patterns"]
    cfg = ns["cfg"]
    assert cfg.target.path == str(embedded_tiny_dir) and cfg.target.dtype == "bfloat16"
    assert cfg.target.model is not None and cfg.drafter.mask_token_id is not None


def test_memory_cell_without_the_tpu_compiler(embedded_tiny_dir, tmp_path, monkeypatch, capsys):
    """Without libtpu the notebook says how to get the table and goes on (CI without the aot extra)."""
    from dspark_jax.train import chip_memory

    monkeypatch.setattr(chip_memory, "tpu_compiler_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    ns = run_notebook("quickstart.ipynb", {"SHRINK": True, "OUT": str(tmp_path / "q")}, stop_after="chip-memory")
    assert ns["chip_rows"] is None and ns["CHIPS"] == ("v5e-1", "v6e-1")
    assert 'pip install -e ".[aot]"' in capsys.readouterr().out


MACHINE_PATH = re.compile(r"(/root/|/tmp/|/work/|/home/|/Users/|/content/|/var/folders/|site-packages)")
TQDM_BAR = re.compile(r"\d+%\|.*\||\d+/\d+ \[\d+:\d+|it/s\]|step/s\]|\r")


@pytest.mark.parametrize("name", NAMES)
def test_stored_outputs_are_portable_and_plain(name):
    """The outputs stored in the notebooks name no machine paths and hold no progress bars."""
    nb = json.loads((NOTEBOOKS / name).read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert any(c.get("outputs") for c in code), "the notebook has no stored outputs"
    for c in code:
        for o in c.get("outputs", []):
            texts = ["".join(o.get("text", ""))]
            texts += ["".join(v) for k, v in o.get("data", {}).items() if k.startswith("text/")]
            texts += ["".join(o.get("traceback", []))]
            for text in texts:
                assert not MACHINE_PATH.search(text), (c.get("id"), MACHINE_PATH.search(text).group(0), text[:300])
                assert not TQDM_BAR.search(text), (c.get("id"), text[:300])
            assert o.get("output_type") != "error", (c.get("id"), o)
