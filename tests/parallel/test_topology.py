"""Cloud TPU slice names -> libtpu topologies, and the platform a program is compiled for."""

import jax
import pytest

from dspark_jax.parallel import platform
from dspark_jax.parallel.slices import parse_slice, slice_names


@pytest.mark.parametrize("name,topology,chips,hosts", [
    ("v5e-1", "v5e:1x1", 1, 1), ("v5litepod-8", "v5e:2x4", 8, 1), ("v5e-16", "v5e:4x4", 16, 4),
    ("v6e-8", "v6e:2x4", 8, 1), ("v6e-32", "v6e:4x8", 32, 8), ("v6e-256", "v6e:16x16", 256, 64),
    ("v5p-8", "v5p:2x2x1", 4, 1), ("v5p-64", "v5p:2x4x4", 32, 8), ("v5p-1024", "v5p:8x8x8", 512, 128),
    ("v4-8", "v4:2x2x1", 4, 1), ("v7x-8", "tpu7x:2x2x1", 4, 1), ("tpu7x-16", "tpu7x:2x2x2", 8, 2),
    ("v6e:2x4", "v6e:2x4", 8, 1),
])
def test_slice_names_map_to_topologies(name, topology, chips, hosts):
    s = parse_slice(name)
    assert (s.topology, s.chips, s.hosts) == (topology, chips, hosts)
    assert parse_slice(s.name) == s  # the canonical name parses back to the same slice


def test_v4_v5p_v7x_count_tensorcores_v5e_v6e_count_chips():
    assert parse_slice("v5p-8").chips == 4 and parse_slice("v6e-8").chips == 8
    assert "v5p-8" in slice_names() and "v6e-8" in slice_names() and "v5p-6" not in slice_names()


@pytest.mark.parametrize("bad", ["v6e-3", "v5p-7", "v9-8", "v6e", "tpu", "v6e:3x3", "v5p-2"])
def test_unknown_slice_is_one_line_listing_valid_names(bad):
    with pytest.raises(ValueError) as e:
        parse_slice(bad)
    msg = str(e.value)
    assert "\n" not in msg and f"unknown TPU slice {bad!r}" in msg and "v6e-8" in msg and "v5p-8" in msg


def test_platform_is_the_meshs_not_the_hosts():
    pytest.importorskip("libtpu")
    from dspark_jax.parallel.topology import slice_mesh

    mesh = slice_mesh("v6e-4", 1, 1, 4)
    assert jax.default_backend() == "cpu" and platform.platform() == "cpu"
    assert platform.platform(mesh) == "tpu" and platform.device_kind(mesh).startswith("TPU v6")
    with jax.set_mesh(mesh):  # what a traced program sees
        assert platform.on_tpu()
        assert jax.jit(lambda x: x + int(platform.on_tpu())).trace(1).jaxpr is not None
    assert not platform.on_tpu()
