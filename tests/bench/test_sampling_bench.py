"""`python -m dspark_jax bench sampling` runs both paths on the same logits and prints their ratio;
the two agree (the bisection cut is the sorted cut)."""

from dspark_jax.commands.bench import main


def test_sampling_bench_prints_ratio_and_agreement(capsys):
    assert main(["sampling", "--vocab", "300", "--rows", "2", "--repeats", "1", "--top-k", "100"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row[0] == "2" and float(row[2]) > 0 and float(row[-1]) < 1e-6
