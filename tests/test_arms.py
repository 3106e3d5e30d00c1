"""``policy-probes arms``: a short run forked into arms end to end (children's records
start at N+1, the parent's files are byte-identical before and after, the comparison
holds the arms' numbers recomputed here from the children's metrics), and the
comparison's mean, spread and differences over several parents against statistics."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from pathlib import Path

import pytest
from run_control_support import EPOCHS, write_recipe

from policy_probes.analysis.arms import ArmsError, compare, parse_arm
from policy_probes.cli import main

RETURN = "rollout/episode_return"
#: two overrides in one arm, named
ARM = (
    'snp:remedies=["soft_shrink_perturb@actor_head:shrink=0.5,noise=0.5",'
    '"l2_init@actor_mlp:coef=0.01"] trainer.adam_betas=[0.99,0.99]'
)


def digests(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def post_epoch(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["hook_point"] == "POST_EPOCH":
            out[r["epoch"]] = r
    return out


def test_arms_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    target = write_recipe(tmp_path)
    parent = tmp_path / "parent"
    assert main(["run", target, f"run_dir={parent}", "--no-progress"]) == 0
    before = digests(parent)
    out = tmp_path / "arms"
    args = ["arms", str(parent), "--epoch", "2", "--arm", "none", "--arm", ARM]
    capsys.readouterr()
    assert main([*args, "--out", str(out), "--jobs", "2"]) == 0  # children: subprocesses
    stdout = capsys.readouterr().out
    assert digests(parent) == before  # the parent is only read

    parent_rows = post_epoch(parent)
    children = {arm: out / "parent" / arm for arm in ("none", "snp")}
    rows = {arm: post_epoch(d) for arm, d in children.items()}
    for arm, d in children.items():
        assert sorted(rows[arm]) == list(range(3, EPOCHS + 1)), arm  # start at N + 1
        assert json.loads((d / "config.json").read_text())["parent"]["epoch"] == 2
    # the none child repeats the parent's epochs after the fork
    assert [rows["none"][e][RETURN] for e in range(3, 7)] == [
        parent_rows[e][RETURN] for e in range(3, 7)
    ]
    assert "remedies/soft_shrink_perturb/actor_head/steps" in rows["snp"][3]
    assert "remedies/l2_init/actor_mlp/distance" in rows["snp"][3]
    snp_config = json.loads((children["snp"] / "config.json").read_text())
    assert snp_config["train_tool"]["trainer"]["adam_betas"] == [0.99, 0.99]

    result = json.loads((out / "arms.json").read_text())
    comparison = result["comparison"]
    by_hand = {}
    for arm in children:
        values = [rows[arm][e][RETURN] for e in range(3, 7) if RETURN in rows[arm][e]]
        by_hand[arm] = sum(values) / len(values)
        got = comparison[arm]["return"]
        assert got["mean"] == pytest.approx(by_hand[arm], rel=1e-12)
        assert got["std"] == 0.0
        assert comparison[arm]["return_last"]["mean"] == pytest.approx(rows[arm][6][RETURN])
        key = "probes/relu/actor_mlp/dormant_fraction"
        probe = [rows[arm][e][key] for e in range(3, 7)]
        assert comparison[arm][key]["mean"] == pytest.approx(sum(probe) / 4, rel=1e-12)
    for arm in children:
        diff = comparison[arm]["return"]["diff_mean"]
        assert diff == pytest.approx(by_hand[arm] - by_hand["none"], abs=1e-9)
    assert by_hand["snp"] != by_hand["none"]  # a real change, a real number
    table = (out / "arms.md").read_text()
    snp_row = next(line for line in table.splitlines() if line.startswith("| snp"))
    assert f"{by_hand['snp']:.4g}" in snp_row
    assert f"{by_hand['snp'] - by_hand['none']:+.4g}" in snp_row
    assert f"{by_hand['snp']:.4g}" in stdout and "snp" in stdout
    report = (out / "report-parent.html").read_text()
    assert "snp:" in report  # the arm's child, overlaid on the none child

    # a rerun reuses the finished children and writes the same comparison
    assert main([*args, "--out", str(out), "--no-report"]) == 0
    assert json.loads((out / "arms.json").read_text())["comparison"] == comparison


def test_comparison_over_parents_against_statistics():
    per_arm = {
        "none": {"a": {"return": 10.0, "x": 1.0}, "b": {"return": 20.0, "x": 2.0}, "c": {}},
        "l2": {"a": {"return": 13.0, "x": 0.5}, "b": {"return": 21.0}, "c": {"return": 5.0}},
    }
    out = compare(per_arm, ["a", "b", "c"])
    r = out["l2"]["return"]
    assert r["mean"] == pytest.approx(statistics.mean([13.0, 21.0, 5.0]))
    assert r["std"] == pytest.approx(statistics.stdev([13.0, 21.0, 5.0]))
    assert r["diff_per_parent"] == {"a": 3.0, "b": 1.0}  # c has no none value to pair
    assert r["diff_mean"] == pytest.approx(2.0)
    assert r["diff_std"] == pytest.approx(math.sqrt(2.0))
    assert out["l2"]["x"]["diff_per_parent"] == {"a": -0.5}
    assert out["none"]["return"]["diff_mean"] == 0.0


def test_arm_specs():
    assert parse_arm("none").overrides == []
    arm = parse_arm('remedies=["l2_init@actor_mlp:coef=0.01","l2_init@critic_mlp:coef=0.01"]')
    assert arm.name == "l2_init"
    assert arm.overrides == [
        'remedies=["l2_init@actor_mlp:coef=0.01","l2_init@critic_mlp:coef=0.01"]'
    ]
    arm = parse_arm("ln:policy.layer_norm=true trainer.adam_betas=[0.99,0.99]")
    assert (arm.name, arm.overrides) == (
        "ln",
        ["policy.layer_norm=true", "trainer.adam_betas=[0.99,0.99]"],
    )
    with pytest.raises(ArmsError, match="an arm is 'none' or"):
        parse_arm("lr 0.1")
