"""The ``policy-probes`` command line.

``policy-probes run TARGET [key=value ...]`` loads a recipe (``package.module.function``
or ``path/to/file.py:function``), calls it, applies the overrides to the configuration it
returns, and trains. The recipe must return a pydantic model with an ``invoke()`` method
(a ``trainers.TrainTool``); this module never imports ``trainers`` itself, so the toolkit
stays independent of the built-in trainer.

Each subcommand is one ``add_<name>_subcommand(subparsers)`` function registered in
:data:`SUBCOMMANDS`; adding a subcommand means writing one such function.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib
import importlib.util
import inspect
import json
import logging
import pkgutil
import sys
import traceback
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from policy_probes.control_channel import COMMANDS, ControlError, send_command
from policy_probes.lifecycle.cli import (
    HookSelection,
    add_hook_selection_arguments,
    add_hooks_subcommand,
    selection_from_args,
)
from policy_probes.lifecycle.registry import HookSelectionError, parse_hook_config
from policy_probes.report import add_report_subcommand
from policy_probes.user_errors import (
    SETUP_ERROR_TYPES,
    is_usage_error,
    one_line,
    positive_float,
)

EXIT_USAGE = 2

RUN_EPILOG = """\
overrides:
  key=value pairs with dotted keys into the recipe's configuration, for example
    trainer.total_timesteps=200000 env.num_envs=8 policy.activation=tanh seed=3
    run_dir=runs/cp3 wandb.mode=offline policy.hidden_sizes=[128,128]
  Values are parsed as JSON (numbers, true/false, null, lists, objects), otherwise taken
  as strings; pydantic then validates the whole configuration. An unknown key or a bad
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


class CLIError(Exception):
    """A usage error: printed without a traceback, exit status 2."""


class RunEnded(Exception):
    """The run stopped before its end on request (signal, ``ctl stop``) after writing a
    checkpoint; the CLI prints the message and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------------- recipes
def load_recipe(target: str) -> Callable[[], Any]:
    """The function named by ``package.module.function`` or ``path/to/file.py:function``."""
    if ":" in target:
        file_part, _, func_name = target.rpartition(":")
        path = Path(file_part)
        if not path.is_file():
            raise CLIError(f"recipe file {file_part!r} does not exist (target {target!r})")
        module_name = f"_policy_probes_recipe_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise CLIError(f"cannot import {file_part!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        module_path, _, func_name = target.rpartition(".")
        if not module_path:
            raise CLIError(
                f"recipe target {target!r} must be package.module.function or "
                f"path/to/file.py:function"
            )
        try:
            module = importlib.import_module(module_path)
        except ModuleNotFoundError as exc:
            if exc.name and module_path.startswith(exc.name):
                raise CLIError(
                    f"cannot import recipe module {module_path!r} ({exc}); run from the "
                    f"directory that contains it or give path/to/file.py:function"
                ) from None
            raise
    fn = getattr(module, func_name, None)
    if not callable(fn):
        funcs = [
            n for n, f in inspect.getmembers(module, inspect.isfunction) if not n.startswith("_")
        ]
        close = difflib.get_close_matches(func_name, funcs, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise CLIError(
            f"module {module.__name__!r} has no function {func_name!r}.{hint} "
            f"Functions: {', '.join(funcs) or 'none'}"
        )
    return fn


def build_from_recipe(target: str) -> BaseModel:
    """Call the recipe and check that it returned a TrainTool-like model. A recipe that
    raises one of the configuration errors (a builder passed without its parentheses, a
    bad value) is a usage error naming the recipe."""
    recipe = load_recipe(target)
    try:
        tool = recipe()
    except SETUP_ERROR_TYPES as exc:
        raise CLIError(f"recipe {target}: {one_line(exc)}") from exc
    if not (isinstance(tool, BaseModel) and callable(getattr(tool, "invoke", None))):
        raise CLIError(
            f"recipe {target} returned {type(tool).__name__}; a recipe must return a "
            f"TrainTool (a pydantic model with an invoke() method)"
        )
    return tool


def _returns_train_tool(fn: Callable) -> bool:
    try:
        ann = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        return False
    if isinstance(ann, str):
        return ann.split(".")[-1].strip("'\"") == "TrainTool"
    return getattr(ann, "__name__", None) == "TrainTool"


def find_recipes(package: str = "recipes") -> list[tuple[str, str]]:
    """``(target, first docstring line)`` of every function in ``package``'s modules whose
    return annotation is ``TrainTool``. Modules are imported; functions are not called."""
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
        for fname, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and _returns_train_tool(fn):
                paragraph = (inspect.getdoc(fn) or "").strip().split("\n\n")[0]
                found.append((f"{name}.{fname}", " ".join(paragraph.split())))
    return found


# ---------------------------------------------------------------------- overrides
def parse_value(text: str) -> Any:
    """JSON first (numbers, true/false, null, lists, objects), then Python-style
    True/False/None, else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def _model_class(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        cls = _model_class(arg)
        if cls is not None:
            return cls
    return None


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (dict, typing.Union, types.UnionType):
        return origin is dict or any(_is_mapping(a) for a in typing.get_args(annotation))
    return annotation is dict


def valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key an override may set (``env.kwargs.*`` style for free-form dicts)."""
    out: list[str] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _model_class(info.annotation)
        if sub is not None:
            out.append(key)
            out.extend(valid_keys(sub, key + "."))
        elif _is_mapping(info.annotation):
            out.extend([key, key + ".*"])
        else:
            out.append(key)
    return out


def check_key(model: type[BaseModel], key: str) -> None:
    """Raise :class:`CLIError` naming the closest valid keys if ``key`` is unknown."""
    current: type[BaseModel] | None = model
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = current.model_fields if current is not None else {}
        if part not in fields:
            keys = [k for k in valid_keys(model) if not k.endswith(".*")]
            close = difflib.get_close_matches(key, keys, n=4, cutoff=0.5)
            hint = f" Closest valid keys: {', '.join(close)}." if close else ""
            raise CLIError(f"unknown configuration key {key!r}.{hint} (--dry-run shows all keys)")
        annotation = fields[part].annotation
        if _is_mapping(annotation) and _model_class(annotation) is None:
            return  # free-form dict: any sub-key
        current = _model_class(annotation)
        if current is None and i < len(parts) - 1:
            raise CLIError(
                f"configuration key {'.'.join(parts[: i + 1])!r} has no sub-keys (in {key!r})"
            )


def apply_overrides(tool: BaseModel, overrides: Sequence[str]) -> BaseModel:
    """A new, fully re-validated model with ``key=value`` overrides applied.

    Private attributes (the hook builders a recipe added) are carried over.
    """
    data = tool.model_dump()
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CLIError(f"override {item!r} must look like key=value (e.g. seed=3)")
        check_key(type(tool), key)
        node = data
        *path, leaf = key.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = parse_value(raw)
    try:
        new = type(tool).model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<config>'}: {err['msg']}"
            for err in exc.errors()
        )
        raise CLIError(f"invalid configuration after overrides: {problems}") from None
    private = getattr(tool, "__pydantic_private__", None)
    if private:
        object.__setattr__(new, "__pydantic_private__", copy.copy(private))
    return new


# ---------------------------------------------------------------------- run
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

    recipes = find_recipes(package)
    table = Table(title=f"recipes in {package}")
    table.add_column("target")
    table.add_column("description")
    for target, doc in recipes:
        table.add_row(target, doc)
    Console().print(table)
    return 0


HOOK_FIELDS = ("hooks", "with_hooks", "hook_config")


def hook_overrides(tool: BaseModel, selection: HookSelection) -> list[str]:
    """``key=value`` overrides that add the CLI's hook selection to the recipe's:
    ``--hooks`` extends ``hooks``, ``--with-hooks`` replaces ``with_hooks``,
    ``--hook-config`` entries are merged into ``hook_config`` (flat ``name.param`` keys)."""
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
    if selection.hook_config:
        config = {
            f"{hook}.{param}": value
            for hook, params in parse_hook_config(tool.hook_config).items()
            for param, value in params.items()
        }
        for hook, params in selection.hook_config.items():
            config.update({f"{hook}.{param}": value for param, value in params.items()})
        out.append(f"hook_config={json.dumps(config)}")
    return out


def run_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
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
    tool = build_from_recipe(args.target)
    overrides = list(args.overrides) + hook_overrides(tool, selection)
    user_set_progress = any(o.split("=", 1)[0].strip() == "progress" for o in overrides)
    effective = list(overrides)
    if "progress" in type(tool).model_fields and not user_set_progress:
        effective.append(f"progress={'false' if args.no_progress else 'true'}")
    tool = apply_overrides(tool, effective)
    if callable(getattr(tool, "record_launch", None)):
        tool.record_launch(args.target, overrides)
    if args.dry_run:
        resolved = (
            tool.resolved_config()
            if callable(getattr(tool, "resolved_config", None))
            else tool.model_dump(mode="json")
        )
        check = getattr(tool, "check_setup", None)
        if callable(check):
            resolved["attached"] = call_tool(check, overwrite=args.overwrite)
        console.print_json(json.dumps(resolved, default=str))
        return 0
    result = invoke_tool(tool, overwrite=args.overwrite)
    if getattr(result, "rank", 0) == 0:  # under torchrun: one report, from rank 0
        report_outputs(console, result)
    return 0


def report_outputs(console: Any, result: Any) -> None:
    """Tell the user where the run's outputs are."""
    run_dir = getattr(result, "run_dir", None)
    if run_dir is None:
        return
    console.print(f"\n[bold]run directory:[/bold] {run_dir}", soft_wrap=True)
    for entry in sorted(Path(run_dir).iterdir()):
        if entry.is_dir():
            count = sum(1 for p in entry.rglob("*") if p.is_file())
            console.print(f"  {entry}/  ({count} files)", soft_wrap=True)
        else:
            console.print(f"  {entry}", soft_wrap=True)
    last = getattr(result, "last_checkpoint", None)
    if last is not None:
        console.print(f"last checkpoint: {last}", soft_wrap=True)
    scores = getattr(result, "eval_scores", None) or {}
    if "return_mean" in scores:
        console.print(
            f"final evaluation: mean return {scores['return_mean']:.1f} over "
            f"{int(scores.get('episodes', 0))} episodes"
        )
    for name, reason in (getattr(result, "sink_failures", None) or {}).items():
        console.print(f"[yellow]sink {name} was switched off: {reason}[/yellow]")
    steps = []
    if (Path(run_dir) / "metrics.jsonl").is_file():
        steps.append(f"policy-probes report {run_dir}      # HTML dashboard: report.html")
    if any((Path(run_dir) / "wandb").glob("offline-run-*")):
        steps.append(f"wandb sync {run_dir}/wandb/offline-run-*      # upload the W&B run")
    if steps:
        console.print("next:\n" + "\n".join(f"  {s}" for s in steps), soft_wrap=True, markup=False)


# ---------------------------------------------------------------------- resume, ctl
def call_tool(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``method(...)`` with the tool's usage errors (exceptions tagged ``usage_error``:
    unknown components, builder mistakes, a run_dir in use ...) as :class:`CLIError`."""
    try:
        return method(*args, **kwargs)
    except Exception as exc:
        if is_usage_error(exc):
            raise CLIError(one_line(exc)) from exc
        raise


def invoke_tool(tool: BaseModel, **options: Any) -> Any:
    """``tool.invoke(**options)`` for the options that are set (duck-typed: a tool whose
    ``invoke`` lacks one is a usage error). A run directory conflict or an unusable
    checkpoint (exceptions with ``usage_error = True``) is a usage error; a requested
    stop (an exception with an ``exit_code``) becomes :class:`RunEnded`."""
    wanted = {k: v for k, v in options.items() if v}
    accepted = inspect.signature(tool.invoke).parameters
    missing = [k for k in wanted if k not in accepted]
    if missing:
        raise CLIError(f"{type(tool).__name__}.invoke() does not support {', '.join(missing)}")
    try:
        return tool.invoke(**wanted)
    except BaseException as exc:
        if is_usage_error(exc):
            raise CLIError(one_line(exc)) from exc
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
    from rich.console import Console

    run_dir = Path(args.run_dir)
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise CLIError(f"{run_dir} holds no config.json; give the directory of a training run")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise CLIError(f"{config_path} is not valid JSON ({exc})") from None
    target = config.get("recipe")
    if not target:
        raise CLIError(
            f"{run_dir} was not started by `policy-probes run` (no recipe in config.json); "
            f"resume it from Python with the same configuration: tool.invoke(resume=True)"
        )
    for item in args.overrides:
        if item.partition("=")[0].strip() == "run_dir":
            raise CLIError("resume continues in RUN_DIR; drop the run_dir override")
    previous = [o for o in config.get("overrides", []) if o.partition("=")[0].strip() != "run_dir"]
    overrides = [*previous, *args.overrides, f"run_dir={json.dumps(str(run_dir))}"]
    tool = build_from_recipe(target)
    effective = list(overrides)
    user_set_progress = any(o.partition("=")[0].strip() == "progress" for o in overrides)
    if "progress" in type(tool).model_fields and not user_set_progress:
        effective.append(f"progress={'false' if args.no_progress else 'true'}")
    tool = apply_overrides(tool, effective)
    if callable(getattr(tool, "record_launch", None)):
        tool.record_launch(target, overrides)
    result = invoke_tool(tool, resume=args.checkpoint or True)
    if getattr(result, "rank", 0) == 0:
        report_outputs(Console(), result)
    return 0


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


# ---------------------------------------------------------------------- entry point
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_run_subcommand,
    add_resume_subcommand,
    add_ctl_subcommand,
    add_report_subcommand,
    add_hooks_subcommand,
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
        return handler(args)
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
