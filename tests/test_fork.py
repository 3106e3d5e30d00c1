"""``policy-probes fork``: a run started from another run's end-of-epoch checkpoint.

An unchanged fork repeats its parent's later epochs bit for bit (parameters and every
metric but wall-clock ones); a changed learning rate takes effect from the fork epoch on
(checked against the annealing formula) while the fork epoch's rollout, collected with
the parent's parameters, is the parent's; a remedy switched on by override changes the
parameters exactly where it fires (ReDo: the units the parent's probe counted dormant);
the report overlays parent and child; bad arguments are one clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run_control_support import EPOCHS, assert_same_params, final_params, write_recipe

from policy_probes.analysis.layer_figures import PROBE_SECTIONS
from policy_probes.analysis.report import (
    REPORT_HTML,
    find_overlays,
    probe_figure,
    returns_figure,
)
from policy_probes.cli import main
from policy_probes.records import RunRecords, read_jsonl
from trainers.checkpoint import checkpoint_name, load_checkpoint

torch.set_num_threads(1)

FORK_EPOCH = 3
#: the tiny recipe's learning rate (PPOConfig default), annealed linearly to 0
PARENT_LR = 2.5e-4
#: metrics that measure time, not the run
WALL_CLOCK = ("time", "perf/", "probes/overhead_")


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    """A finished CLI run of the tiny recipe, checkpointed after every epoch."""
    directory = tmp_path_factory.mktemp("fork")
    target = write_recipe(directory)
    run_dir = directory / "parent"
    argv = ["run", target, f"run_dir={run_dir}", "checkpoint.every_epochs=1", "--no-progress"]
    assert main(argv) == 0
    return run_dir


def records(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def without_wall_clock(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(WALL_CLOCK)}


def test_unchanged_fork_repeats_the_parents_later_epochs_bit_for_bit(parent, tmp_path):
    child = tmp_path / "child"
    assert main(["fork", str(parent), "--epoch", str(FORK_EPOCH), str(child), "--no-progress"]) == 0

    assert_same_params(final_params(child), final_params(parent))
    later = [r for r in records(parent) if r["epoch"] > FORK_EPOCH]
    mine = records(child)
    # every record (POST_EPOCH and the others) of epochs 4..6, in order, nothing earlier
    assert [(r["epoch"], r["hook_point"]) for r in mine] == [
        (r["epoch"], r["hook_point"]) for r in later
    ]
    assert {r["epoch"] for r in mine} == set(range(FORK_EPOCH + 1, EPOCHS + 1))
    for a, b in zip(mine, later, strict=True):
        assert without_wall_clock(a) == without_wall_clock(b), (a["epoch"], a["hook_point"])

    config = json.loads((child / "config.json").read_text())
    assert config["parent"] == {
        "run_dir": str(parent),
        "epoch": FORK_EPOCH,
        "checkpoint": str(parent / "checkpoints" / checkpoint_name(FORK_EPOCH)),
    }
    assert "resumed_from" not in config
    parent_config = json.loads((parent / "config.json").read_text())
    assert config["recipe"] == parent_config["recipe"]
    assert config["overrides"][-1] == f"run_dir={json.dumps(str(child))}"
    # the child's own checkpoints: epochs after the fork only
    names = sorted(p.name for p in (child / "checkpoints").iterdir())
    assert names == [checkpoint_name(e) for e in range(FORK_EPOCH + 1, EPOCHS + 1)]


NEW_LR = 3e-3


@pytest.fixture(scope="module")
def lr_child(parent) -> Path:
    """A fork of ``parent`` after epoch 3 with learning rate :data:`NEW_LR`."""
    child = parent.parent / "lr_child"
    new_lr = NEW_LR
    argv = [
        "fork",
        str(parent),
        "--epoch",
        str(FORK_EPOCH),
        str(child),
        f"trainer.learning_rate={new_lr}",
    ]
    assert main([*argv, "--no-progress"]) == 0
    return child


def post_epoch(run_dir: Path) -> dict[int, dict]:
    return {r["epoch"]: r for r in records(run_dir) if r["hook_point"] == "POST_EPOCH"}


def test_fork_with_a_new_learning_rate_uses_it_from_the_fork_epoch_on(parent, lr_child):
    child, new_lr = lr_child, NEW_LR
    mine, theirs = post_epoch(child), post_epoch(parent)
    assert sorted(mine) == list(range(FORK_EPOCH + 1, EPOCHS + 1))
    for epoch in mine:  # epoch e trains with lr * (1 - (e - 1) / EPOCHS)
        factor = 1.0 - (epoch - 1) / EPOCHS
        assert mine[epoch]["train/learning_rate"] == pytest.approx(new_lr * factor, rel=1e-12)
        assert theirs[epoch]["train/learning_rate"] == pytest.approx(PARENT_LR * factor, rel=1e-12)
    # the fork epoch's rollout ran on the checkpoint's parameters and environments
    first = FORK_EPOCH + 1
    for key in ("rollout/episode_return", "rollout/episodes", "rollout/valid_fraction"):
        assert mine[first][key] == theirs[first][key], key
    assert mine[first]["train/policy_loss"] != theirs[first]["train/policy_loss"]
    a, b = final_params(child), final_params(parent)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_a_fork_that_wrote_no_checkpoint_resumes_from_its_parent(parent, tmp_path):
    child = tmp_path / "child"
    no_checkpoints = ["checkpoint.every_epochs=0", "checkpoint.at_end=false"]
    argv = ["fork", str(parent), "--epoch", str(FORK_EPOCH), str(child), *no_checkpoints]
    assert main([*argv, "--no-progress"]) == 0
    assert not list((child / "checkpoints").glob("*.pt"))
    # resume finds no checkpoint of its own: it forks again, and keeps its parent
    assert main(["resume", str(child), "checkpoint.at_end=true", "--no-progress"]) == 0
    assert_same_params(final_params(child), final_params(parent))
    main_records = [r["epoch"] for r in records(child) if r["hook_point"] == "POST_EPOCH"]
    assert main_records == list(range(FORK_EPOCH + 1, EPOCHS + 1))
    assert json.loads((child / "config.json").read_text())["parent"]["epoch"] == FORK_EPOCH


def test_fork_errors_say_what_to_change(parent, tmp_path, capsys):
    child = tmp_path / "child"

    def fork(*args: str) -> str:
        assert main(["fork", *args, "--no-progress"]) == 2
        return capsys.readouterr().err

    err = fork(str(parent), "--epoch", "9", str(child))
    assert "has no checkpoint of epoch 9" in err
    assert "epochs with one: 1, 2, 3, 4, 5, 6" in err
    assert f"trains {EPOCHS} epochs in all" in fork(str(parent), "--epoch", str(EPOCHS), str(child))
    assert "already holds a run" in fork(str(parent), "--epoch", "2", str(parent))
    assert "holds no config.json" in fork(str(tmp_path), "--epoch", "2", str(child))
    assert "does not exist" in fork(str(tmp_path / "nope"), "--epoch", "2", str(child))
    err = fork(str(parent), "--epoch", "2", str(child), f"run_dir={tmp_path / 'x'}")
    assert "drop the run_dir override" in err
    assert "unknown" in fork(str(parent), "--epoch", "2", str(child), "trainer.lr=1").lower()
    assert not child.exists() or not any(child.iterdir())  # nothing was written


def series(run_dir: Path, key: str) -> tuple[list[int], list[float]]:
    """``key`` per epoch straight from metrics.jsonl (POST_EPOCH records)."""
    rows = sorted(post_epoch(run_dir).items())
    return [e for e, r in rows if key in r], [r[key] for e, r in rows if key in r]


def lines_by_label(ax) -> dict[str, object]:
    return {line.get_label(): line for line in ax.get_lines()}


def test_report_overlays_the_parent_and_compared_runs_on_one_epoch_axis(parent, lr_child, capsys):
    config = json.loads((lr_child / "config.json").read_text())
    other = lr_child.parent / "parent"  # compared with itself as a stand-in for another run
    overlays, notes = find_overlays(lr_child, config, [other])
    assert notes == []
    assert [(o.label, o.linestyle, o.fork_epoch) for o in overlays] == [
        ("parent parent", "--", FORK_EPOCH),
        ("parent", ":", None),
    ]

    child_run = RunRecords.read(lr_child)
    fig = returns_figure(child_run, overlays[:1])
    ax = fig.axes[0]
    lines = lines_by_label(ax)
    key = "rollout/episode_return"
    own = lines[f"training episodes ({key})"]
    dashed = lines["training episodes [parent parent]"]
    assert (list(own.get_xdata()), list(own.get_ydata())) == series(lr_child, key)
    assert (list(dashed.get_xdata()), list(dashed.get_ydata())) == series(parent, key)
    assert list(own.get_xdata()) == list(range(FORK_EPOCH + 1, EPOCHS + 1))
    assert list(dashed.get_xdata()) == list(range(1, EPOCHS + 1))  # same epoch axis
    assert dashed.get_linestyle() == "--" and dashed.get_color() == own.get_color()
    fork = lines[f"fork after epoch {FORK_EPOCH}"]
    assert list(fork.get_xdata()) == [FORK_EPOCH, FORK_EPOCH]

    panels = next(p for slug, _, p in PROBE_SECTIONS if slug == "relu")
    fig = probe_figure(child_run, panels, overlays)
    dormant = next(a for a in fig.axes if "ormant" in a.get_title())
    lines = lines_by_label(dormant)
    key = "probes/relu/actor_mlp/dormant_fraction"
    x, y = series(parent, key)
    for label, style in (("actor_mlp [parent parent]", "--"), ("actor_mlp [parent]", ":")):
        line = lines[label]
        assert (list(line.get_xdata()), list(line.get_ydata())) == (x, y)
        assert line.get_linestyle() == style

    assert main(["report", str(lr_child), "--compare", str(other)]) == 0
    page = (lr_child / REPORT_HTML).read_text()
    assert f"forked after epoch {FORK_EPOCH}" in page and "parent parent: dashed" in page
    before = (lr_child / REPORT_HTML).read_bytes()
    # a compared run that is not there is a typo, not a note (issue 26): exit 2, no report
    assert main(["report", str(lr_child), "--compare", str(other / "nope")]) == 2
    assert (lr_child / REPORT_HTML).read_bytes() == before


def test_fork_that_switches_a_remedy_on_changes_the_run_only_where_it_fires(parent, tmp_path):
    child = tmp_path / "child"
    spec = '["redo@actor_mlp:tau=0.025,every_epochs=1"]'
    argv = ["fork", str(parent), "--epoch", str(FORK_EPOCH), str(child), f"remedies={spec}"]
    assert main([*argv, "--no-progress"]) == 0
    mine, theirs = post_epoch(child), post_epoch(parent)
    first = FORK_EPOCH + 1
    # ReDo fires at the end of each epoch: epoch 4 itself is the parent's
    own = {k: v for k, v in mine[first].items() if not k.startswith("remedies/")}
    assert without_wall_clock(own) == without_wall_clock(theirs[first])
    assert [mine[e]["remedies/redo/actor_mlp/fired"] for e in sorted(mine)] == [1.0, 1.0, 1.0]

    # the epoch-4 checkpoints differ exactly where ReDo recycled units: the incoming rows
    # of the units the probe counted dormant (tau 0.025), and their outgoing columns, zero
    a = load_checkpoint(child / "checkpoints" / checkpoint_name(first))["policy"]
    b = load_checkpoint(parent / "checkpoints" / checkpoint_name(first))["policy"]
    chain = ["actor_mlp.layer_0.linear", "actor_mlp.layer_1.linear", "actor_head"]
    recycled: dict[str, torch.Tensor] = {}
    inputs = torch.ones(4, dtype=torch.bool)  # columns read from units not recycled
    for layer in chain[:2]:
        w, bias = a[f"{layer}.weight"], a[f"{layer}.bias"]
        rows = (w != b[f"{layer}.weight"])[:, inputs].any(dim=1) | (bias != b[f"{layer}.bias"])
        recycled[layer], inputs = rows, ~rows
    expected = {k: torch.zeros_like(v, dtype=torch.bool) for k, v in b.items()}
    for layer, rows in recycled.items():
        expected[f"{layer}.weight"][rows, :] = True
        expected[f"{layer}.bias"][rows] = True
    total = 0
    for index, (layer, consumer) in enumerate(zip(chain, chain[1:], strict=False)):
        units = recycled[layer]
        dormant = theirs[first][f"probes/relu/actor_mlp.layer_{index}/dormant_fraction"]
        assert int(units.sum()) == round(dormant * 16)
        assert mine[first][f"remedies/redo/actor_mlp.layer_{index}/units_reset"] == units.sum()
        total += int(units.sum())
        kept_rows = ~recycled.get(consumer, torch.zeros(len(a[f"{consumer}.bias"]), dtype=bool))
        outgoing = a[f"{consumer}.weight"][kept_rows][:, units]
        assert torch.count_nonzero(outgoing) == 0
        zeroed = expected[f"{consumer}.weight"][kept_rows]
        zeroed[:, units] = b[f"{consumer}.weight"][kept_rows][:, units] != 0
        expected[f"{consumer}.weight"][kept_rows] = zeroed
    assert total == mine[first]["remedies/redo/actor_mlp/units_reset"] > 0
    for key in b:
        assert torch.equal(a[key] != b[key], expected[key]), key
    final_a, final_b = final_params(child), final_params(parent)
    assert any(not torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_a_relative_parent_path_is_found_beside_the_child(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    for name, epochs in (("p", range(1, 5)), ("c", range(3, 5))):
        (runs / name).mkdir(parents=True)
        lines = [
            json.dumps({"epoch": e, "hook_point": "POST_EPOCH", "rollout/episode_return": 10.0 * e})
            for e in epochs
        ]
        (runs / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    config = {"parent": {"run_dir": "runs/p", "epoch": 2, "checkpoint": "x"}}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # "runs/p" does not resolve from here
    (overlay,), notes = find_overlays(runs / "c", config)
    assert notes == [] and overlay.fork_epoch == 2
    assert [v for _, v in overlay.run.series("rollout/episode_return")] == [10.0, 20.0, 30.0, 40.0]
    config["parent"]["run_dir"] = "runs/gone"
    assert find_overlays(runs / "c", config) == (
        [],
        ["parent run runs/gone (no metrics.jsonl found)"],
    )
