"""The tiny random target most engine tests decode with (built once per module, as before)."""

import pytest

from dspark_jax.testing.tiny import tiny_config, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)
