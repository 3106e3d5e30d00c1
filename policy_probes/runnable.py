"""The contract between ``policy-probes run`` and what a recipe returns: a
:class:`Runnable` pydantic model (the CLI overrides its fields) whose ``invoke`` returns a
:class:`RunResult`; ``trainers.TrainTool`` is the built-in one. One whose ``invoke`` also
takes ``fork_from`` (a :class:`ForkPoint`) can be forked.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel


@runtime_checkable
class RunResult(Protocol):
    """What :meth:`Runnable.invoke` returns; the CLI reads these fields."""

    #: the run directory (None: the run wrote nothing to report)
    run_dir: Path | None
    #: the newest checkpoint written, or None
    last_checkpoint: Path | None
    #: the final evaluation (``return_mean``, ``episodes``), empty without one
    eval_scores: Mapping[str, float]
    #: sink name -> why it was switched off during the run
    sink_failures: Mapping[str, str]
    #: this process's rank under torchrun (0 otherwise): only rank 0 reports
    rank: int


@dataclass(frozen=True)
class ForkPoint:
    """Where a forked run starts: the end of epoch ``epoch`` of the run in ``run_dir``
    (``Runnable.invoke(fork_from=...)``, ``policy-probes fork``)."""

    run_dir: Path
    epoch: int


def supports_fork(obj: Any) -> bool:
    """Whether ``obj``'s ``invoke`` takes the optional ``fork_from`` keyword."""
    invoke = getattr(obj, "invoke", None)
    return callable(invoke) and "fork_from" in inspect.signature(invoke).parameters


@runtime_checkable
class Runnable(Protocol):
    """What a recipe returns (besides being a pydantic ``BaseModel``)."""

    def invoke(self, *, resume: bool | str | Path = False, overwrite: bool = False) -> RunResult:
        """Train. ``resume``: continue the run in ``run_dir`` (True: from its newest valid
        checkpoint; a path: from that one); ``overwrite``: replace a run in ``run_dir``."""

    def record_launch(self, target: str, overrides: list[str]) -> None:
        """Remember the recipe target and overrides (``policy-probes resume`` reruns them)."""

    def resolved_config(self) -> dict[str, Any]:
        """The configuration as the run records it (``--dry-run`` prints it)."""

    def check_setup(self, *, overwrite: bool = False) -> dict[str, list[str]]:
        """Check everything the run checks before its first step, writing nothing;
        return the components each probe pattern resolved to (``--dry-run``)."""


#: the methods of :class:`Runnable`, in the order a message lists them
RUNNABLE_METHODS: tuple[str, ...] = ("invoke", "record_launch", "resolved_config", "check_setup")
RESULT_FIELDS: tuple[str, ...] = tuple(typing.get_type_hints(RunResult))


def runnable_problems(obj: Any) -> list[str]:
    """What ``obj`` (instance or class) lacks to be a :class:`Runnable` pydantic model."""
    cls = obj if isinstance(obj, type) else type(obj)
    problems = []
    if not issubclass(cls, BaseModel):
        problems.append("is not a pydantic BaseModel")
    missing = [m for m in RUNNABLE_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        problems.append(f"has no {', '.join(f'{m}()' for m in missing)}")
    invoke = getattr(cls, "invoke", None)
    if callable(invoke):
        params = inspect.signature(invoke).parameters
        lacking = [p for p in ("resume", "overwrite") if p not in params]
        if lacking and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            problems.append(f"has an invoke() without the {' and '.join(lacking)} keyword")
    return problems


def describe_contract() -> str:
    """One sentence naming what a recipe must return."""
    return (
        "a recipe must return a TrainTool or another Runnable (policy_probes.runnable: a "
        f"pydantic model with {', '.join(f'{m}()' for m in RUNNABLE_METHODS)})"
    )


C = TypeVar("C", bound=type)


def runnable(cls: C) -> C:
    """Class decorator: declare that ``cls`` implements :class:`Runnable` (a pydantic
    model cannot subclass a ``Protocol``); raises ``TypeError`` at class creation if not."""
    problems = runnable_problems(cls)
    if problems:
        raise TypeError(f"{cls.__name__} is not a Runnable: it {'; it '.join(problems)}")
    return cls


def result_problems(result: Any) -> list[str]:
    """The :class:`RunResult` fields ``result`` lacks."""
    return [f for f in RESULT_FIELDS if not hasattr(result, f)]


def returns_runnable(fn: Callable[..., Any]) -> bool:
    """Whether ``fn``'s return annotation is a class that conforms to :class:`Runnable`
    (string annotations are resolved in ``fn``'s module; an unresolvable one is not)."""
    try:
        annotation = typing.get_type_hints(fn).get("return")
    except Exception:  # a forward reference its module cannot resolve
        return False
    return isinstance(annotation, type) and not runnable_problems(annotation)
