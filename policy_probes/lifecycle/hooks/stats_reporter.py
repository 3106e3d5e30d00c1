"""stats_reporter: the module probes' trackers, turned into metrics once per epoch."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from policy_probes.lifecycle.hook import HookConfig, TrainingHook
from policy_probes.lifecycle.points import HookPoint
from policy_probes.lifecycle.registry import HookRegistry
from policy_probes.lifecycle.run_context import RunDataContext
from policy_probes.stats_reporter import StatsReporter


class StatsReporterConfig(HookConfig):
    all_reduce: bool = Field(True, description="all-reduce trackers across ranks first")


@HookRegistry.register
class StatsReporterHook(TrainingHook):
    """Runs ``StatsReporter(ctx.component_context).collect()``: every tracker's
    ``to_metrics()`` then ``reset()``. Keys stay ``probes/<probe>/<component>/<metric>``
    (``namespaced = False``), so probes and hooks reach the sinks through one path with
    the keys the dashboards expect. Without a component context it reports nothing."""

    name = "stats_reporter"
    runs_model = False  # reads state only; no passes through the model
    description = "module probe trackers (dead ReLUs, saturation, Fisher, gradient flow) -> metrics"
    hook_points = (HookPoint.POST_EPOCH,)
    cost = "free"
    namespaced = False
    auto_include = True
    run_on_all_ranks = True  # the all-reduce of the trackers is a collective
    order = 1
    groups = ("minimal",)
    Config = StatsReporterConfig
    metrics = {
        "probes/<probe>/<component>/<metric>": "every attached probe's metrics (docs/probes/)",
        "probes/errors/<probe>/<component>": "1.0 for a probe disabled after raising",
    }

    def compute(self, ctx: RunDataContext) -> dict[str, Any]:
        if ctx.component_context is None:
            return {}
        return StatsReporter(ctx.component_context, all_reduce=self.config.all_reduce).collect()
