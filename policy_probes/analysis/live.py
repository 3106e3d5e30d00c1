"""LiveAnalysis: what a training session makes of its records while the run trains: a live
:class:`~policy_probes.records.RunRecords` of the series the findings and figures read, the
findings on each epoch's record, and the figures when a sink asks (the sinks only write)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from policy_probes.analysis.findings import WINDOW, FindingsEngine, Rule, render_text
from policy_probes.analysis.heatmaps import figure_png, heatmap_spec, render_heatmaps
from policy_probes.analysis.layer_figures import is_layer_metric, layer_figures
from policy_probes.records import METRICS_JSONL, POST_EPOCH, Record, RunRecords, iter_jsonl


class LiveAnalysis:
    """The live store of a run's records, its findings and its figures: ``rules`` and
    ``window`` as :class:`~.findings.FindingsEngine`'s, ``max_epochs`` kept per series."""

    def __init__(
        self, rules: Sequence[Rule] | None = None, window: int = WINDOW, max_epochs: int = 1000
    ) -> None:
        self.findings = FindingsEngine(rules, window)
        self.records = RunRecords(keep=self.keeps, max_epochs=max_epochs)
        #: whether to keep the series the figures draw; set before the first record
        self.with_figures = True
        self._epochs: set[int] = set()  # with a record: what the findings could judge

    def keeps(self, key: str) -> bool:
        """Whether the store keeps ``key``: a rule reads it or a figure draws it."""
        figure = self.with_figures and (heatmap_spec(key) is not None or is_layer_metric(key))
        return figure or self.findings.reads(key)

    def load(self, run_dir: str | Path) -> None:
        """Add the records a resumed run holds already (its rewound ``metrics.jsonl``)."""
        path = Path(run_dir) / METRICS_JSONL
        for line in iter_jsonl(path) if path.is_file() else ():
            if isinstance(line.get("epoch"), int):
                self.add(Record.from_json(line))

    def add(self, record: Record) -> Record:
        """Keep ``record``; an epoch's record (``POST_EPOCH``) is returned with the
        findings (plain dicts and their text), any other as it is."""
        self.records.add(record)
        if record.hook_point != POST_EPOCH:
            return record
        self._epochs.add(record.epoch)
        self.findings.update(self.records)
        found = self.findings.findings()
        findings = tuple(f.to_dict() for f in found)
        text = render_text(found, self.findings.coverage(len(self._epochs)))
        r = record
        return Record(r.epoch, r.hook_point, r.agent_step, r.metrics, findings, text)

    def figures(self) -> dict[str, tuple[bytes, str]]:
        """The run's figures so far (``heatmaps/...``, ``layers/...``)."""
        out = render_heatmaps(self.records)
        epoch = self.records.last_epoch
        for slug, component, fig in layer_figures(self.records):
            caption = f"{slug} per layer of {component}, up to epoch {epoch}"
            out[f"layers/{slug}/{component}"] = (figure_png(fig), caption)
        return out
