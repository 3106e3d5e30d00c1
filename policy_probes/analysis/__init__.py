"""What the toolkit makes of a run's records: the findings (:mod:`.findings`), the HTML
report (:mod:`.report`), forked arms (:mod:`.arms`), the heatmaps and per-layer figures
(:mod:`.heatmaps`, :mod:`.layer_figures`), ``policy-probes diagnose`` (:mod:`.diagnose`)
and the session's live analysis (:mod:`.live`). Everything here reads
:class:`~policy_probes.records.RunRecords`; the sinks import nothing from it."""
