"""`--mesh` on the inference commands: eval, regenerate and convert on a 2 x 1 x 2 mesh of fake CPU
devices give what one device gives (greedy tokens, tau, converted bytes), with the target read
onto the mesh."""

import json

from tests.conftest import run_multidevice

CODE = r"""
import hashlib, json, sys
from pathlib import Path
import jax
from dspark_jax.commands.eval import main as eval_main
from dspark_jax.commands.regenerate import main as regen_main
from dspark_jax.commands.convert import main as convert_main
from dspark_jax.data.dataset import TokenDataset

import dspark_jax.io.hf as hf
target, drafter, tmp = sys.argv[1], sys.argv[2], Path(sys.argv[3])
_load, devices = hf.load_target, []

def recording_load(*a, **k):  # how many devices each command's target landed on
    lt = _load(*a, **k)
    devices.append(len(lt.model.layers.q_proj[...].sharding.device_set))
    return lt

hf.load_target = recording_load
res = {}
prompts = tmp / "prompts.jsonl"  # one small set: the three default sets would triple the run
prompts.write_text("\n".join(json.dumps({"turns": [t]}) for t in ("def add(a, b):", "What is 3 + 4?", "Once upon")))
for name, extra in (("one", []), ("mesh", ["--mesh", "2,1,2"])):
    out = tmp / name
    assert eval_main(["--target", target, "--drafter", drafter, "--prompts", str(prompts), "--num-prompts", "3",
                      "--max-new-tokens", "8",
                      "--temperature", "0", "--no-sts-split", "--out", str(out / "eval"), *extra]) == 0
    r = json.loads((out / "eval" / "results.json").read_text())["results"]
    res[name + "_tau"] = {s: v["dspark"]["tau"] for s, v in r.items()}
    assert regen_main(["--target", target, "--out", str(out / "regen"), "--num-prompts", "4", "--batch", "4",
                       "--max-new-tokens", "8", "--max-prompt-len", "64", "--temperature", "0",
                       "--no-progress", *extra]) == 0
    ds = TokenDataset(out / "regen")
    res[name + "_records"] = [ds[i]["tokens"].tolist() for i in range(len(ds))]
    assert convert_main(["export", drafter, str(out / "ref"), "--target", target, "--num-anchors", "512", *extra]) == 0
    res[name + "_export"] = hashlib.sha256((out / "ref" / "model.safetensors").read_bytes()).hexdigest()
    res[name + "_devices"], devices = devices, []
print(json.dumps(res))
"""


def test_eval_regenerate_convert_on_a_mesh_equal_one_device(embedded_tiny_dir, tiny_dspark_drafter_dir, tmp_path):
    out = run_multidevice(CODE.replace("sys.argv[1], sys.argv[2], Path(sys.argv[3])",
                                       f"{str(embedded_tiny_dir)!r}, "
                                       f"{str(tiny_dspark_drafter_dir)!r}, Path({str(tmp_path)!r})"),
                          n=4)
    res = json.loads(out.strip().splitlines()[-1])
    assert res["one_tau"] == res["mesh_tau"] and len(res["one_tau"]) >= 1, res
    assert res["one_records"] == res["mesh_records"] and len(res["one_records"]) == 4
    assert all(len(r) > 8 for r in res["one_records"])
    assert res["one_export"] == res["mesh_export"]
    assert res["one_devices"] == [1, 1, 1] and res["mesh_devices"] == [4, 4, 4], res
