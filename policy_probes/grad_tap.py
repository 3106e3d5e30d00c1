"""One autograd tensor hook per tensor, shared by every probe that wants its gradient
(:func:`on_grad` fans it out to the subscribers, a list that lives on the tensor).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch

from policy_probes.torch_internals import set_tensor_slot, tensor_slot

GradCallback = Callable[[torch.Tensor], None]

_ATTR = "_policy_probes_grad_subscribers"

log = logging.getLogger("policy_probes")
_warned_traced = False
#: ``torch.compiler.disable(_traced)`` (run eagerly, at a graph break, each time compiled code
#: reaches a tap), made at the first tap once dynamo is loaded: decorating at import would
#: import dynamo with this module: 2.2-2.9 s of every start of `import trainers` here
_traced_eager: Callable[[], None] | None = None


def on_grad(tensor: torch.Tensor, callback: GradCallback) -> None:
    """Call ``callback(grad)`` when the gradient of ``tensor`` (which requires grad) is
    computed. The callback must not modify ``grad``, return anything or raise (that
    propagates into ``backward()``), nor hold ``tensor`` itself (hold ``tensor.detach()``):
    autograd keeps the hook alive from C++, so that cycle would never be freed."""
    global _traced_eager
    if torch.compiler.is_compiling():  # dynamo cannot trace the tensor's Python slot
        (_traced_eager or _traced)()
        return
    if _traced_eager is None and "torch._dynamo" in sys.modules:  # on the host, once
        _traced_eager = torch.compiler.disable(_traced)
    subscribers: list[GradCallback] | None = tensor_slot(tensor, _ATTR)
    if subscribers is None:
        subscribers = [callback]
        set_tensor_slot(tensor, _ATTR, subscribers)
        tensor.register_hook(_FanOut(subscribers))
    else:
        subscribers.append(callback)


class _FanOut:
    """The one tensor hook of a tapped tensor (a slotted object, lighter than a closure)."""

    __slots__ = ("subscribers",)

    def __init__(self, subscribers: list[GradCallback]) -> None:
        self.subscribers = subscribers

    def __call__(self, grad: torch.Tensor) -> None:
        for callback in self.subscribers:
            callback(grad)


def _traced() -> None:
    global _warned_traced
    if not _warned_traced:
        _warned_traced = True
        log.warning(
            "a backward probe's gradient tap is inside code torch.compile is compiling (the "
            "probes' force_eager stance was overridden, e.g. by torch.compiler.set_stance in "
            "the loop): the gradients of those passes are not observed; see docs/compile.md"
        )
