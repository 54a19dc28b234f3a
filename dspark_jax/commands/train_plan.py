"""`python -m dspark_jax plan train`: sharding check and per-chip memory of a preset's train and
eval steps, abstractly or compiled (dspark_jax/train/plan.py, train/compiled.py)."""

from __future__ import annotations

import dataclasses
import sys

from dspark_jax.cli import report_user_errors


def _flag_value(argv: list[str], flag: str) -> str | None:
    """Remove `flag VALUE` from argv and return VALUE (None when absent)."""
    if flag not in argv:
        return None
    i = argv.index(flag)
    if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
        raise ValueError(f"{flag} needs a value")
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


USAGE = """usage: python -m dspark_jax plan train CONFIG.yaml [section.key=value ...] [--compile] [--topology SLICE] \
[--hbm-gib N]
Checks sharding divisibility on the config's mesh, traces the step abstractly and prints a
per-device memory estimate.
  --compile         also compile the real train and eval steps for the mesh and print their
                    per-chip memory (memory_analysis) and compile time: for the preset's Cloud TPU
                    slice (mesh.slice) with the TPU compiler (libtpu; no TPU needed), else on fake
                    CPU devices (mesh.slice=null forces that); for a slice also the compiler's
                    predicted step time, tokens/s, FLOPs utilisation and hours (per 1000 steps, or
                    train.steps)
  --topology SLICE  compile for this slice instead (v5e-32, v6e-8, v6e-32, v5p-32, v4-8, v7x-8, ...;
                    implies --compile); its device count must equal mesh.data x fsdp x tensor
  --hbm-gib N       HBM per device for the fit (default: the slice's; v5e 16, v6e 32, v5p 95)
Exit status 1 when a compiled step does not fit the HBM or a dimension does not divide the mesh."""


@report_user_errors
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    from dspark_jax.config import from_cli
    from dspark_jax.train.compiled import compile_steps, use_fake_devices
    from dspark_jax.train.plan import (
        check_step_shapes,
        device_hbm_gib,
        format_compiled,
        format_plan,
        format_predicted,
        misfits,
        plan,
        predicted_time,
        topology_mesh,
    )

    topology = _flag_value(argv, "--topology")
    hbm_text = _flag_value(argv, "--hbm-gib")
    try:
        hbm = float(hbm_text) if hbm_text is not None else None
    except ValueError:
        raise ValueError(f"--hbm-gib {hbm_text!r}: give a number of GiB, e.g. 32") from None
    compile_ = "--compile" in argv or topology is not None
    argv = [a for a in argv if a != "--compile"]
    cfg = from_cli(argv)
    slc = mesh = None
    if compile_:
        name = topology or cfg.mesh.slice
        if name:
            try:
                slc, mesh = topology_mesh(cfg, name)
            except ValueError as e:
                if topology:
                    raise
                raise ValueError(f"{e} (the preset names mesh.slice={name}; mesh.slice=null compiles on fake CPU "
                                 "devices instead)") from e
            if cfg.mesh.data == -1:  # filled from the slice's device count
                cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=int(mesh.shape["data"])))
            hbm = hbm or device_hbm_gib(slc, mesh.devices.size)
        else:
            use_fake_devices(cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor)
    p = plan(cfg)
    check_step_shapes(cfg)
    print(format_plan(argv[0], p))
    if p["problems"]:
        return 1
    if compile_:
        mem = compile_steps(cfg, mesh=mesh)
        where = f"{slc.name}, {mesh.devices.size} devices, XLA:TPU" if slc else None
        print(format_compiled(mem, p["total"], hbm, where))
        if slc is not None and "predicted" in mem.get("train", {}):
            print(format_predicted(predicted_time(cfg, mem["train"], slc, mesh.devices.size), slc.name))
        bad = misfits(mem, hbm, f"a {slc.name} device" if slc else "a device") if hbm else []
        for line in bad:
            print(f"error: {line}", file=sys.stderr)
        return 1 if bad else 0
    return 0
