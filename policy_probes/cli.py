"""The ``policy-probes`` command line: ``run TARGET [key=value ...]`` loads a recipe
(``package.module.function`` or ``path/to/file.py:function``) returning a
:class:`~policy_probes.runnable.Runnable`, applies the overrides and trains. Each
subcommand is one ``add_<name>_subcommand(subparsers)`` in :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import pkgutil
import shlex
import shutil
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from policy_probes import plugins, runnable
from policy_probes.analysis.arms import add_arms_subcommand
from policy_probes.analysis.findings import add_diagnose_subcommand
from policy_probes.analysis.report import add_report_subcommand
from policy_probes.analysis.trainability_check import add_trainability_subcommand
from policy_probes.control_channel import COMMANDS, ControlError, send_command
from policy_probes.lifecycle.cli import (
    HookSelection,
    add_hook_selection_arguments,
    add_hooks_subcommand,
    selection_from_args,
)
from policy_probes.lifecycle.registry import HookSelectionError, parse_hook_config
from policy_probes.overrides import (
    apply_overrides,
    check_key,
    check_repeated_keys,
    parse_value,
    valid_keys,
)
from policy_probes.recipe_launch import (
    build_from_recipe,
    call_tool,
    launch_overrides,
    load_recipe,
    read_run_config,
    recipes_in,
)
from policy_probes.user_errors import (
    CLIError,
    is_usage_error,
    one_line,
    positive_float,
)

EXIT_USAGE = 2
#: a run that trained but could not write some of its outputs (disk full ...)
EXIT_LOST_OUTPUT = 1
#: the reader of stdout left (`policy-probes diagnose RUN | head`): the status a shell
#: reports for a tool that SIGPIPE (13) ended
EXIT_BROKEN_PIPE = 128 + 13

__all__ = ["CLIError", "apply_overrides", "check_key", "main", "parse_value", "valid_keys"]

RUN_EPILOG = """\
overrides:
  key=value pairs with dotted keys into the recipe's configuration, for example
    trainer.total_timesteps=200000 env.num_envs=8 policy.activation=tanh seed=3
    run_dir=runs/cp3 wandb.mode=offline policy.hidden_sizes=[128,128]
  Values are parsed as JSON (numbers, true/false, null, lists, objects), then as Python's
  True/False/None, otherwise taken as strings (--hook-config values alike); pydantic then
  validates the whole configuration. An unknown key or a bad
  value exits with status 2 and says what to change.

lifecycle hooks:
  --hooks adds hooks to those the recipe selected, --with-hooks replaces its group keyword,
  --hook-config entries override its hook parameters (`policy-probes hooks list`).

examples:
  policy-probes run recipes.cartpole.train trainer.total_timesteps=50000 seed=3
  policy-probes run recipes.cartpole.train --hooks norms,hessian --hook-config hessian.iters=30
  policy-probes run recipes.cartpole.train --with-hooks observers snapshot_every=10
  policy-probes run my_recipes/walker.py:train --dry-run
  policy-probes run --list
"""


class RunEnded(Exception):
    """A requested stop (signal, ``ctl stop``) after a checkpoint; exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def find_recipes(package: str = "recipes") -> list[tuple[str, str]]:
    """``(target, first docstring paragraph)`` of every recipe in ``package``'s modules."""
    try:
        pkg = importlib.import_module(package)
    except ModuleNotFoundError as exc:
        raise CLIError(f"cannot import recipe package {package!r}: {exc}") from None
    found: list[tuple[str, str]] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        name = f"{package}.{info.name}"
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            found.append((f"{name}.*", f"[import failed: {type(exc).__name__}: {exc}]"))
            continue
        for fname, fn in recipes_in(module):
            paragraph = (inspect.getdoc(fn) or "").strip().split("\n\n")[0]
            found.append((f"{name}.{fname}", " ".join(paragraph.split())))
    return found


def add_run_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="train from a recipe",
        description="Load a recipe, apply key=value overrides, and train.",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", nargs="?", help="package.module.function or path/to/file.py:function")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="configuration overrides")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the policy, attach the probes, check run_dir, print the resolved config "
        "and exit (fails where the run would fail before its first step)",
    )
    p.add_argument("--list", action="store_true", help="list the recipes found in --package")
    p.add_argument(
        "--package", default="recipes", help="recipe package for --list (default: recipes)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in run_dir (its metrics, checkpoints, W&B files)",
    )
    add_hook_selection_arguments(p)
    p.set_defaults(handler=run_command)


def print_recipes(package: str) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"recipes in {package}")
    table.add_column("target")
    table.add_column("description")
    for target, doc in find_recipes(package):
        table.add_row(target, doc)
    Console().print(table)
    return 0


HOOK_FIELDS = ("hooks", "with_hooks", "hook_config")


def hook_overrides(tool: BaseModel, selection: HookSelection) -> list[str]:
    """``key=value`` overrides that add the CLI's hook selection to the recipe's (``--hooks``
    extends, ``--with-hooks`` replaces, ``--hook-config`` entries are merged)."""
    if not (selection.hooks or selection.with_hooks or selection.hook_config):
        return []
    missing = [f for f in HOOK_FIELDS if f not in type(tool).model_fields]
    if missing:
        raise CLIError(
            f"--hooks/--with-hooks/--hook-config need a configuration with the fields "
            f"{', '.join(HOOK_FIELDS)}; {type(tool).__name__} lacks {', '.join(missing)}"
        )
    out = []
    if selection.hooks:
        merged = list(dict.fromkeys([*tool.hooks, *selection.hooks]))
        out.append(f"hooks={json.dumps(merged)}")
    if selection.with_hooks:
        out.append(f"with_hooks={json.dumps(selection.with_hooks)}")
    if selection.hook_config:  # the recipe's entries, then the CLI's (flat name.param keys)
        merged = [*parse_hook_config(tool.hook_config).items(), *selection.hook_config.items()]
        config = {f"{hook}.{p}": v for hook, params in merged for p, v in params.items()}
        out.append(f"hook_config={json.dumps(config)}")
    return out


def run_command(args: argparse.Namespace) -> int:
    if args.list:
        return print_recipes(args.package)
    if not args.target:
        raise CLIError("run needs a recipe TARGET (or --list); see policy-probes run --help")
    if "=" in args.target:
        raise CLIError(
            f"the first argument must be the recipe TARGET, got the override {args.target!r}"
        )
    try:
        selection = selection_from_args(args)
    except HookSelectionError as exc:
        raise CLIError(str(exc)) from None
    check_repeated_keys(args.overrides)
    tool = prepare_tool(args.target, args.overrides, args.no_progress, selection)
    if args.dry_run:
        from rich.console import Console

        resolved = tool.resolved_config()
        resolved["attached"] = call_tool(tool.check_setup, overwrite=args.overwrite)
        Console().print_json(json.dumps(resolved, default=str))
        return 0
    return run_tool(tool, overwrite=args.overwrite)


def prepare_tool(
    target: str, overrides: Sequence[str], no_progress: bool, selection: HookSelection | None = None
) -> runnable.Runnable:
    """The recipe's tool with ``overrides`` and the hook selection applied, the launch
    recorded; ``progress`` follows ``--no-progress`` unless an override sets it."""
    tool = build_from_recipe(target)
    overrides = list(overrides)
    if selection is not None:
        overrides += hook_overrides(tool, selection)
    effective = list(overrides)
    user_set_progress = any(o.partition("=")[0].strip() == "progress" for o in overrides)
    if "progress" in type(tool).model_fields and not user_set_progress:
        effective.append(f"progress={'false' if no_progress else 'true'}")
    tool = apply_overrides(tool, effective)
    tool.record_launch(target, overrides)
    return tool


def run_tool(tool: runnable.Runnable, **options: Any) -> int:
    """Train ``tool`` and, on rank 0 (one report under torchrun), say where the outputs are."""
    from rich.console import Console

    result = invoke_tool(tool, **options)
    missing = runnable.result_problems(result)
    if missing:
        print(
            f"policy-probes: {type(tool).__name__}.invoke() returned {type(result).__name__} "
            f"without {', '.join(missing)} (policy_probes.runnable.RunResult); its outputs "
            f"are not listed",
            file=sys.stderr,
        )
    elif result.rank == 0:
        report_outputs(Console(), result)
    lost = list(getattr(result, "lost_outputs", None) or [])
    if lost:  # a run that could not write its outputs did not succeed
        for line in lost:
            print(f"policy-probes: lost: {line}", file=sys.stderr)
        print(
            "policy-probes: error: the run trained to its end but could not write all of "
            "its outputs (lost: above); free disk space or fix the run directory, then "
            "resume from the newest checkpoint",
            file=sys.stderr,
        )
        return EXIT_LOST_OUTPUT
    return 0


def report_outputs(console: Any, result: runnable.RunResult) -> None:
    """Tell the user where the run's outputs are."""
    run_dir = result.run_dir
    if run_dir is None:
        return
    console.print(f"\n[bold]run directory:[/bold] {run_dir}", soft_wrap=True)
    for entry in sorted(Path(run_dir).iterdir()):
        count = sum(p.is_file() for p in entry.rglob("*")) if entry.is_dir() else None
        console.print(
            f"  {entry}" if count is None else f"  {entry}/  ({count} files)", soft_wrap=True
        )
    last = result.last_checkpoint
    if last is not None:
        console.print(f"last checkpoint: {last}", soft_wrap=True)
    scores = result.eval_scores or {}
    if "return_mean" in scores:
        console.print(
            f"final evaluation: mean return {scores['return_mean']:.1f} over "
            f"{int(scores.get('episodes', 0))} episodes"
        )
    for name, reason in (result.sink_failures or {}).items():
        console.print(f"[yellow]sink {name} was switched off: {reason}[/yellow]")
    steps = []
    quoted = shlex.quote(str(run_dir))
    if (Path(run_dir) / "metrics.jsonl").is_file():
        steps.append(f"{program_name()} report {quoted}      # HTML dashboard: report.html")
    if any((Path(run_dir) / "wandb").glob("offline-run-*")):
        beside = Path(sys.executable).parent / "wandb"
        wandb = (
            shlex.quote(str(beside)) if not shutil.which("wandb") and beside.is_file() else "wandb"
        )
        offline = shlex.quote(f"{run_dir}/wandb/") + "offline-run-*"
        steps.append(f"{wandb} sync {offline}      # upload the W&B run")
    if steps:
        console.print("next:\n" + "\n".join(f"  {s}" for s in steps), soft_wrap=True, markup=False)


def program_name() -> str:
    """How the user's shell calls this command line (on PATH, beside this Python, -m)."""
    if shutil.which("policy-probes"):
        return "policy-probes"
    script = Path(sys.executable).parent / "policy-probes"
    if script.is_file():
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m policy_probes.cli"


def invoke_tool(tool: runnable.Runnable, **options: Any) -> runnable.RunResult:
    """``tool.invoke(**options)`` for the options that are set (:func:`call_tool`); a
    requested stop (an exception with an ``exit_code``) becomes :class:`RunEnded`."""
    try:
        return call_tool(tool.invoke, **{k: v for k, v in options.items() if v})
    except BaseException as exc:
        code = getattr(exc, "exit_code", None)
        if isinstance(code, int) and not isinstance(exc, SystemExit):
            raise RunEnded(one_line(exc), code) from None
        raise


def add_resume_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "resume",
        help="continue a run from its newest valid checkpoint",
        description="Re-run the recipe recorded in RUN_DIR/config.json with its overrides "
        "(plus new ones) and continue from the newest checkpoint that loads, appending to "
        "the same metric files and W&B run (docs/run_control.md).",
        epilog="example:\n  policy-probes resume runs/cartpole-1-20250101-120000 "
        "trainer.total_timesteps=400000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="the run directory to continue")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="extra overrides")
    p.add_argument("--checkpoint", help="this checkpoint file instead of the newest valid one")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=resume_command)


def resume_command(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    config, target = read_run_config(run_dir, "resume it with tool.invoke(resume=True)")
    tool = prepare_tool(target, launch_overrides(config, args.overrides, run_dir), args.no_progress)
    parent, fork_from = config.get("parent"), None
    if isinstance(parent, dict) and runnable.supports_fork(tool):  # a fork keeps its parent
        fork_from = runnable.ForkPoint(Path(parent["run_dir"]), int(parent["epoch"]))
    return run_tool(tool, resume=args.checkpoint or True, fork_from=fork_from)


def add_fork_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fork",
        help="start a new run from a checkpoint of another run, with changed configuration",
        description="Re-run the recipe recorded in RUN_DIR/config.json with its overrides plus "
        "new ones, in NEW_RUN_DIR, starting from RUN_DIR's checkpoint of the end of epoch N. "
        "The new run records parent {run_dir, epoch, checkpoint} in its config.json; its "
        "metrics start at epoch N+1; `policy-probes report NEW_RUN_DIR` overlays the parent. "
        "With no override it repeats the parent's epochs after N bit for bit "
        "(docs/run_control.md).",
        epilog="examples:\n"
        "  policy-probes fork runs/cp --epoch 50 runs/cp-lr trainer.learning_rate=1e-4\n"
        "  policy-probes fork runs/cp --epoch 50 runs/cp-redo "
        "remedies='[\"redo@critic_mlp:tau=0.025,every_epochs=25\"]'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="the run to fork (the parent)")
    p.add_argument(
        "--epoch",
        type=int,
        required=True,
        help="fork at the end of this epoch (it needs an end-of-epoch checkpoint)",
    )
    p.add_argument("new_run_dir", help="the new run's directory (must not hold a run)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="changed configuration")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=fork_command)


def fork_command(args: argparse.Namespace) -> int:
    if not args.new_run_dir.strip():  # Path("") is ".": the fork would fill this directory
        raise CLIError(
            f"the fork's directory NEW_RUN_DIR is empty ({args.new_run_dir!r}; it would write "
            f"the fork into the current directory); give a directory such as runs/cp-fork"
        )
    from policy_probes.run import check_run_dir_path

    run_dir, new_run_dir = Path(args.run_dir), Path(args.new_run_dir)
    check_run_dir_path(new_run_dir)  # what run_dir= refuses: a name too long, a file
    if not run_dir.is_dir():
        raise CLIError(f"{run_dir} does not exist; give the directory of the run to fork")
    config, target = read_run_config(
        run_dir, "fork it with tool.invoke(fork_from=ForkPoint(run_dir, epoch))"
    )
    again = fork_started_before(run_dir, args.epoch, new_run_dir)
    overrides = launch_overrides(config, args.overrides, new_run_dir)
    tool = prepare_tool(target, overrides, args.no_progress)
    if not runnable.supports_fork(tool):
        raise CLIError(
            f"{type(tool).__name__}.invoke() takes no fork_from keyword "
            f"(policy_probes.runnable.ForkPoint); this Runnable cannot be forked"
        )
    # started before and stopped before its first epoch: as `resume` would, fork again
    return run_tool(tool, resume=again, fork_from=runnable.ForkPoint(run_dir, args.epoch))


def fork_started_before(parent: Path, epoch: int, new_run_dir: Path) -> bool:
    """Whether ``new_run_dir`` holds this very fork (parent and epoch in its config.json),
    stopped or refused before its first epoch record and checkpoint: the fork command
    then starts it again. Empty, or a start killed before config.json (the run's own
    claim clears that): False. Any other run: :class:`CLIError` saying what to do."""
    from policy_probes.run import held_outputs, holds_progress  # imports torch: not at `--help`

    held = held_outputs(new_run_dir)
    if not held or "config.json" not in held and not holds_progress(new_run_dir):
        return False
    try:
        recorded = json.loads((new_run_dir / "config.json").read_text()).get("parent") or {}
    except (OSError, ValueError, AttributeError):
        recorded = {}
    same = (
        isinstance(recorded, dict)
        and recorded.get("epoch") == epoch
        and Path(str(recorded.get("run_dir"))).resolve() == parent.resolve()
    )
    if same and not holds_progress(new_run_dir):
        return True
    resume = f"{program_name()} resume {shlex.quote(str(new_run_dir))}"
    what = f"this fork of {parent} at epoch {epoch}" if same else "a run"
    raise CLIError(
        f"{new_run_dir} already holds {what} ({', '.join(held)}); continue it with "
        f"`{resume}` (a fork keeps its parent), or give a new directory for the fork"
    )


def add_ctl_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ctl",
        help="pause, resume, checkpoint or stop a running run",
        description="Send a command to the run training in RUN_DIR; it is served at the "
        "next minibatch boundary and acknowledged. pause: wait (no CPU) until resume; "
        "checkpoint: write a checkpoint now; stop: checkpoint, flush and exit (status 0). "
        "Exit status 0 when acknowledged, 1 otherwise.",
    )
    p.add_argument("run_dir", help="the run directory of the running run")
    p.add_argument("command", choices=COMMANDS)
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=30.0,
        help="seconds to wait for the acknowledgement (> 0)",
    )
    p.set_defaults(handler=ctl_command)


def ctl_command(args: argparse.Namespace) -> int:
    try:
        ack = send_command(args.run_dir, args.command, timeout=args.timeout)
    except ControlError as exc:
        print(f"policy-probes ctl: {exc}", file=sys.stderr)
        return 1
    if ack is None:
        print(
            f"policy-probes ctl: {args.command} not acknowledged within {args.timeout:g} s (the "
            f"run serves commands between minibatches; a long rollout, evaluation or a hung "
            f"run delays it); the request was withdrawn unless the run had already taken it",
            file=sys.stderr,
        )
        return 1
    print(f"{'acknowledged' if ack.get('ok') else 'refused'}: {ack.get('message')}")
    return 0 if ack.get("ok") else 1


def add_plugins_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plugins",
        help="list the registered probes, remedies and metric sinks",
        description="The probes, remedies and metric sinks a run can select by name "
        "(probes=[...], remedies=[...], sinks.<name>=true); yours too, once the module "
        "that registers them is imported (a recipe: --recipe).",
    )
    p.add_argument("--kind", choices=plugins.KINDS, help="only this kind")
    p.add_argument("--recipe", help="a recipe module to import first (its own plugins)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(handler=plugins_command)


def plugins_command(args: argparse.Namespace) -> int:
    import policy_probes.probes  # noqa: F401 - the built-ins register when imported
    import policy_probes.remedies  # noqa: F401
    import policy_probes.sinks  # noqa: F401

    if args.recipe:
        load_recipe(args.recipe)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in [args.kind] if args.kind else plugins.KINDS:
        out[kind] = {name: plugins.info(cls) for name, cls in plugins.registered(kind).items()}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for kind, found in out.items():
        print(f"{kind}s:".replace("ys:", "ies:"))
        for name, info in found.items():
            print(f"  {name}: {info['summary']}")
            for key in ("direction", "events", "placements", "metrics", "findings", "console"):
                if info.get(key):
                    value = info[key]
                    text = ", ".join(value) if isinstance(value, list | dict) else value
                    print(f"    {key}: {text}")
            if info.get("docs"):
                print(f"    docs: {info['docs']}")
    return 0


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    *(add_run_subcommand, add_resume_subcommand, add_fork_subcommand, add_arms_subcommand),
    *(add_ctl_subcommand, add_report_subcommand, add_hooks_subcommand, add_diagnose_subcommand),
    *(add_trainability_subcommand, add_plugins_subcommand),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="policy-probes",
        description="Train RL policies with forward/backward probes on their named parts.",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the recipes in the recipes package"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    parser.set_defaults(commands=list(subparsers.choices))
    for sub in subparsers.choices.values():  # `policy-probes run ... -v` works too
        with contextlib.suppress(argparse.ArgumentError):  # a subcommand with its own -v
            sub.add_argument(
                "-v",
                "--verbose",
                action="store_true",
                default=argparse.SUPPRESS,
                help="debug logging, and tracebacks with errors",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    commands = parser.get_default("commands")
    if first is not None and first not in commands and ("." in first or ":" in first):
        print(
            f"policy-probes: error: {first!r} is not a command; to train a recipe: "
            f"policy-probes run {shlex.quote(first)} (commands: {', '.join(commands)})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    args, extra = parser.parse_known_args(argv)
    # `run TARGET --hooks x seed=3`: argparse stops collecting the key=value positionals
    # at the first option, so overrides after an option arrive here.
    if getattr(args, "overrides", None) is not None:
        args.overrides += [e for e in extra if "=" in e and not e.startswith("-")]
        extra = [e for e in extra if not ("=" in e and not e.startswith("-"))]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # recipes next to the user, like `python -m`
    try:
        if args.list and args.command is None:
            return print_recipes("recipes")
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.print_help()
            return EXIT_USAGE
        status = handler(args)
        sys.stdout.flush()  # a closed pipe fails here, not at the interpreter's exit
        return status
    except BrokenPipeError:  # quiet, like a Unix tool; Python's exit flush writes nowhere
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except CLIError as exc:
        if args.verbose and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"policy-probes: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunEnded as exc:
        print(f"policy-probes: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        if not is_usage_error(exc):
            raise
        if args.verbose:
            traceback.print_exception(exc, file=sys.stderr)
        print(f"policy-probes: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("policy-probes: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
