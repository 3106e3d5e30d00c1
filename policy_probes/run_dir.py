"""Kept for imports of the earlier module: the run directory is :mod:`policy_probes.run`'s."""

from policy_probes.run import (  # noqa: F401
    NAME_MAX,
    RUN_MARKERS,
    RUN_OUTPUTS,
    RunDirConflict,
    check_run_dir_path,
    default_run_dir,
    held_outputs,
    make_run_dir,
    remove_outputs,
)
