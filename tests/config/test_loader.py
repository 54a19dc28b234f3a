import pytest

from dspark_jax.config import Config, from_cli
from dspark_jax.config.loader import ConfigError


def test_preset_and_override():
    cfg = from_cli(["micro", "drafter.gamma=7", "target.model.num_layers=3"])
    assert isinstance(cfg, Config)
    assert cfg.drafter.gamma == 7
    assert cfg.target.model.num_layers == 3
    assert cfg.target.model.vocab_size == 512  # from the preset


def test_defaults_without_file():
    cfg = from_cli([])
    assert cfg.drafter.kind == "dspark" and cfg.target.path is None


@pytest.mark.parametrize(
    "args, needle",
    [
        (["micro", "drafter.gama=3"],
         "unknown config key 'drafter.gama'; "
                                      "valid keys in 'drafter': confidence_head, gamma"),
        (["micro", "drafter.gamma=x"], "config key 'drafter.gamma': got 'x', expected int"),
        (["micro", "drafter.head_type=lstm"], "expected one of 'vanilla', 'gated', 'rnn'"),
        (["micro", "drafter.gamma=0"], "gamma must be >= 1"),
        (["micro", "drafter.target_layer_ids=[3,1]"], "strictly increasing"),
        (["micro", "target.model.arch=gpt2"], "'target.model.arch': got 'gpt2', expected one of 'qwen3', 'llama'"),
        (["micro", "target.dtype=bfloat61"], "expected one of 'float32', 'bfloat16'"),
        (["nosuchpreset"], "config file 'nosuchpreset' not found; presets: "),
        (["micro", "gamma"], "unexpected argument 'gamma'"),
    ],
)
def test_bad_config_names_key_and_choices(args, needle):
    with pytest.raises(ConfigError) as e:
        from_cli(args)
    assert needle in str(e.value)


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("drafter:\n  gamma: 3\n  blocksize: 4\n")
    with pytest.raises(ConfigError, match="unknown config key 'drafter.blocksize'"):
        from_cli([str(p)])


def test_inherit(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("inherit: micro\ndrafter:\n  gamma: 3\n")
    cfg = from_cli([str(p)])
    assert cfg.drafter.gamma == 3 and cfg.target.model.hidden_size == 64


def test_train_print_config_round_trips(tmp_path, capsys):
    """`train --print-config` prints the resolved config; fed back as a file it is the same config."""
    from dspark_jax.commands.train import main
    from dspark_jax.config import from_cli

    assert main(["micro", "drafter.gamma=3", "train.steps=7", "--print-config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "resolved.yaml").write_text(printed)
    assert from_cli([str(tmp_path / "resolved.yaml")]) == from_cli(["micro", "drafter.gamma=3", "train.steps=7"])
    assert "gamma: 3" in printed
    assert main(["--help"]) == 0 and "eagle3 | mtp1" in capsys.readouterr().out
