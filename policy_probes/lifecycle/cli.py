"""``policy-probes hooks list|describe`` and the ``--hooks`` / ``--with-hooks`` /
``--hook-config`` options (wired up in ``policy_probes/cli.py``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from policy_probes.lifecycle.registry import (
    GROUPS,
    KEYWORDS,
    HookRegistry,
    HookSelectionError,
    parse_hook_config,
    resolve_hook_names,
    select_hooks,
)

if TYPE_CHECKING:
    from policy_probes.lifecycle.hook import TrainingHook

EXIT_USAGE = 2
_DESCRIBED = ("hook_points", "intervention_points", "loop_points", "step_schedule")
_DESCRIBED += ("epoch_schedule", "cost", "needs", "namespace", "ranks")


@dataclass
class HookSelection:
    """What the user asked for: names, a group keyword and per-hook parameters."""

    hooks: list[str] = field(default_factory=list)
    with_hooks: str | None = None
    hook_config: dict[str, dict[str, Any]] = field(default_factory=dict)

    def names(self) -> list[str]:
        return resolve_hook_names(self.hooks, self.with_hooks)

    def instantiate(self) -> list[TrainingHook]:
        return select_hooks(self.hooks, self.with_hooks, self.hook_config)


def add_hook_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """``--hooks a,b``, ``--with-hooks GROUP``, ``--hook-config name.param=value`` (repeatable)."""
    group = parser.add_argument_group("lifecycle hooks (see `policy-probes hooks list`)")
    group.add_argument(
        "--hooks",
        action="append",
        default=[],
        metavar="NAMES",
        help="comma-separated hook names (or groups) to enable; repeatable",
    )
    group.add_argument(
        "--with-hooks",
        default=None,
        metavar="GROUP",
        help=f"enable a group of hooks: {', '.join(dict.fromkeys(GROUPS + KEYWORDS))}",
    )
    group.add_argument(
        "--hook-config",
        action="append",
        default=[],
        metavar="NAME.PARAM=VALUE",
        help="a hook parameter, e.g. hessian.iters=30 or norms.schedule=stride:4; repeatable",
    )


def selection_from_args(args: argparse.Namespace) -> HookSelection:
    """Parse and validate the hook options (raises :class:`HookSelectionError`)."""
    selection = HookSelection(
        hooks=[n for item in args.hooks for n in item.split(",") if n.strip()],
        with_hooks=args.with_hooks,
        hook_config=parse_hook_config(args.hook_config),
    )
    selection.instantiate()  # validate names, groups and parameters now
    return selection


def add_hooks_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "hooks",
        help="list and describe lifecycle hooks",
        description="Lifecycle hooks run at hook points of the training loop (docs/lifecycle.md).",
    )
    sub = p.add_subparsers(dest="hooks_command", metavar="ACTION")
    ls = sub.add_parser("list", help="every registered hook with its points and cost")
    ls.set_defaults(handler=hooks_list_command)
    desc = sub.add_parser("describe", help="points, cost, parameters and metrics of one hook")
    desc.add_argument("name", help="hook name")
    desc.set_defaults(handler=hooks_describe_command)
    p.set_defaults(handler=lambda args: _help(p))


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return EXIT_USAGE


def hooks_list_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from policy_probes.lifecycle.hook import COST_CLASSES

    table = Table(title="lifecycle hooks")
    for column in ("name", "kind", "points", "cost", "groups", "description"):
        table.add_column(column, no_wrap=column in ("name", "cost"))
    listed = ("minimal", "observers", "interventions", "full")
    for cls in HookRegistry.classes():
        groups = [g for g in listed if cls.name in HookRegistry.expand(g)]
        groups = ", ".join(["with_debug"] if cls.debug else groups)
        points = ", ".join(p.name for p in cls.hook_points)
        table.add_row(cls.name, cls.kind(), points, cls.cost, groups, cls.description)
    console = Console()
    console.print(table)
    console.print(
        f"cost classes: {', '.join(COST_CLASSES)}. Always added to a non-empty selection: "
        f"{', '.join(c.name for c in HookRegistry.classes() if c.auto_include)}."
    )
    return 0


def hooks_describe_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    try:
        cls = HookRegistry.get(args.name)
    except HookSelectionError as exc:
        print(f"policy-probes: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    info = cls.describe()
    console = Console()
    console.print(f"[bold]{info['name']}[/bold] ({info['kind']}): {info['description']}")
    for key in _DESCRIBED:
        if key in info:
            value = info[key]
            if isinstance(value, list):
                value = ", ".join(value) or "nothing"
            console.print(f"  {key}: {value}")
    params = Table(title="parameters (--hook-config NAME.PARAM=VALUE)")
    params.add_column("parameter")
    params.add_column("default")
    for name, spec in info["parameters"].items():
        params.add_row(name, repr(spec["default"]))
    console.print(params)
    metrics = Table(title="metrics")
    metrics.add_column("key")
    metrics.add_column("meaning")
    prefix = f"{cls.name}/" if cls.namespaced else ""
    for key, meaning in info["metrics"].items():
        metrics.add_row(prefix + key, meaning)
    console.print(metrics)
    return 0
