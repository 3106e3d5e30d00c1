"""What the toolkit makes of a run's records (all from
:class:`~policy_probes.records.RunRecords`; the sinks import nothing from here): findings,
the HTML report, forked arms, heatmaps and per-layer figures, ``policy-probes diagnose``
and the session's live analysis."""
