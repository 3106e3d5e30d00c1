"""The plasticity experiment's plumbing on 1 seed x 2 epochs (a new permutation every
epoch): the curves, table and figure it writes hold the run's own metrics, read back
independently from its metrics.jsonl."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import plasticity
from policy_probes.records import read_jsonl


def test_plasticity_benchmark_writes_the_runs_curves_table_and_figure(tmp_path):
    doc = tmp_path / "plasticity.md"
    doc.write_text(f"# kept\n\nprose\n\n{plasticity.BEGIN}\nold\n{plasticity.END}\n\nafter\n")
    argv = [
        "--seeds=4",
        "--arms=none",
        "--epochs=2",
        "--period=1",
        "--jobs=1",
        f"--out={tmp_path / 'runs'}",
        f"--results={tmp_path / 'results.json'}",
        f"--figure={tmp_path / 'figures' / 'p.png'}",
        f"--doc={doc}",
    ]
    assert plasticity.main(argv) == 0

    records = [
        r
        for r in read_jsonl(tmp_path / "runs" / "none-seed4" / "metrics.jsonl")
        if r["hook_point"] == "POST_EPOCH"
    ]
    assert [r["epoch"] for r in records] == [1, 2]
    config = json.loads((tmp_path / "runs" / "none-seed4" / "config.json").read_text())
    assert config["train_tool"]["env"]["permute_obs_every"] == 512
    assert config["train_tool"]["seed"] == 4
    returns = [r["rollout/episode_return"] for r in records]
    critic = [r["probes/relu/critic_mlp/dormant_fraction"] for r in records]

    results = json.loads((tmp_path / "results.json").read_text())
    (run,) = results["runs"]
    assert run["return"] == returns and run["critic_mlp"] == critic
    assert run["units_reset"] == [0.0, 0.0]
    summary = results["summary"]["none/4"]
    assert summary["return_all"] == pytest.approx(np.mean(returns))
    assert summary["return_last"] == pytest.approx(returns[-1])
    assert summary["dormant_critic_last"] == pytest.approx(critic[-1])

    text = doc.read_text()
    assert text.startswith("# kept\n\nprose\n") and text.rstrip().endswith("after")
    assert "old" not in text
    row = next(line for line in text.splitlines() if line.startswith("| none |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"{np.mean(returns):.0f}" and cells[7] == f"{critic[-1]:.3f}"
    assert "python -m benchmarks.plasticity --seeds=4" in text
    assert "![plasticity](figures/p.png)" in text
    assert (tmp_path / "figures" / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the plasticity measures (issue 24), kept per period (here one epoch each): read
    # back from the records
    for name, key in plasticity.MEASURES.items():
        want = [r.get(key) for r in records]
        assert results["runs"][0][name] == want, name
    assert results["runs"][0]["policy_kl"][0] > 0
    assert plasticity.MEASURES_BEGIN not in text  # no section markers: nothing written


def test_the_measures_section_and_the_statistics_it_uses(tmp_path):
    x = np.array([3.0, 1.0, 2.0, 2.0, 5.0])
    assert list(plasticity.ranks(x)) == [4.0, 1.0, 2.5, 2.5, 5.0]
    # Spearman's rho is Pearson's r of the ranks, written out
    y = np.array([1.0, 0.0, 4.0, 3.0, 9.0])
    rx, ry = plasticity.ranks(x), plasticity.ranks(y)
    pearson = float(np.corrcoef(rx, ry)[0, 1])
    rho, p = plasticity.spearman(x, y)
    assert rho == pytest.approx(pearson)
    assert 0 < p <= 1
    assert plasticity.spearman(x, -x)[0] == pytest.approx(-1.0)
    # a decline: the best first-half period is the 2nd (of 4); the later ones average 50
    returns = [100.0] * 10 + [200.0] * 10 + [50.0] * 20
    assert plasticity.decline_epoch(returns, 10) == 21
    assert plasticity.decline_epoch([100.0] * 40, 10) is None
