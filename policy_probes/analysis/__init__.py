"""What the toolkit makes of a run's records (all read from
:class:`~policy_probes.records.RunRecords`; the sinks import nothing from here): findings
and ``policy-probes diagnose``, the HTML report, forked arms, heatmaps and per-layer
figures, and the session's live analysis."""
