"""Both notebooks run top to bottom in their shrunken mode and write results that make sense.

Cells run in one namespace, in order, as Jupyter would; lines starting with `%` or `!`
(Colab installs) are skipped; the cell tagged `parameters` is followed by the overrides.
"""

import json
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def run_notebook(name: str, params: dict) -> dict:
    nb = json.loads((NOTEBOOKS / name).read_text())
    ns: dict = {"__name__": "__notebook__"}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(line for line in cell["source"] if not line.lstrip().startswith(("%", "!")))
        exec(compile(src, f"{name}:cell", "exec"), ns)
        if "parameters" in cell["metadata"].get("tags", []):
            ns.update(params)
    return ns


def test_quickstart_notebook(embedded_tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_notebook("quickstart.ipynb", {"SHRINK": True, "OUT": str(tmp_path / "q")})
    res = json.loads((tmp_path / "q" / "results.json").read_text())
    assert res["tau"] >= 1.0 and res["measured_tau"] >= 1.0
    assert (tmp_path / "q" / "acceptance.png").is_file()
    from dspark_jax.io import drafter_dir as drafter_io
    from dspark_jax.io.hf import load_target

    drafter_io.load(res["drafter"], load_target(embedded_tiny_dir).model)  # the checkpoint loads


def test_byo_qwen3_notebook(embedded_tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_notebook("byo_qwen3_tpu.ipynb", {"SHRINK": True, "OUT": str(tmp_path / "b")})
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["tau"] >= 1.0 and res["reimported_kind"] == "dspark"
    assert {"config.json", "model.safetensors"} <= set(res["reference_files"])
