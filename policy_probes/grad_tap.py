"""One autograd tensor hook per tensor, shared by every probe that wants its gradient.

Several probes often read the gradient of the same tensor: on an MLP component that ends
in its activation, ``fisher`` (per-unit), ``gradient_flow`` and ``relu_gradient_flow``
(last ReLU) all want the gradient of the component's output. Each
``Tensor.register_hook`` costs a registration in the forward pass and a call from the
autograd engine into Python in the backward pass, so :func:`on_grad` registers one hook
per tensor and fans the gradient out to the subscribers, in subscription order. The
subscriber list lives on the tensor itself, so it is freed with the tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from policy_probes.torch_internals import set_tensor_slot, tensor_slot

GradCallback = Callable[[torch.Tensor], None]

_ATTR = "_policy_probes_grad_subscribers"

log = logging.getLogger("policy_probes")
_warned_traced = False


def on_grad(tensor: torch.Tensor, callback: GradCallback) -> None:
    """Call ``callback(grad)`` when the gradient of ``tensor`` is computed (``tensor``
    must require grad). The callback must not modify ``grad`` or return anything; a
    callback that raises propagates into ``backward()``, so probes guard their own.

    The callback must not hold ``tensor`` itself (hold ``tensor.detach()``): autograd
    keeps the hook alive from C++, so a hook that refers back to its tensor forms a cycle
    Python's garbage collector cannot see, and the tensor and its graph are never freed.
    """
    if torch.compiler.is_compiling():  # dynamo cannot trace the tensor's Python slot
        _traced()
        return
    subscribers: list[GradCallback] | None = tensor_slot(tensor, _ATTR)
    if subscribers is None:
        subscribers = [callback]
        set_tensor_slot(tensor, _ATTR, subscribers)
        tensor.register_hook(_FanOut(subscribers))
    else:
        subscribers.append(callback)


class _FanOut:
    """The one tensor hook of a tapped tensor: hands the gradient to every subscriber.
    A slotted object rather than a closure (one object instead of a function, its cell
    and closure tuple): a module called step by step taps a tensor per step, each alive
    until the backward."""

    __slots__ = ("subscribers",)

    def __init__(self, subscribers: list[GradCallback]) -> None:
        self.subscribers = subscribers

    def __call__(self, grad: torch.Tensor) -> None:
        for callback in self.subscribers:
            callback(grad)


@torch.compiler.disable  # runs (eagerly, at a graph break) each time the compiled code does
def _traced() -> None:
    global _warned_traced
    if not _warned_traced:
        _warned_traced = True
        log.warning(
            "a backward probe's gradient tap is inside code torch.compile is compiling (the "
            "probes' force_eager stance was overridden, e.g. by torch.compiler.set_stance in "
            "the loop): the gradients of those passes are not observed; see docs/compile.md"
        )
