"""Pins the torch behaviour behind :mod:`policy_probes.torch_internals` for the installed
torch version: if an upgrade changes one of the private names, this file fails first."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import (
    register_module_backward_hook,
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from policy_probes.components import ProbeHandle
from policy_probes.torch_internals import (
    OUTPUT_ONLY_BACKWARD_WARNING,
    child_modules,
    conv_padding,
    global_module_hooks_installed,
    hooks_set_aside,
    is_functorch_wrapped_tensor,
    module_hook_count,
    module_hooks_installed,
    own_parameter_twin,
    queue_after_backward,
    quiet_output_only_backward_hooks,
    set_last_lr,
    set_tensor_slot,
    tensor_slot,
    tree_flatten,
    tree_unflatten,
    version_counter,
)

PREFIX = OUTPUT_ONLY_BACKWARD_WARNING


def nested() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Tanh(), nn.Linear(4, 2)))


def noop(*_args: object) -> None:
    return None


@pytest.mark.parametrize(
    "register",
    [
        lambda m: m.register_forward_hook(noop),
        lambda m: m.register_forward_pre_hook(noop),
        lambda m: m.register_full_backward_hook(noop),
        lambda m: m.register_full_backward_pre_hook(noop),
    ],
    ids=["forward", "forward_pre", "backward", "backward_pre"],
)
def test_module_hooks_seen_at_any_depth_of_every_kind(register) -> None:
    model = nested()
    assert not module_hooks_installed(model) and module_hook_count(model) == 0
    handle = register(model[1][1])
    assert module_hooks_installed(model) and module_hook_count(model) == 1
    handle.remove()
    assert not module_hooks_installed(model) and module_hook_count(model) == 0


@pytest.mark.parametrize(
    "register",
    [register_module_forward_hook, register_module_forward_pre_hook, register_module_backward_hook],
)
def test_global_module_hooks_seen(register) -> None:
    assert not global_module_hooks_installed()
    handle = register(noop)
    try:
        assert global_module_hooks_installed()
    finally:
        handle.remove()
    assert not global_module_hooks_installed()


def test_hooks_set_aside_silences_then_restores_the_same_hooks() -> None:
    model = nested()
    calls: list[str] = []
    handle = model[1][1].register_forward_hook(lambda *_: calls.append("inner"))
    x = torch.randn(2, 3)
    with hooks_set_aside(model):
        assert not module_hooks_installed(model)
        model(x)
    assert calls == []
    model(x)
    assert calls == ["inner"]
    handle.remove()  # the handle still points at the restored dict
    assert module_hook_count(model) == 0


def test_unbound_handle_gets_an_id_and_removes_nothing_else() -> None:
    model = nested()
    kept = model.register_forward_hook(noop)
    a, b = ProbeHandle([], "a"), ProbeHandle([], "b")
    assert a.id != b.id
    a.remove()
    b.remove()
    assert module_hook_count(model) == 1
    kept.remove()


def test_child_modules_keeps_shared_children_and_placeholders() -> None:
    shared = nn.Tanh()
    model = nn.Module()
    model.first = shared
    model.second = shared
    model.register_module("empty", None)
    assert [n for n, _ in child_modules(model)] == ["first", "second", "empty"]
    assert [n for n, _ in model.named_children()] == ["first"]  # why the helper exists


def test_version_counter_moves_on_in_place_writes_through_views_only() -> None:
    t = torch.zeros(4, 3)
    start = version_counter(t)
    _ = t + 1
    assert version_counter(t) == start
    t[1].add_(1.0)  # through a view
    assert version_counter(t) == start + 1
    assert version_counter(t[0]) == version_counter(t)  # views share the counter
    with torch.inference_mode():
        inf = torch.zeros(2)
    with pytest.raises(RuntimeError):
        version_counter(inf)  # row_buffer checks is_inference() first for this reason


def test_tensor_slot_lives_on_the_tensor_object_only() -> None:
    t = torch.randn(3, requires_grad=True)
    y = t * 2
    assert tensor_slot(y, "_pp_test") is None
    box = [1]
    set_tensor_slot(y, "_pp_test", box)
    assert tensor_slot(y, "_pp_test") is box
    assert tensor_slot(y.detach(), "_pp_test") is None
    assert tensor_slot(y[:2], "_pp_test") is None


def test_queue_after_backward_runs_once_the_gradients_are_complete() -> None:
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(5, 3)
    h = x * w
    seen: list[torch.Tensor] = []

    def on_h(_grad: torch.Tensor) -> None:
        queue_after_backward(lambda: seen.append(w.grad.clone()))

    h.register_hook(on_h)
    (h.sum() * 2).backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], 2 * x.sum(0))
    with pytest.raises(RuntimeError):
        queue_after_backward(noop)  # outside a backward pass


@pytest.mark.parametrize(
    "conv, mode",
    [
        (nn.Conv2d(2, 3, (3, 5), padding=(1, 2)), "constant"),
        (nn.Conv2d(2, 3, 3, padding="same", dilation=2), "constant"),
        (nn.Conv1d(2, 3, 4, padding="same"), "constant"),
        (nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), "reflect"),
    ],
)
def test_conv_padding_is_what_f_pad_needs(conv: nn.Module, mode: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 2, 7) if isinstance(conv, nn.Conv1d) else torch.randn(2, 2, 7, 8)
    conv_fn = F.conv1d if isinstance(conv, nn.Conv1d) else F.conv2d
    padded = F.pad(x, conv_padding(conv), mode=mode)
    by_hand = conv_fn(padded, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)
    torch.testing.assert_close(by_hand, conv(x))


def test_tree_flatten_round_trip() -> None:
    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    leaves, spec = tree_flatten(((a, {"k": b}), [c]))
    assert [t.shape for t in leaves] == [a.shape, b.shape, c.shape]
    rebuilt = tree_unflatten([t + 1 for t in leaves], spec)
    torch.testing.assert_close(rebuilt[0][1]["k"], b + 1)
    torch.testing.assert_close(rebuilt[1][0], c + 1)


def test_output_only_backward_warning_is_silenced_in_the_block_only() -> None:
    layer = nn.Linear(3, 2)
    layer.register_full_backward_hook(noop)

    def backward_messages(quiet: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_output_only_backward_hooks() if quiet else contextlib.nullcontext():
                layer(torch.randn(4, 3)).sum().backward()  # the input does not require grad
        return [str(w.message) for w in caught if str(w.message).startswith(PREFIX)]

    assert len(backward_messages(quiet=False)) == 1
    assert backward_messages(quiet=True) == []
    assert len(backward_messages(quiet=False)) == 1  # the filter ended with the block


@pytest.mark.parametrize(
    "make", [lambda: nn.Linear(3, 4), lambda: nn.Conv2d(2, 3, 3), lambda: nn.LSTM(3, 5)]
)
def test_own_parameter_twin_takes_reset_parameters_writes(make):
    """The twin's reset_parameters() writes the twin's tensors (same names, shapes,
    dtypes): the module keeps its values, and the twin's values are what the module's own
    initialiser draws under the same seed."""
    module = make()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    twin = own_parameter_twin(module)
    torch.manual_seed(5)
    twin.reset_parameters()
    torch.manual_seed(5)
    reference = make()  # constructors run reset_parameters() once
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name])
    twin_params = dict(twin.named_parameters(recurse=False))
    assert set(twin_params) == set(before) and list(twin.children()) == []
    for name, p in reference.named_parameters():
        assert twin_params[name].shape == p.shape and twin_params[name].dtype == p.dtype
        assert torch.equal(twin_params[name], p)


def test_set_last_lr_is_what_get_last_lr_returns():
    param = nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([param], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    opt.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.5]
    set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]


def test_compile_helpers_see_wrappers_in_place_compiles_and_the_stance() -> None:
    from policy_probes.torch_internals import (
        compiled_call,
        compiled_original,
        force_eager_stance,
        is_compiled_wrapper,
    )

    module = nn.Linear(2, 2)
    wrapper = torch.compile(module, backend="eager")
    assert is_compiled_wrapper(wrapper) and not is_compiled_wrapper(module)
    assert compiled_original(wrapper) is module
    assert compiled_call(module) is None
    module.compile(backend="eager")
    assert callable(compiled_call(module))

    calls = []

    def backend(gm, _example):
        calls.append(1)
        return gm.forward

    fn = torch.compile(lambda x: x * 2, backend=backend)
    # from the default stance, whatever a policy still armed elsewhere in this process holds
    with torch.compiler.set_stance("default"):
        restore = force_eager_stance()
        try:
            assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
            assert not calls  # ran eagerly: nothing compiled
        finally:
            restore()
        fn(torch.ones(2))
        assert calls == [1]  # the previous stance is back


@pytest.mark.parametrize(
    "make",
    [
        lambda a, b: a,
        lambda a, b: (a, (b, a)),  # an LSTM's (out, (h, c))
        lambda a, b: [a, [b, (a, None, 3)]],
        lambda a, b: {"y": (b,), "x": a},  # insertion order
        lambda a, b: ((a, (b, a)), {}),  # an LSTM's (args, kwargs)
        lambda a, b: torch.nn.utils.rnn.pack_padded_sequence(torch.zeros(3, 2, 4), [3, 2]),
        lambda a, b: torch.max(torch.ones(2, 3), dim=1),  # a structseq
    ],
)
def test_tree_leaves_are_tree_flattens_leaves(make) -> None:
    """The fast walk over tensors, tuples, lists and dicts gives torch's pytree leaves,
    in its order, for those and for every other nest (handed to tree_flatten); the cached
    flatten gives torch's spec too, reused for the next tree of that structure."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from policy_probes.torch_internals import tree_flatten_cached, tree_leaves

    tree = make(torch.zeros(2), torch.ones(3))
    want, want_spec = tree_flatten(tree)
    for got in (tree_leaves(tree), tree_flatten_cached(tree)[0]):
        assert len(got) == len(want)
        assert all(g is w for g, w in zip(got, want, strict=True))
    assert tree_flatten_cached(tree)[1] == want_spec
    other = make(torch.full((2,), 7.0), torch.full((3,), 8.0))  # same structure
    leaves, spec = tree_flatten_cached(other)
    rebuilt = tree_unflatten(leaves, spec)
    assert tree_flatten(rebuilt)[1] == want_spec
    assert all(a is b for a, b in zip(tree_flatten(rebuilt)[0], leaves, strict=True))


def test_functorch_wrapped_tensors_are_those_inside_vmap_and_grad() -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    seen: list[bool] = []

    def look(v: torch.Tensor) -> torch.Tensor:
        seen.append(is_functorch_wrapped_tensor(v))
        return v.sum()

    torch.vmap(look)(x)
    torch.func.grad(look)(x)
    look(x)
    assert seen == [True, True, False]
