"""`OwnKeys`: which of a block's own keys each query sees, against a numpy loop."""

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.target.own_keys import OwnKeys


def _np_mask(lengths, t, w, causal):
    out = np.zeros((len(lengths), t, w), bool)
    for r, n in enumerate(lengths):
        for i in range(t):
            for j in range(w):
                out[r, i, j] = j < n and (j <= i or not causal)
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_mask_follows_lengths_and_causality(causal):
    lengths = np.array([0, 1, 3, 4])
    k = jnp.zeros((4, 4, 2, 8))
    own = OwnKeys(k, k, jnp.asarray(lengths, jnp.int32), causal=causal)
    np.testing.assert_array_equal(np.asarray(own.mask(4)), _np_mask(lengths, 4, 4, causal))
    np.testing.assert_array_equal(np.asarray(own.as_part(4)[2]), _np_mask(lengths, 4, 4, causal))


def test_of_prefix_counts_the_valid_columns():
    valid = jnp.asarray([[True, True, False], [False, False, False], [True, True, True]])
    k = jnp.zeros((3, 3, 1, 4))
    own = OwnKeys.of_prefix(k, k, valid)
    np.testing.assert_array_equal(np.asarray(own.lengths), [2, 0, 3])
    assert own.causal and own.lengths.dtype == jnp.int32
    assert own.astype(jnp.bfloat16).k.dtype == jnp.bfloat16
