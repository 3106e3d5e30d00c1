"""ReLU activation probe: dead, dormant, rarely/always active units.

Definitions (h the probed post-activation output, N samples in the window, U units):

* ``active_rate[u]`` = fraction of samples with h_u > 0
* ``dead_fraction`` = fraction of units with active_rate 0
* ``dormant_fraction`` = ReDo tau-dormant fraction (Sokar et al., 2023): score
  s_u = mean|h_u| / ((1/U) sum_k mean|h_k|), dormant when s_u <= tau
* ``dormant_fraction_tau_<t>`` = the same fraction at each threshold t of ``taus``
  (default 0, 0.025, 0.1, the thresholds ReDo's reference code logs together); ``<t>`` is
  :func:`tau_key`, one distinct name for every distinct threshold
* ``rarely_active_fraction`` (active_rate < 0.05), ``always_active_fraction`` (> 0.95)
* ``zero_fraction`` = fraction of elements <= 0
* ``active_rate_se`` = mean over units of the standard error sqrt(p (1 - p) / N) of
  ``active_rate``; ``zero_fraction_se`` likewise over the elements
* ``samples`` = the rows N these rest on. On sampled passes (:mod:`policy_probes.sampling`)
  a dead unit is one never active in the N observed rows
* ``dead_fraction_ref``, ``dormant_fraction_ref`` = ``dead_fraction`` and
  ``dormant_fraction`` (at ``tau``) on the run's fixed reference states instead of the
  window's rows (:mod:`policy_probes.reference_states`): the same tensor, measured once
  per report (``reference=False``: not at all)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.plugins import Rule, register
from policy_probes.probes.observation import Observation
from policy_probes.probes.per_layer import ActivationProbe
from policy_probes.probes.reference_scores import ReferenceScores, UnitValues
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import Drained, row_means, unit_rates
from policy_probes.probes.weighted import Weighted
from policy_probes.sampling import standard_error

# ReDo divides by the layer mean plus a small constant; all-zero layers are all dormant.
DORMANT_EPS = 1e-9
#: the thresholds ReDo's reference code (google/dopamine labs/redo) logs at once
DORMANT_TAUS: tuple[float, ...] = (0.0, 0.025, 0.1)


def tau_key(tau: float) -> str:
    """The ``<t>`` of ``dormant_fraction_tau_<t>``: ``%g`` (``0``, ``0.025``, ``1e-05``) when
    that reads back as exactly ``tau``, else the shortest string that does (``repr``:
    ``0.1000001``). Distinct thresholds get distinct names; -0.0 is named as 0."""
    tau = float(tau) + 0.0  # -0.0 -> 0.0
    short = f"{tau:g}"
    return short if float(short) == tau else repr(tau)


@register
class ReLUActivation(ReferenceScores, ActivationProbe):
    """Dead, dormant, rarely and always active ReLU units: per-unit counts of positive
    elements and sums of |h| over the window, and on the reference states at each report.
    :attr:`scores` keeps the per-unit ReDo scores of the last report (NaN for units with
    no finite value) for the remedies."""

    name = "relu"
    batch_units = True
    maker = "attach_relu_activation_hooks()"
    docs = "docs/probes/relu.md"
    metrics = {
        "dead_fraction": "share of units never positive",
        "dormant_fraction": "share of units whose ReDo score is at most tau",
        "active_rate": "per unit: share of samples where it is positive",
        "dead_fraction_ref": "share of units never positive on the reference states",
        "dormant_fraction_ref": "share of units whose ReDo score on the reference states "
        "is at most tau",
    }
    console = ("dead_fraction", "dormant_fraction")
    rules = (
        Rule(
            name="dead_units",
            title="units went silent on the reference states",
            metric="dead_fraction_ref",
            direction="rising",
            kind="level",
            threshold=0.1,
            min_change=0.1,
            threshold_source="policy-probes default, not from a paper; read on the run's "
            "fixed reference states so a narrowing state distribution does not count",
            docs="docs/probes/relu.md",
            remedies=("redo", "reset_layers"),
            meaning="a tenth of the layer's units or more became zero on every one of the run's "
            "fixed reference states, within a few epochs: they get no gradient there. Whether "
            "the network lost plasticity is what probes/trainability tests",
        ),
        Rule(
            name="dormant_units",
            title="units went dormant on the reference states",
            metric="dormant_fraction_ref",
            direction="rising",
            kind="level",
            threshold=0.2,
            min_change=0.1,
            threshold_source="policy-probes default, not from a paper; the dormancy score "
            "and tau = 0.025 are ReDo's (Sokar et al., ICML 2023)",
            docs="docs/probes/relu.md",
            remedies=("redo", "shrink_and_perturb", "reset_layers"),
            meaning="more units pass almost no signal (mean |h| at most tau of the layer mean) "
            "on the run's fixed reference states than a few epochs before. Whether the network "
            "lost plasticity is what probes/trainability tests",
        ),
    )

    def __init__(
        self,
        *,
        tau: float = 0.025,
        taus: Iterable[float] = DORMANT_TAUS,
        rarely_active: float = 0.05,
        always_active: float = 0.95,
        reference: bool = True,
    ) -> None:
        if not tau >= 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        taus = tuple(float(t) for t in taus)
        if not all(t >= 0 for t in taus):
            raise ValueError(f"every threshold in taus must be >= 0, got {taus}")
        if len(set(taus)) != len(taus):
            repeated = sorted({t for t in taus if taus.count(t) > 1})
            raise ValueError(
                f"taus holds the threshold(s) {repeated} more than once, got {taus}; each "
                f"threshold names one key (dormant_fraction_tau_<t>), so list each once"
            )
        super().__init__(
            tau=tau,
            taus=taus,
            rarely_active=rarely_active,
            always_active=always_active,
            reference=bool(reference),
        )
        self.scores: dict[str, torch.Tensor] = {}

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        handles = super().attach(obs, module)
        self.read_reference(obs.component, obs, module, obs.channels_first, obs.extract)
        for layer in self.layers[obs.component]:
            if self.owns(layer.component, obs):
                self.read_reference(layer.component, obs, layer.module, layer.channels_first)
        return handles

    def reference_sums(self, name: str, values: UnitValues) -> dict[str, torch.Tensor]:
        return {"count": values.count(), "active": values.positive(), "abs_sum": values.abs_sum()}

    def to_metrics(self) -> dict[str, float | list[float]]:
        self.scores = {}  # only this window's components
        out = super().to_metrics()
        for name, s in self.reference_host().items():
            if self.key(name, "dead_fraction") in out:  # beside the window's keys
                out.update(
                    (self.key(name, k), v)
                    for k, v in reference_fractions(s, self.settings[name]["tau"]).items()
                )
        return out

    def _mirror_summary(self, component: str, source: str, summary: dict) -> dict:
        self.scores[component] = self.scores[source]
        return super()._mirror_summary(component, source, summary)

    def consume(self, batch: Drained) -> None:
        component, (h,), weight = batch.component, batch.cols, batch.weight
        kept = Weighted(h, weight)  # rows the row mask keeps (all without one)
        self._add(component, "count", kept.finite_count(), COUNT)
        self._add(component, "active", kept.counts(h.positive()), COUNT)
        self._add(component, "abs_sum", kept.sums(torch.abs(h.clean, out=self.scratch(h.clean))))
        self._add(component, "nonfinite", kept.nonfinite_counts(), COUNT)

    def summarize_alike(
        self, components: list[str], s: dict[str, torch.Tensor], cfg: dict[str, Any]
    ) -> list[dict]:
        # numpy on the host copies, a row per layer (torch calls cost more in dispatch)
        parts = len(components)
        count = s["count"].numpy().reshape(parts, -1)
        active = s["active"].numpy().reshape(parts, -1)
        active_rate = unit_rates(active, count)
        mean_abs = unit_rates(s["abs_sum"].numpy().reshape(parts, -1), count)
        seen = count > 0
        units = np.count_nonzero(seen, axis=1).tolist()
        score = mean_abs / (row_means(mean_abs, seen) + DORMANT_EPS)[:, None]
        finite_total = count.sum(1).tolist()
        nonpos = (count.sum(1) - active.sum(1)).tolist()  # finite elements <= 0
        nonfinite = s["nonfinite"].numpy().reshape(parts, -1).sum(1).tolist()
        # standard errors as for independent rows (policy_probes.sampling.standard_error)
        se = row_means(np.sqrt(active_rate * (1 - active_rate) / np.maximum(count, 1)), seen)
        masks = {
            **{
                f"dormant_fraction_tau_{tau_key(t)}": score <= t
                for t in cfg.get("taus", DORMANT_TAUS)
            },
            "dead_fraction": active_rate == 0,
            "dormant_fraction": score <= cfg["tau"],
            "rarely_active_fraction": active_rate < cfg["rarely_active"],
            "always_active_fraction": active_rate > cfg["always_active"],
        }
        shares = {k: np.count_nonzero(m & seen, axis=1).tolist() for k, m in masks.items()}
        scores = np.where(seen, score, np.nan)
        out = []
        for i, component in enumerate(components):
            self.scores[component] = torch.from_numpy(scores[i])
            n, total = units[i], finite_total[i]
            elements = total + nonfinite[i]
            zero = nonpos[i] / total if total else 0.0
            summary = {k: v[i] / n if n else 0.0 for k, v in shares.items()}
            summary.update(
                active_rate=active_rate[i].tolist(),
                active_rate_se=float(se[i]),
                zero_fraction=zero,
                zero_fraction_se=standard_error(zero, total),
                nonfinite_fraction=(elements - total) / elements if elements else 0.0,
                samples=samples(count[i], cfg),
            )
            out.append(summary)
        return out


def reference_fractions(s: dict[str, torch.Tensor], tau: float) -> dict[str, float]:
    """``dead_fraction_ref`` and ``dormant_fraction_ref`` of the reference sums ``s``
    (host): the window's formulas over the units with a finite value on the set."""
    count = s["count"].numpy()
    seen = count > 0
    units = int(np.count_nonzero(seen))
    if not units:
        return {}
    mean_abs = unit_rates(s["abs_sum"].numpy(), count)
    score = mean_abs / (mean_abs[seen].mean() + DORMANT_EPS)
    dead = (s["active"].numpy() == 0) & seen
    dormant = (score <= tau) & seen
    return {
        "dead_fraction_ref": int(np.count_nonzero(dead)) / units,
        "dormant_fraction_ref": int(np.count_nonzero(dormant)) / units,
    }


def samples(count: torch.Tensor | np.ndarray, cfg: dict[str, Any]) -> float:
    """Batch rows recorded: the largest per-unit finite count over positions per sample."""
    rows = int(count.max()) if math.prod(count.shape) else 0
    per_sample = cfg.get("positions", 1)
    return float(rows) if per_sample == 1 else rows / per_sample


def attach_relu_activation_hooks(
    *,
    tau: float = 0.025,
    taus: Iterable[float] = DORMANT_TAUS,
    rarely_active: float = 0.05,
    always_active: float = 0.95,
    reference: bool = True,
) -> ReLUActivation:
    """The ``relu`` probe (:class:`ReLUActivation`), for a component whose output is
    post-activation (``actor_mlp``; on a pre-activation the metrics describe its sign).
    ``taus``: the thresholds of the ``dormant_fraction_tau_<t>`` keys (``<t>``:
    :func:`tau_key`), each listed once, beside ``dormant_fraction`` (at ``tau``).
    ``reference``: also report ``dead_fraction_ref`` and ``dormant_fraction_ref`` on the
    run's reference states (docs/reference_states.md). Placed with every placement
    argument."""
    return ReLUActivation(
        tau=tau,
        taus=taus,
        rarely_active=rarely_active,
        always_active=always_active,
        reference=reference,
    )
