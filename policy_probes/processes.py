"""Where this process stands in a ``torch.distributed`` run (a leaf module: the trackers,
the reporter, the remedies and the lifecycle hooks all ask)."""

from __future__ import annotations

from typing import Any

import torch


def current_rank() -> int:
    """Rank in the default process group; 0 when torch.distributed is not initialised."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def multi_process(group: Any = None) -> bool:
    """Whether ``group`` (default: the default group) spans more than one process."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
