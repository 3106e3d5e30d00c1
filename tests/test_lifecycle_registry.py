"""HookRegistry, groups, selection with per-hook configuration, and the hooks CLI."""

from __future__ import annotations

import argparse

import pytest

from policy_probes.lifecycle import (
    HookPoint,
    HookRegistry,
    HookSelectionError,
    InterventionHook,
    StepSchedule,
    TrainingHook,
    parse_hook_config,
    select_hooks,
)
from policy_probes.lifecycle.cli import (
    add_hook_selection_arguments,
    add_hooks_subcommand,
    selection_from_args,
)

BUILTINS = [
    "training_metrics",
    "adam_dynamics",
    "feature_rank",
    "norms",
    "counterfactual",
    "hessian",
    "policy_fisher",
    "debug_corrupt",
]


def test_builtins_are_registered_in_dispatch_order() -> None:
    assert HookRegistry.names() == BUILTINS


def test_groups_and_keywords_expand_by_kind() -> None:
    classes = {c.name: c for c in HookRegistry.classes()}
    observers = [n for n in BUILTINS if not issubclass(classes[n], InterventionHook)]
    interventions = [
        n for n in BUILTINS if issubclass(classes[n], InterventionHook) and n != "debug_corrupt"
    ]
    assert observers == [
        "training_metrics",
        "adam_dynamics",
        "feature_rank",
        "norms",
    ]
    assert interventions == ["counterfactual", "hessian", "policy_fisher"]
    assert HookRegistry.expand("none") == []
    assert HookRegistry.expand("minimal") == ["training_metrics", "norms"]
    assert HookRegistry.expand("observers") == observers
    assert HookRegistry.expand("interventions") == interventions
    assert HookRegistry.expand("full") == HookRegistry.expand("all") == observers + interventions
    assert HookRegistry.expand("with_debug") == BUILTINS
    with pytest.raises(HookSelectionError, match="unknown hook group 'ful'.*'full'"):
        HookRegistry.expand("ful")


def test_stats_reporter_is_no_hook() -> None:
    with pytest.raises(HookSelectionError, match="unknown hook 'stats_reporter'"):
        select_hooks(["stats_reporter", "norms"])


def test_selection_adds_training_metrics_to_any_non_empty_selection() -> None:
    assert select_hooks() == []
    assert select_hooks(with_hooks="none") == []
    assert [h.name for h in select_hooks(["hessian"])] == [
        "training_metrics",
        "hessian",
    ]
    names = [h.name for h in select_hooks(["counterfactual,norms"], with_hooks="interventions")]
    assert names == [
        "training_metrics",
        "norms",
        "counterfactual",
        "hessian",
        "policy_fisher",
    ]
    assert "debug_corrupt" not in [h.name for h in select_hooks(with_hooks="all")]
    assert "debug_corrupt" in [h.name for h in select_hooks(["debug_corrupt"])]


def test_hook_config_is_parsed_validated_and_applied() -> None:
    assert parse_hook_config(
        ["hessian.iters=30", "norms.schedule=stride:4", "feature_rank.components=a,b"]
    ) == {
        "hessian": {"iters": 30},
        "norms": {"schedule": "stride:4"},
        "feature_rank": {"components": "a,b"},
    }
    assert parse_hook_config({"hessian": {"iters": 5}, "norms.per_layer": False}) == {
        "hessian": {"iters": 5},
        "norms": {"per_layer": False},
    }
    hooks = {
        h.name: h
        for h in select_hooks(
            ["hessian", "norms", "feature_rank"],
            hook_config=[
                "hessian.iters=30",
                "hessian.epochs=stride:5",
                "norms.schedule=burst:2/8,warmup:3",
                "feature_rank.components=actor_mlp,critic_mlp",
                "hessian.min_epoch=2",
            ],
        )
    }
    assert hooks["hessian"].config.iters == 30
    assert hooks["hessian"].epoch_schedule == StepSchedule.stride(5)
    assert hooks["hessian"].points("ppo")[HookPoint.SNAPSHOT].min_epoch == 2
    assert hooks["norms"].step_schedule == StepSchedule.burst(2, 8, warmup=3)
    assert hooks["feature_rank"].config.components == ["actor_mlp", "critic_mlp"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"hooks": ["hesian"]},
            r"unknown hook 'hesian'\. Did you mean 'hessian'\?.*Registered hooks: training_metrics",
        ),
        (
            {"hooks": ["hessian"], "hook_config": ["hessian.iterz=3"]},
            r"no parameter 'iterz'.*'iters'.*Its parameters: schedule",
        ),
        (
            {"hooks": ["hessian"], "hook_config": ["hessian.iters=many"]},
            r"bad configuration for hook 'hessian'.*iters",
        ),
        (
            {"hooks": ["hessian"], "hook_config": ["norms.per_layer=false"]},
            r"not selected.*--hooks norms",
        ),
        ({"hooks": ["hessian"], "hook_config": ["nohook.x=1"]}, r"unknown hook 'nohook'"),
        ({"hooks": ["hessian"], "hook_config": ["hessian=3"]}, r"name\.param"),
        ({"hooks": ["hessian"], "hook_config": ["hessian.iters"]}, r"name\.param=value"),
        ({"hooks": ["norms"], "hook_config": ["norms.schedule=every:3"]}, r"bad schedule"),
    ],
)
def test_bad_selections_say_what_to_change(kwargs: dict, message: str) -> None:
    with pytest.raises(HookSelectionError, match=message):
        select_hooks(**kwargs)


def test_register_validates_declarations() -> None:
    class Bad(TrainingHook):
        name = "bad_cost"
        cost = "pricey"

    with pytest.raises(ValueError, match="cost must be one of"):
        HookRegistry.register(Bad)

    class Stray(InterventionHook):
        name = "stray"
        hook_points = (HookPoint.POST_EPOCH,)
        intervention_points = (HookPoint.PRE_STEP,)

    with pytest.raises(ValueError, match="intervention_points.*PRE_STEP"):
        HookRegistry.register(Stray)

    class Dup(TrainingHook):
        name = "norms"

    with pytest.raises(ValueError, match="already registered"):
        HookRegistry.register(Dup)

    class Fine(TrainingHook):
        name = "fine_custom"

    try:
        assert HookRegistry.register(Fine) is Fine
        assert [h.name for h in select_hooks(["fine_custom"])][-1] == "fine_custom"
    finally:
        HookRegistry.unregister("fine_custom")
    assert "fine_custom" not in HookRegistry.names()


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="policy-probes")
    sub = parser.add_subparsers(dest="command")
    add_hooks_subcommand(sub)
    train = sub.add_parser("train")
    add_hook_selection_arguments(train)
    return parser


def hooks_command(
    capsys: pytest.CaptureFixture[str], *argv: str, status: int = 0
) -> tuple[str, str]:
    """``policy-probes hooks ARGV``: checks its exit status, returns its stdout and stderr."""
    args = make_parser().parse_args(["hooks", *argv])
    assert args.handler(args) == status
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "pieces"),
    [
        (
            ("list",),
            ("norms", "hessian", "policy_fisher", "counterfactual", "debug_corrupt", "SNAPSHOT"),
        ),
        (
            ("describe", "counterfactual"),
            (
                "intervention",
                "POST_EPOCH",
                "expensive",
                "needs_pre_epoch_state",
                "counterfactual/param_distance",
                "replays",
            ),
        ),
    ],
)
def test_hooks_list_and_describe(
    argv: tuple[str, ...], pieces: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = hooks_command(capsys, *argv)
    assert [p for p in pieces if p not in out] == []


def test_hooks_describe_suggests_a_close_name(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = hooks_command(capsys, "describe", "hesian", status=2)
    assert "Did you mean 'hessian'" in err


def test_cli_selection_arguments() -> None:
    args = make_parser().parse_args(
        [
            "train",
            "--hooks",
            "hessian,norms",
            "--with-hooks",
            "minimal",
            "--hook-config",
            "hessian.iters=7",
        ]
    )
    selection = selection_from_args(args)
    assert selection.names() == ["training_metrics", "norms", "hessian"]
    assert [h.config.iters for h in selection.instantiate() if h.name == "hessian"] == [7]
    bad = make_parser().parse_args(
        ["train", "--hooks", "norms", "--hook-config", "norms.per_layr=1"]
    )
    with pytest.raises(HookSelectionError, match="per_layer"):
        selection_from_args(bad)
