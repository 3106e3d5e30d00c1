"""Records: what a run emits (:class:`Record`, one ``metrics.jsonl`` line), made plain once,
and the store of their series (:class:`RunRecords`), with the helpers every reader and
writer shares. A leaf module: it imports nothing from ``policy_probes``."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("policy_probes.sinks")

METRICS_JSONL = "metrics.jsonl"
_ABSENT = object()
#: key of the JSONL field listing the metrics whose values were NaN or infinite
NONFINITE_KEY = "_nonfinite"
#: the fields a record carries beside its metrics (a metric of such a name is left out)
RESERVED_KEYS = ("epoch", "agent_step", "hook_point", "time", NONFINITE_KEY)
#: the hook point of the epoch's own record; the series read these records only
POST_EPOCH = "POST_EPOCH"

#: rendered figures: ``heatmaps/...`` or ``layers/...`` key -> (PNG bytes, caption)
Figures = Mapping[str, tuple[bytes, str]]


@dataclass(frozen=True, slots=True)
class Record:
    """One emit: ``metrics`` flat (``a/b/c`` keys) and plain (:func:`to_plain`); on
    ``POST_EPOCH`` records the run's ``findings`` (plain dicts, earliest onset first) and
    ``findings_text``; ``figures`` for a sink that asked for them."""

    epoch: int
    hook_point: str
    agent_step: int | None
    metrics: Mapping[str, Any]
    findings: tuple[Mapping[str, Any], ...] | None = None
    findings_text: str | None = None
    figures: Figures | None = None

    @classmethod
    def of(
        cls,
        metrics: Mapping[str, Any],
        epoch: int,
        hook_point: str = POST_EPOCH,
        agent_step: int | None = None,
    ) -> Record:
        """The record of ``metrics`` (nested mappings flattened, values made plain)."""
        step = None if agent_step is None else int(agent_step)
        return cls(int(epoch), str(hook_point), step, plain_metrics(metrics))

    @classmethod
    def from_json(cls, line: Mapping[str, Any]) -> Record:
        """The record of one ``metrics.jsonl`` line (without a hook point: ``POST_EPOCH``)."""
        step = line.get("agent_step")
        return cls.of(line, line["epoch"], line.get("hook_point", POST_EPOCH), step)


class RunRecords:
    """The series by key of a run's ``POST_EPOCH`` records: ``scalars[key][epoch]`` (a
    float, a bool as it is, NaN for None or non-finite) and ``vectors[key][epoch]`` (a
    per-unit list); the last record of an epoch wins. ``keep``: which keys to keep (None:
    all); ``max_epochs``: the newest epochs kept per key (None: all; epochs in order).
    """

    def __init__(
        self, keep: Callable[[str], bool] | None = None, max_epochs: int | None = None
    ) -> None:
        self.keep = keep
        self.max_epochs = max_epochs
        self.scalars: dict[str, dict[int, float]] = {}
        self.vectors: dict[str, dict[int, list[Any]]] = {}
        self.agent_step: dict[int, int] = {}  # by epoch
        self.records = 0  # added, of every hook point
        #: the newest epoch of a POST_EPOCH record (None: none yet)
        self.last_epoch: int | None = None
        #: counts the adds that rewrote an epoch already held (readers start afresh)
        self.revision = 0
        self._seen: set[str] = set()
        self._kept: list[str] = []

    @classmethod
    def read(cls, run_dir: str | Path) -> RunRecords:
        """Every record of ``run_dir/metrics.jsonl`` (``FileNotFoundError`` without one)."""
        path = Path(run_dir) / METRICS_JSONL
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: RUN_DIR must be a run directory written with the jsonl "
                f"sink on (sinks.jsonl=true)"
            )
        return cls().extend(iter_jsonl(path))

    def extend(self, lines: Iterable[Mapping[str, Any]]) -> RunRecords:
        """Add the records of ``metrics.jsonl`` lines (those with an epoch); returns self."""
        for line in lines:
            if isinstance(line.get("epoch"), int):
                self.add(Record.from_json(line))
        return self

    def add(self, record: Record) -> None:
        """Add one record's values to the series of the keys kept."""
        epoch, bound = record.epoch, self.max_epochs
        self.records += 1
        if record.agent_step is not None:
            self.agent_step[epoch] = record.agent_step
            if bound is not None and len(self.agent_step) > bound:
                del self.agent_step[next(iter(self.agent_step))]
        if record.hook_point != POST_EPOCH:
            return
        if self.last_epoch is None or epoch > self.last_epoch:
            self.last_epoch = epoch
        else:
            self.revision += 1
        metrics = record.metrics
        if self.keep is not None:
            new = metrics.keys() - self._seen  # a record repeats its keys every epoch
            if new:
                self._seen |= new
                self._kept += [k for k in metrics if k in new and self.keep(k)]  # in order
        for key in metrics if self.keep is None else self._kept:
            value = metrics.get(key, _ABSENT)
            kind = type(value)
            if value is None or (kind is float and not math.isfinite(value)):
                series = self.scalars.setdefault(key, {})
                if epoch in series:
                    continue  # a value of this epoch stands
                value = math.nan
            elif kind is float or kind is int or kind is bool:
                series = self.scalars.setdefault(key, {})
                value = float(value) if kind is int else value
            elif kind is list:
                series = self.vectors.setdefault(key, {})
            else:
                continue  # strings, or a key this record lacks
            series[epoch] = value
            if bound is not None and len(series) > bound:
                del series[next(iter(series))]  # the oldest epoch (epochs come in order)

    def series(self, key: str) -> list[tuple[int, float]]:
        """``[(epoch, value)]`` of a scalar key, by epoch ([] for an unknown key)."""
        return sorted(self.scalars.get(key, {}).items())

    @property
    def epochs(self) -> list[int]:
        """Every epoch with a value, in order."""
        seen = {e for s in self.scalars.values() for e in s}
        return sorted(seen.union(*(v.keys() for v in self.vectors.values())))


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of a ``metrics.jsonl`` file; an unfinished last line is skipped
    quietly, another invalid line (not UTF-8, not JSON) with a warning naming it."""
    with open(path, "rb") as f:  # decoded line by line: one bad byte costs one line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                if raw.endswith(b"\n"):
                    what = "UTF-8" if isinstance(exc, UnicodeDecodeError) else "JSON"
                    logger.warning("%s:%d is not valid %s; skipped", path, lineno, what)
                continue
            if isinstance(record, dict):
                yield record


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` file (see :func:`iter_jsonl`)."""
    return list(iter_jsonl(path))


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into ``a/b/c`` keys (lifecycle hooks may return nested dicts)."""
    if not prefix and _flat(metrics):
        return dict(metrics)
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        full = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, full))
        else:
            out[full] = value
    return out


def plain_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Every metric flattened and made plain, but those named like a record's own fields.

    A value that cannot be made plain (its ``str`` raises) is dropped from the record with a
    warning naming its key, so one bad value never costs a sink or the rest of the record."""
    flat = metrics if _flat(metrics) else flatten_metrics(metrics)
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if key in _RESERVED:
            continue
        if not key.isascii():
            key = _plain_str(key)
        if type(value) in _AS_THEY_ARE:
            out[key] = value
            continue
        try:
            out[key] = to_plain(value)
        except Exception as exc:  # noqa: BLE001 - a user's value must not stop the record
            logger.warning(
                "metric %r dropped from the epoch's record: its value (%s) cannot be written "
                "(%s: %s)",
                key,
                type(value).__name__,
                type(exc).__name__,
                exc,
            )
    return out


_RESERVED = frozenset(RESERVED_KEYS)
#: the exact types that are plain as they are (a list of others is converted element-wise)
_PLAIN_SCALARS = frozenset({float, int, bool, str, type(None)})
#: those that need no look at their value (an int may be too wide, a str not encodable)
_AS_THEY_ARE = frozenset({float, bool, type(None)})
#: the integers every sink writes as integers (JSON writers such as orjson stop at 64 bits)
_INT_RANGE = (-(2**63), 2**64 - 1)


def _plain_str(value: str) -> str:
    """``value``, or with its unencodable characters (lone surrogates) as escapes."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def _plain_int(value: int) -> int | float | str:
    """``value`` if a 64-bit integer, else the nearest float (its digits where even a float
    cannot hold it)."""
    if _INT_RANGE[0] <= value <= _INT_RANGE[1]:
        return value
    try:
        return float(value)
    except OverflowError:
        return str(value)


def _flat(metrics: Mapping[str, Any]) -> bool:
    """Whether ``metrics`` has only string keys and no mapping values (asked per type)."""
    return set(map(type, metrics)) <= {str} and not any(
        kind is dict
        or (kind not in _PLAIN_SCALARS and kind is not list and issubclass(kind, Mapping))
        for kind in set(map(type, metrics.values()))
    )


def to_plain(value: Any) -> Any:
    """A JSON-safe copy of ``value``: tensors, numpy arrays and scalars as numbers or flat
    lists, plain types' subclasses as the plain type, integers wider than 64 bits as floats,
    lone surrogates in strings escaped, mappings as dicts, anything else as its ``str``."""
    kind = type(value)
    if kind in _AS_THEY_ARE:
        return value
    if kind is int:
        return _plain_int(value)
    if kind is str:
        return _plain_str(value)
    if isinstance(value, Mapping):
        return {_plain_str(str(k)): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if _AS_THEY_ARE.issuperset(map(type, value)):  # a per-unit vector: copy it
            return list(value)
        return [to_plain(v) for v in value]
    tolist = getattr(value, "tolist", None)  # torch.Tensor, numpy arrays and scalars
    if callable(tolist):
        detach = getattr(value, "detach", None)
        if callable(detach):
            value = detach().cpu()
            tolist = value.tolist
        plain = tolist()
        if isinstance(plain, list):
            return [to_plain(v) for v in _flatten_list(plain)]
        return to_plain(plain)
    for plain in (bool, int, float, str):  # subclasses (an IntEnum, a str Enum)
        if isinstance(value, plain):
            return to_plain(plain(value))
    return str(value)


def _flatten_list(values: list[Any]) -> Iterable[Any]:
    for v in values:
        if isinstance(v, list):
            yield from _flatten_list(v)
        else:
            yield v


def is_finite_number(value: Any) -> bool:
    """True for ints and finite floats (bools count as numbers)."""
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def finite_values(values: Iterable[Any]) -> list[float]:
    """The finite numeric elements of a per-unit vector (as it is when all are floats)."""
    if type(values) is not list:
        values = list(values)
    try:  # the common case, every element a finite float
        kinds = set(map(type, values))
        if kinds <= _FLOATS and all(map(math.isfinite, values)):
            return values if kinds <= {float} else list(map(float, values))
    except TypeError:
        pass
    return [float(v) for v in values if is_finite_number(v)]


_FLOATS = frozenset({float, int})


def vector_stats(values: list[Any]) -> tuple[float, float, float] | None:
    """Mean (``math.fsum`` over the count), min and max of the finite numeric elements of a
    per-unit vector, None when it has none."""
    try:
        total = math.fsum(values)
    except (TypeError, ValueError, OverflowError):
        total = math.nan
    if values and math.isfinite(total):
        return total / len(values), float(min(values)), float(max(values))
    finite = finite_values(values)
    if not finite:
        return None
    try:
        mean = math.fsum(finite) / len(finite)
    except OverflowError:  # the sum leaves the float range
        mean = math.fsum(v / len(finite) for v in finite)
    return mean, min(finite), max(finite)
