r"""How a command launches a recipe: the recipe target (``package.module.function`` or
``path/to/file.py:function``) loaded and called, its errors turned into one-line
:class:`~policy_probes.user_errors.CLIError`\ s, and a recorded run's recipe and overrides
read back (``resume``, ``fork`` and each arm of ``arms`` launch the same way)."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from policy_probes import runnable
from policy_probes.overrides import check_repeated_keys
from policy_probes.run_lock import lock_owner
from policy_probes.user_errors import SETUP_ERROR_TYPES, CLIError, is_usage_error, one_line


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
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise recipe_error(f"recipe file {file_part!r} failed to import", exc) from exc
    else:
        module_path, _, func_name = target.rpartition(".")
        if not module_path:
            raise CLIError(
                f"recipe target {target!r} must be package.module.function or "
                f"path/to/file.py:function"
            )
        try:
            module = importlib.import_module(module_path)
        except Exception as exc:
            missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
            if missing and module_path.startswith(missing):
                raise CLIError(
                    f"cannot import recipe module {module_path!r} ({exc}); run from the "
                    f"directory that contains it or give path/to/file.py:function"
                ) from None
            raise recipe_error(f"recipe module {module_path!r} failed to import", exc) from exc
    fn = getattr(module, func_name, None)
    try:
        is_module = inspect.ismodule(fn) or (fn is None and importlib.util.find_spec(target))
    except (ImportError, ValueError):
        is_module = False
    if is_module:  # `run recipes.cartpole`
        names = [f"{target}.{n}" for n, _ in recipes_in(importlib.import_module(target))]
        raise CLIError(
            f"{target!r} is a module, not a recipe function; give "
            f"{' or '.join(names) if names else 'package.module.function'}"
        )
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


def recipe_error(what: str, exc: BaseException) -> CLIError:
    """A :class:`CLIError` for an exception of the user's recipe code: its type, message
    and the innermost line of the user's own files."""
    package = Path(__file__).resolve().parent

    def users(filename: str) -> bool:
        if filename.startswith("<") or "importlib" in filename:
            return False
        return package not in Path(filename).resolve().parents

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if users(f.filename)]
    where = ""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" at {exc.filename}:{exc.lineno}"
    elif frames:
        last = frames[-1]
        code = f": {last.line.strip()}" if last.line else ""
        where = f" at {last.filename}:{last.lineno} in {last.name}{code}"
    return CLIError(
        f"{what}: {type(exc).__name__}: {one_line(exc)}{where}; fix the recipe "
        f"(-v shows the whole traceback)"
    )


def build_from_recipe(target: str) -> BaseModel:
    """Call the recipe and check that it returned a :class:`Runnable` pydantic model."""
    recipe = load_recipe(target)
    try:
        tool = recipe()
    except SETUP_ERROR_TYPES as exc:
        raise CLIError(f"recipe {target}: {one_line(exc)}") from exc
    except Exception as exc:  # a bug in the recipe: its own line, not ours
        raise recipe_error(f"recipe {target} raised", exc) from exc
    problems = runnable.runnable_problems(tool)
    if problems:
        name = type(tool).__name__
        raise CLIError(
            f"recipe {target} returned {name}; {runnable.describe_contract()}; "
            f"{name} {'; '.join(problems)}"
        )
    return tool


def recipes_in(module: Any) -> list[tuple[str, Callable[..., Any]]]:
    """``(name, function)`` of the recipes defined in ``module``: functions returning a
    :class:`Runnable` class, callable without arguments."""

    def no_arguments(fn: Callable[..., Any]) -> bool:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return True
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        return all(p.default is not p.empty or p.kind in variadic for p in params)

    return [
        (name, fn)
        for name, fn in inspect.getmembers(module, inspect.isfunction)
        if fn.__module__ == module.__name__ and runnable.returns_runnable(fn) and no_arguments(fn)
    ]


def call_tool(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``method(...)`` with the tool's usage errors as :class:`CLIError`."""
    try:
        return method(*args, **kwargs)
    except Exception as exc:
        if is_usage_error(exc):
            raise CLIError(one_line(exc)) from exc
        raise


def read_run_config(run_dir: Path, how: str) -> tuple[dict[str, Any], str]:
    """``(config.json, recipe target)`` of the run in ``run_dir``; ``how``: what to call
    for a run the CLI did not start."""
    from policy_probes.run import held_outputs  # imports torch: not at `--help`

    config_path = run_dir / "config.json"
    if not config_path.is_file():
        if held_outputs(run_dir):  # metric files only: killed before its first step
            owner = lock_owner(run_dir)
            started = f" (its lock says: {owner.get('command')})" if owner else ""
            raise CLIError(
                f"{run_dir} holds no config.json: its run was stopped while it started, "
                f"before training{started}; start it again with the command that started "
                f"it: `policy-probes run RECIPE run_dir={run_dir}`, or for a fork "
                f"`policy-probes fork PARENT --epoch N {run_dir}` (it starts from the "
                f"beginning)"
            )
        raise CLIError(f"{run_dir} holds no config.json; give the directory of a training run")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise CLIError(f"{config_path} is not valid JSON ({exc})") from None
    target = config.get("recipe")
    if not target:
        raise CLIError(
            f"{run_dir} was not started by `policy-probes run` (no recipe in config.json); "
            f"{how} from Python with the same configuration"
        )
    return config, target


def launch_overrides(config: dict[str, Any], new: Sequence[str], run_dir: Path) -> list[str]:
    """The recorded run's overrides, then ``new`` (without ``run_dir``), then ``run_dir``."""
    check_repeated_keys(new)
    if any(item.partition("=")[0].strip() == "run_dir" for item in new):
        raise CLIError("the run directory is given as an argument; drop the run_dir override")
    previous = [o for o in config.get("overrides", []) if o.partition("=")[0].strip() != "run_dir"]
    return [*previous, *new, f"run_dir={json.dumps(str(run_dir))}"]
