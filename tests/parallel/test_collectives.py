"""The stated price of a collective (parallel/collectives.py), computed by hand."""

import pytest

from dspark_jax.parallel.collectives import HOP_LATENCY_S, collective_pricer, group_size


def test_group_size_from_either_spelling():
    assert group_size("all-reduce(%x), replica_groups=[1,8]<=[8], to_apply=%add", 1) == 8
    assert group_size("all-gather(%x), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 1) == 4
    assert group_size("collective-permute(%x), source_target_pairs={{0,1}}", 8) == 8


def test_prices_on_v6e_by_hand():
    price = collective_pricer("v6e", 8)
    ring = 800e9 * 2 / 4  # v6e: 800 GB/s bidirectional over 4 ports, a ring uses two
    line = "replica_groups=[1,8]<=[8]"
    nbytes = 8 * 4096 * 2  # one 8-row bf16 activation
    assert price("all-reduce", nbytes, line) == pytest.approx(2 * (4 * HOP_LATENCY_S + 7 / 8 * nbytes / ring))
    assert price("all-gather", nbytes, line) == pytest.approx(4 * HOP_LATENCY_S + 7 / 8 * nbytes / ring)
    # a reduce-scatter's result is one chip's share: the wire carries (n - 1) / n of the whole array
    assert price("reduce-scatter", nbytes // 8, line) == pytest.approx(4 * HOP_LATENCY_S + 7 / 8 * nbytes / ring)
    assert price("all-reduce", nbytes, "replica_groups=[8,1]<=[8]") == 0.0  # groups of one chip: no traffic
    # latency-bound at one slot: the hops, not the bytes, set the price
    assert price("all-reduce", nbytes, line) < 1.1 * 8 * HOP_LATENCY_S


def test_no_figure_no_price():
    assert collective_pricer("v4", 8) is None
