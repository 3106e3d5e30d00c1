"""WandbSink: one Weights & Biases run per training run, files under ``run_dir/wandb/``
(offline without an API key; ``docs/sinks.md``).

Scalars every epoch, per-unit vectors as histograms every ``histogram_every`` epochs and
for the last, figures every ``heatmap_every`` epochs and at close, findings in the run
summary; credential-like config values are redacted. A resumed run appends to the same W&B
run (id in ``run_dir/wandb/policy_probes_run_id``); since every ``wandb.init`` writes a new
run folder counting ``_step`` from 0, the sink reads the earlier folders' history back
(:func:`run_history_position`: a LevelDB-style log of ``wandb_internal_pb2.Record``, read
up to its first damaged chunk) and lines it up with ``metrics.jsonl``
(:meth:`WandbSink._settle_resume`), so every epoch is uploaded once on increasing steps."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import string
import struct
import tempfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_probes.atomic_write import write_text_atomic
from policy_probes.plugins import register
from policy_probes.records import (
    METRICS_JSONL,
    POST_EPOCH,
    Figures,
    Record,
    finite_values,
    is_finite_number,
    iter_jsonl,
)
from policy_probes.sinks.base import MetricSink
from policy_probes.sinks.config import SinkSetup, WandbConfig

logger = logging.getLogger("policy_probes.sinks")

RUN_ID_FILE = "policy_probes_run_id"
_SECRET_KEY = re.compile(r"(api[_-]?key|token|secret|password|passwd|credential)", re.IGNORECASE)
REDACTED = "<redacted>"


@register
class WandbSink(MetricSink):
    """Metrics to a W&B run (offline by default on machines without an API key)."""

    name = "wandb"
    logs_figures = True

    @classmethod
    def from_setup(cls, setup: SinkSetup) -> WandbSink | None:
        """None when ``wandb.mode`` resolves to ``disabled``."""
        if setup.wandb.resolved_mode() == "disabled":
            return None
        return cls(setup.run_dir, setup.wandb, setup.config)

    def __init__(
        self,
        run_dir: str | Path,
        cfg: WandbConfig | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        import wandb  # imported here: it is slow to import and optional at run time

        self._wandb = wandb
        self.cfg = cfg or WandbConfig()
        self.run_dir = Path(run_dir)
        self.mode = self.cfg.resolved_mode()
        continued = (self.run_dir / "wandb" / RUN_ID_FILE).is_file()  # a resumed run
        self.run_id = load_or_create_run_id(self.run_dir)
        #: epochs up to this one are in W&B already: not logged again (the rule when
        #: there is no metrics.jsonl to count records against)
        self.skip_through: int | None = None
        #: what W&B holds from earlier processes (read before wandb.init creates this
        #: process's run folder); how many of the next emits repeat its records is
        #: settled by :meth:`_settle_resume` at the first rewind or emit
        self._held = run_history_position(self.run_dir / "wandb", self.run_id)
        self._skip_emits = 0
        self._unsettled = continued
        self._step = self._held.next_step
        self._last_heatmap_epoch: int | None = None
        self._last_epoch: int | None = None
        #: (epoch, per-unit vectors) of the last row logged without its histograms:
        #: logged at close if that epoch is the last
        self._unlogged_vectors: tuple[int, dict[str, list[float]]] | None = None
        #: the run's findings as last handed over, for the run summary at close
        self.findings: tuple[Mapping[str, Any], ...] | None = None
        self._final_figures: Figures = {}
        settings = wandb.Settings(
            silent=True,
            console="off",  # the trainer owns the terminal; no stdout capture
            x_disable_stats=True,  # no system-metrics sampling thread
            save_code=False,
            x_save_requirements=False,
        )
        self.run = wandb.init(
            dir=str(self.run_dir),
            mode=self.mode,
            project=self.cfg.project,
            entity=self.cfg.entity,
            group=self.cfg.group,
            tags=list(self.cfg.tags) or None,
            name=self.cfg.name or self.run_dir.resolve().name,
            notes=self.cfg.notes,
            config=redact_secrets(dict(config or {})),
            id=self.run_id,
            resume="allow",
            reinit="create_new",  # never finish or hijack a run the user opened
            settings=settings,
        )
        self.run.define_metric("epoch")
        self.run.define_metric("agent_step")
        self.run.define_metric("*", step_metric="epoch")

    def emit(self, record: Record) -> None:
        if self._unsettled:
            self._settle_resume(None)
        epoch = record.epoch
        if record.findings is not None:
            self.findings = record.findings
        row: dict[str, Any] = {"epoch": epoch}
        if record.agent_step is not None:
            row["agent_step"] = record.agent_step
        vectors: dict[str, list[float]] = {}
        for key, value in record.metrics.items():
            if isinstance(value, list):
                vectors[key] = value
            elif isinstance(value, bool):
                row[key] = int(value)
            elif is_finite_number(value):
                row[key] = value
            # None, NaN/inf and strings are left out of W&B (JSONL keeps them)
        if self._skip_emits > 0:  # W&B holds this record already
            self._skip_emits -= 1
            return
        if self.skip_through is not None and epoch <= self.skip_through:
            return  # W&B holds this epoch already
        self._last_epoch = epoch
        if epoch % self.cfg.histogram_every == 0:
            row.update(histograms(self._wandb, vectors))
            self._unlogged_vectors = None
        elif vectors:
            self._unlogged_vectors = (epoch, vectors)
        if not record.figures:
            self._log(row)
            return
        with tempfile.TemporaryDirectory() as folder:  # the PNGs until W&B copies them
            row.update(self._images(record.figures, epoch, Path(folder)))
            self._log(row)

    def wants_figures(self, record: Record | None) -> bool:
        """The figures at the epoch record of every ``heatmap_every``-th epoch (a figure
        takes ~0.1 s), and at close unless the last epoch's are logged."""
        if record is None:
            return self._last_epoch is not None and self._last_epoch != self._last_heatmap_epoch
        every = self.cfg.heatmap_every
        return every is not None and record.hook_point == POST_EPOCH and record.epoch % every == 0

    def final_figures(self, figures: Figures) -> None:
        self._final_figures = figures

    def rewind(self, last_epoch: int) -> int:
        """W&B cannot drop rows: the records after ``last_epoch`` it holds are skipped when
        emitted again (:meth:`_settle_resume`). Returns 0."""
        if self._unsettled:
            self._settle_resume(last_epoch)
        return 0

    def _settle_resume(self, last_epoch: int | None) -> None:
        """Line W&B up with ``metrics.jsonl`` once, when a resumed run starts.

        The JSONL sink writes each record before W&B's service does, so W&B holds the
        first N records. The resumed run continues after the K records of epochs up to
        ``last_epoch`` (the checkpoint; None: all), emitting what the killed run emitted
        next: N < K, log the JSONL records N+1..K; N > K, skip the next N - K emits.
        Counting records, not epochs, keeps an epoch W&B holds only in part whole."""
        self._unsettled = False
        path = self.run_dir / METRICS_JSONL
        if not path.is_file():  # nothing to count against: skip whole epochs W&B has
            self.skip_through = self._held.last_epoch
            return
        records = [
            Record.from_json(r)
            for r in iter_jsonl(path)
            if isinstance(r.get("epoch"), int) and (last_epoch is None or r["epoch"] <= last_epoch)
        ]
        held = self._held.records
        if held >= len(records):
            self._skip_emits = held - len(records)
            return
        missing = records[held:]
        for record in missing:
            self.emit(record)
        logger.warning(
            "W&B run %s lacked %d records of epochs %d-%d (not written before the previous "
            "process ended); logged them from %s",
            self.run_id,
            len(missing),
            missing[0].epoch,
            missing[-1].epoch,
            path,
        )

    def _log(self, row: dict[str, Any]) -> None:
        """One history row on the next step (explicit: the step continues across resumes)."""
        self.run.log(row, step=self._step)
        self._step += 1

    def _images(self, figures: Figures, epoch: int, folder: Path) -> dict[str, Any]:
        """``key -> wandb.Image`` of each figure, from PNG files in ``folder`` (which must
        outlive the row's ``log``): made from a file, an image is not encoded again."""
        files: dict[int, str] = {}  # one file per drawing (equal histories share one)

        def image(png: bytes, caption: str) -> Any:
            path = files.get(id(png))
            if path is None:
                path = files[id(png)] = str(folder / f"{len(files)}.png")
                Path(path).write_bytes(png)
            return self._wandb.Image(path, caption=caption)

        self._last_heatmap_epoch = epoch
        return {key: image(png, caption) for key, (png, caption) in figures.items()}

    def flush(self) -> None:
        """W&B writes from its own service process; nothing is buffered here."""

    def close(self) -> None:
        """Log the final heatmaps (if new epochs came since the last ones) and finish."""
        run = getattr(self, "run", None)
        if run is None:
            return
        try:
            final: dict[str, Any] = {}
            unlogged = self._unlogged_vectors
            if unlogged is not None and unlogged[0] == self._last_epoch:
                final.update(histograms(self._wandb, unlogged[1]))  # the last epoch's
            with tempfile.TemporaryDirectory() as folder:  # the PNGs until W&B copies them
                if self._final_figures and self._last_epoch is not None:
                    final.update(self._images(self._final_figures, self._last_epoch, Path(folder)))
                if final:
                    self._log({"epoch": self._last_epoch, **final})
            if self.findings is not None:  # the run summary (docs/findings.md)
                tiers = [f.get("tier") for f in self.findings]
                run.summary["findings/count"] = tiers.count("finding")
                run.summary["findings/observations"] = tiers.count("observation")
                run.summary["findings/list"] = [dict(f) for f in self.findings]
        finally:
            self.run = None
            run.finish()
            self._wait_for_service()

    def _wait_for_service(self) -> None:
        """Make the run's files complete: ``run.finish()`` only tells W&B's service
        process, which writes ``run-<id>.wandb`` later. With no other W&B run active in
        this process (one the user opened) the service is torn down, which waits for
        every stream; a later ``wandb.init`` starts a new one."""
        wandb = self._wandb
        try:
            from wandb.sdk import wandb_setup

            if wandb_setup.singleton().most_recent_active_run is None:
                wandb.teardown()
        except Exception as exc:  # noqa: BLE001 - never fail close() over this
            logger.warning("could not wait for the W&B service to write the run: %s", exc)

    def __repr__(self) -> str:
        return f"WandbSink(mode={self.mode!r}, run_id={self.run_id!r})"


def histograms(wandb: Any, vectors: Mapping[str, list[float]]) -> dict[str, Any]:
    """``key -> wandb.Histogram`` of the finite values of each per-unit vector that has any."""
    finite = {key: finite_values(value) for key, value in vectors.items()}
    return {key: wandb.Histogram(values) for key, values in finite.items() if values}


def load_or_create_run_id(run_dir: Path) -> str:
    """The W&B run id in ``run_dir/wandb/policy_probes_run_id``, created on first use."""
    path = run_dir / "wandb" / RUN_ID_FILE
    try:
        run_id = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        run_id = ""
    if run_id:
        return run_id
    alphabet = string.ascii_lowercase + string.digits  # as W&B's own ids
    run_id = "".join(secrets.choice(alphabet) for _ in range(8))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, run_id + "\n")
    return run_id


def redact_secrets(config: Any) -> Any:
    """A copy of ``config`` with values under credential-like keys (api_key, token, secret,
    password) and any value equal to ``WANDB_API_KEY`` replaced by ``"<redacted>"``."""
    key = os.environ.get("WANDB_API_KEY")
    if isinstance(config, Mapping):
        return {
            k: REDACTED if _SECRET_KEY.search(str(k)) and v is not None else redact_secrets(v)
            for k, v in config.items()
        }
    if isinstance(config, list | tuple):
        return [redact_secrets(v) for v in config]
    if key and isinstance(config, str) and key in config:
        return config.replace(key, REDACTED)
    return config


# ---------------------------------------------------------------------- earlier run files
_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
#: keys of the image-only rows a sink logs when it closes (not records of metrics.jsonl)
_IMAGE_PREFIXES = ("heatmaps/", "layers/")
_ROW_FIELDS = {"epoch", "_step", "_runtime", "_timestamp"}


@dataclass(frozen=True)
class WandbHistoryPosition:
    """Where a W&B run's history stands: the highest ``epoch`` logged (None: none), the
    ``_step`` the next row gets, and ``records``: how many rows hold a record (one per
    emitted record, in the order ``metrics.jsonl`` holds them; the image-only rows a
    closing sink adds are not counted)."""

    last_epoch: int | None = None
    next_step: int = 0
    records: int = 0


def _records(data: bytes) -> list[bytes]:
    """The complete records of a run file (stops at the first damaged chunk)."""
    if len(data) < 7 or data[:4] != b":W&B":
        return []
    pos, pending, out = 7, b"", []
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # block trailer
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            break
        pos += _CHUNK_HEADER + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            out.append(pending)
            pending = b""
    return out


def run_history_position(wandb_dir: Path, run_id: str) -> WandbHistoryPosition:
    """Where the history rows of every earlier run folder of ``run_id`` leave it."""
    from wandb.proto import wandb_internal_pb2 as pb

    last_epoch: int | None = None
    next_step = records = 0
    for run_file in sorted(Path(wandb_dir).glob(f"*run-*-{run_id}/run-{run_id}.wandb")):
        try:
            data = run_file.read_bytes()
        except OSError as exc:
            logger.warning("could not read the earlier W&B run file %s: %s", run_file, exc)
            continue
        for raw in _records(data):
            record = pb.Record()
            try:
                record.ParseFromString(raw)
            except Exception:  # noqa: BLE001 - a record we cannot parse is not history we own
                continue
            if record.WhichOneof("record_type") != "history":
                continue
            next_step = max(next_step, record.history.step.num + 1)
            images_only = True
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if key not in _ROW_FIELDS and not key.startswith(_IMAGE_PREFIXES):
                    images_only = False
                if key == "_step":
                    next_step = max(next_step, int(json.loads(item.value_json)) + 1)
                elif key == "epoch":
                    epoch = int(json.loads(item.value_json))
                    last_epoch = epoch if last_epoch is None else max(last_epoch, epoch)
            records += not images_only
    return WandbHistoryPosition(last_epoch, next_step, records)
