"""User errors: what fails while a run is set up (an unknown component, an unwritable
``run_dir``) is tagged ``usage_error = True`` and printed on one line by the CLI (exit
status 2, no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator

from pydantic import ValidationError


class ProbeError(RuntimeError):
    """A probe cannot work on the component it was attached to; the message says why."""


#: the exception types that mean "the configuration is wrong" when raised during set-up
SETUP_ERROR_TYPES = (KeyError, TypeError, ValueError, ProbeError, OSError)


class CLIError(Exception):
    """A usage error: the command line prints it without a traceback, exit status 2."""

    usage_error = True


def mark_usage_error(exc: BaseException) -> BaseException:
    """Tag ``exc`` as the user's to fix (the CLI prints it without a traceback); returns it."""
    with contextlib.suppress(AttributeError):  # a type with __slots__: left untagged
        exc.usage_error = True  # type: ignore[attr-defined]
    return exc


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Tag the :data:`SETUP_ERROR_TYPES` raised inside the block as usage errors."""
    try:
        yield
    except SETUP_ERROR_TYPES as exc:
        mark_usage_error(exc)
        raise


def is_usage_error(exc: BaseException) -> bool:
    return bool(getattr(exc, "usage_error", False))


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (``KeyError`` without its quotes; a multi-line
    message, such as pydantic's, joined with ``; ``)."""
    text = str(exc)
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        text = exc.args[0]
    elif isinstance(exc, ValidationError):
        text = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<config>'}: {_message(err)}"
            for err in exc.errors()
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines) or type(exc).__name__


def _message(err: dict) -> str:
    """One pydantic error's message, saying what was given where that helps."""
    if err.get("type") == "finite_number":
        return f"got {err.get('input')}; give a finite number"
    return str(err["msg"])


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1 (argparse exits 2 naming the option otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value
