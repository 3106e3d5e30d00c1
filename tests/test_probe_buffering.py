"""Row buffering changes nothing but speed: the same metrics (to float32 rounding of the
Fisher matmul) with a buffer that flushes mid-window (and one too small for a whole
minibatch), memory that does not grow with the number of steps, in-place changes of held
rows detected, and one autograd hook per tensor however many probes read its gradient."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyPolicy, attach_all_probes
from torch import nn

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    StatsReporter,
    attach_relu_activation_hooks,
)


def probed(
    buffer_elements: int | None, device: torch.device | str = "cpu"
) -> tuple[TinyPolicy, ComponentContext]:
    torch.manual_seed(0)
    policy = TinyPolicy().to(device)
    ctx = ComponentContext()
    attach_all_probes(policy, ctx, saturation="sigmoid")
    if buffer_elements is not None:
        for tracker in ctx.model_metrics.values():
            tracker.buffer_elements = buffer_elements
    return policy, ctx


def train(policy: TinyPolicy, ctx: ComponentContext, sizes: tuple[int, ...]) -> dict:
    """Minibatches drawn on the CPU (the same values on every device), on the policy's
    device."""
    device = next(policy.parameters()).device
    g = torch.Generator().manual_seed(1)
    for n in sizes:
        x, a = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
        F.cross_entropy(policy(x.to(device)), a.to(device)).backward()
    return StatsReporter(ctx).collect()


@pytest.mark.parametrize("buffer_elements", [60, 300])
def test_mid_window_flushes_give_identical_metrics(
    buffer_elements: int, device: torch.device
) -> None:
    sizes = (12, 5, 30, 7, 7, 19)
    reference = train(*probed(None, device), sizes)  # the default buffer holds the whole window
    small = train(*probed(buffer_elements, device), sizes)  # flushes often; 30 rows never fit at 60
    assert small.keys() == reference.keys()
    for key, value in reference.items():
        assert small[key] == pytest.approx(value, rel=1e-6, abs=1e-12), (
            key
        )  # float32 matmul partial sums


def test_tracker_memory_does_not_grow_with_steps(device: torch.device) -> None:
    # Buffers allocate their storage at their first drain, and a column shared with
    # another tracker is stored once: which buffer stores it depends on when the buffers
    # fill up, so memory reaches its maximum over the first few windows and stays there.
    policy, ctx = probed(2_000, device)
    trackers = ctx.model_metrics.values()
    train(policy, ctx, (16,) * 5)
    after_few = sum(t.nbytes() for t in trackers)
    train(policy, ctx, (16,) * 300)
    after_many = sum(t.nbytes() for t in trackers)
    train(policy, ctx, (16,) * 900)
    assert sum(t.nbytes() for t in trackers) == after_many >= after_few > 0
    # the bound by construction: per buffer column the values, the non-finite indicator
    # and two derived quantities at the buffer's capacity
    bound = sum(
        4 * buf.capacity * width * 4
        for t in trackers
        for buf in t.buffers.values()
        for width, _, _ in buf.layout
    )
    buffers = sum(buf.nbytes for t in trackers for buf in t.buffers.values())
    assert buffers <= bound


def relu_metrics(ctx: ComponentContext) -> dict:
    return StatsReporter(ctx).collect()


def test_an_in_place_change_after_the_hook_loses_the_window_then_copies(
    device: torch.device,
) -> None:
    # Buffers hold the rows by reference; an in-place change before the reduction must be
    # detected (not silently read), and later windows must be exact again.
    model = PolicyAutoBuilder.wrap(nn.Sequential(nn.Identity()), {"feat": "0"})
    ctx = ComponentContext()
    model.attach("feat", attach_relu_activation_hooks(), ctx)
    model(torch.tensor([[1.0, -1.0], [2.0, 3.0]]).to(device)).mul_(-1.0)
    metrics = relu_metrics(ctx)
    assert metrics["probes/errors/relu/feat"] == 1.0
    assert "modified in place" in ctx.probe_errors["relu/feat"]
    assert "probes/relu/feat/active_rate" not in metrics  # the window's rows are lost
    x = torch.tensor([[1.0, -1.0], [2.0, 3.0], [-4.0, 5.0]]).to(device)
    model(x.clone()).mul_(-1.0)  # copied at the push from now on
    rates = relu_metrics(ctx)["probes/relu/feat/active_rate"]
    assert rates == pytest.approx((x > 0).double().mean(0).cpu().tolist())


def test_inference_tensors_are_copied_at_the_push(device: torch.device) -> None:
    model = PolicyAutoBuilder.wrap(nn.Sequential(nn.Identity()), {"feat": "0"})
    ctx = ComponentContext()
    model.attach("feat", attach_relu_activation_hooks(), ctx)
    x = torch.tensor([[1.0, -1.0, 0.5], [2.0, 3.0, -0.5]]).to(device)
    with torch.inference_mode():
        out = model(x.clone())
        out.mul_(-1.0)  # inference tensors have no version counter to check
    metrics = relu_metrics(ctx)
    assert "relu/feat" not in ctx.probe_errors
    assert metrics["probes/relu/feat/active_rate"] == pytest.approx(
        (x > 0).double().mean(0).cpu().tolist()
    )


def test_probes_on_the_same_tensor_share_one_autograd_hook(device: torch.device) -> None:
    # fisher (per unit), gradient_flow and relu_gradient_flow (last ReLU) all read the
    # gradient of actor_mlp's output: one tensor hook, fanned out.
    policy, ctx = probed(None, device)
    out = policy.actor_mlp(torch.randn(4, 5).to(device))
    assert len(out._backward_hooks) == 1
    x0 = torch.randn(4, 5).to(device)
    h0 = policy.actor_mlp.layer_0.act(policy.actor_mlp.layer_0.linear(x0))
    assert len(h0._backward_hooks) == 1  # relu_gradient_flow's first ReLU alone
    out.sum().backward()
    tracker = ctx.model_metrics["gradient_flow"]
    assert tracker.buffers[("actor_mlp", "g")].rows == 4
    assert ctx.model_metrics["fisher"].buffers[("actor_mlp", "out")].rows == 4


def test_probes_reading_the_same_tensors_share_one_materialisation(device: torch.device) -> None:
    # Five probes on a 2-layer ReLU MLP hold 18 block columns (14, plus relu and
    # gradient_flow per layer on layer_0 and layer_1), but only five distinct tensors per
    # pass: the input, the two ReLU outputs and their gradients (fisher reads its Linear
    # layers through them). A drain materialises each once.
    policy, ctx = probed(None, device)
    train(policy, ctx, (12, 5))
    columns = [
        (name, stream, col)
        for name, t in ctx.model_metrics.items()
        for (_, stream), buf in t.buffers.items()
        for col in range(len(buf.layout))
    ]
    stored = [
        (name, stream, col)
        for name, t in ctx.model_metrics.items()
        for (_, stream), buf in t.buffers.items()
        for col, slot in buf.storage
        if slot == 0
    ]
    assert len(columns) == 18
    assert len(stored) == 5, stored
    assert ("relu", "h", 0) in stored  # the first tracker to drain stores the output
    assert ("saturation_sigmoid", "h", 0) not in stored


def test_probes_keep_no_autograd_graph_alive(device: torch.device) -> None:
    # Hooks that referred back to the tensor they hook would form a cycle through the
    # autograd graph (held from C++) that the garbage collector cannot free.
    import gc

    policy, ctx = probed(None, device)
    train(policy, ctx, (12, 5, 9))
    gc.collect()
    hooked = [
        o
        for o in gc.get_objects()
        if type(o) is torch.Tensor and hasattr(o, "_policy_probes_grad_subscribers")
    ]
    leaked = [tuple(o.shape) for o in hooked]
    assert leaked == []


def relu_truth(rows: torch.Tensor) -> tuple[list[float], float]:
    """Active rate per unit and the ReDo-dormant fraction at tau 0.025, by hand."""
    active = (rows > 0).double().mean(0)
    mean_abs = rows.abs().double().mean(0)
    score = mean_abs / (mean_abs.mean() + 1e-9)
    return active.cpu().tolist(), float((score <= 0.025).double().mean())


def test_a_component_shown_another_components_rows_shares_its_sums_exactly(device: torch.device):
    """A component whose output is its last layer's output is reduced once for both: the
    sharing starts when the two see the same rows from the window's start, ends (each
    with its own sums) as soon as their rows differ, and a checkpoint saves two copies."""
    from policy_probes.probes.relu import ReLUActivation

    g = torch.Generator().manual_seed(3)
    shared, own_b, own_a = (torch.randn(n, 6, generator=g) for n in (8, 5, 7))
    shared[:, 0] = -1.0  # a dead unit
    shared, own_b, own_a = shared.to(device), own_b.to(device), own_a.to(device)
    tracker = ReLUActivation()
    tracker.register_component("layer")
    tracker.register_component("component")
    tracker.update("layer", shared)
    tracker.update("component", shared.view(8, 6))  # another tensor object, same memory
    tracker.flush()
    assert tracker.mirrors == {"component": "layer"}
    assert tracker.state["component"] is tracker.state["layer"]

    saved = tracker.state_dict()
    assert saved["state"]["component"]["count"] is not saved["state"]["layer"]["count"]
    checkpoint = io.BytesIO()
    torch.save(saved, checkpoint)

    tracker.update("layer", own_b)
    tracker.update("component", own_a)
    tracker.flush()
    assert tracker.mirrors == {}
    out = tracker.to_metrics()
    for name, rows in (
        ("layer", torch.cat([shared, own_b])),
        ("component", torch.cat([shared, own_a])),
    ):
        active, dormant = relu_truth(rows)
        assert out[f"probes/relu/{name}/active_rate"] == pytest.approx(active, abs=1e-12)
        assert out[f"probes/relu/{name}/dormant_fraction"] == pytest.approx(dormant)
        assert out[f"probes/relu/{name}/samples"] == float(rows.shape[0])

    # the saved shared window resumes as two independent ones
    resumed = ReLUActivation()
    resumed.register_component("layer")
    resumed.register_component("component")
    checkpoint.seek(0)
    resumed.load_state_dict(torch.load(checkpoint, weights_only=True))
    resumed.update("component", own_a)
    out = resumed.to_metrics()
    active, _ = relu_truth(torch.cat([shared, own_a]))
    assert out["probes/relu/component/active_rate"] == pytest.approx(active, abs=1e-12)
    active, _ = relu_truth(shared)
    assert out["probes/relu/layer/active_rate"] == pytest.approx(active, abs=1e-12)


def test_the_policys_output_layer_and_its_component_report_the_same_values(device: torch.device):
    """The per-layer probes of an MLP component: the component's output is its last
    ReLU's output, reduced once; both report what a hand count of the rows gives."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU()).to(device)
    builder = PolicyAutoBuilder({"actor_mlp": mlp})
    ctx = ComponentContext()
    builder.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    x = torch.randn(32, 5).to(device)
    with torch.no_grad():
        out_rows = mlp(x)
    mlp(x)
    tracker = ctx.model_metrics["relu"]
    tracker.flush()
    assert tracker.mirrors == {"actor_mlp": "actor_mlp.3"}  # the last ReLU
    metrics = StatsReporter(ctx).collect()
    active, dormant = relu_truth(out_rows)
    mean_abs = out_rows.abs().double().mean(0)
    redo_score = mean_abs / (mean_abs.mean() + 1e-9)  # ReDo's s_i, for the remedies
    for name in ("actor_mlp", "actor_mlp.3"):
        assert metrics[f"probes/relu/{name}/active_rate"] == pytest.approx(active, abs=1e-12)
        assert metrics[f"probes/relu/{name}/dormant_fraction"] == pytest.approx(dormant)
        assert torch.allclose(tracker.scores[name].cpu().double(), redo_score.cpu(), atol=1e-12)
    # summarised once, reported twice: each key holds its own list
    component, layer = (
        metrics[f"probes/relu/{n}/active_rate"] for n in ("actor_mlp", "actor_mlp.3")
    )
    assert component is not layer


@pytest.mark.parametrize("block", ["finite", "nan", "overflowing"])
def test_a_single_finite_push_is_reduced_where_it_lies(block: str):
    """The one held block of a column whose entries are all finite (CPU, contiguous rows)
    is reduced in place, without the copy that splits off non-finite entries: the values
    are a hand count's, the held tensor is untouched. A block with a NaN takes the copy
    (the NaN counted apart), and so does a finite block whose float32 sum overflows (the
    check is the sum). The same holds for a drain inside a hook: on the CPU, reading the
    check back synchronises nothing."""
    from policy_probes.probes.gradient_flow import GradientFlow
    from policy_probes.probes.relu import ReLUActivation

    g = torch.Generator().manual_seed(5)
    h = torch.randn(12, 7, generator=g)
    if block == "nan":
        h[3, 2] = float("nan")
    if block == "overflowing":
        h[0, :2] = 3e38  # finite, but their sum is not
    held = h.clone()
    relu, flow = ReLUActivation(), GradientFlow()
    relu.register_component("c")
    flow.register_component("c", beta=0.9, blocked_threshold=1e-6)
    relu.update("c", h)
    flow.update("c", h)
    relu_out, flow_out = relu.to_metrics(), flow.to_metrics()
    assert torch.allclose(h, held, rtol=0, atol=0, equal_nan=True)  # untouched
    copied = relu.buffers[("c", "h")].storage.get((0, 0)) is not None
    assert copied == (block != "finite")  # the finite block was read where it lay
    finite = torch.isfinite(h)
    clean = torch.where(finite, h, torch.zeros(()))
    count = finite.sum(0).double()
    active = ((clean > 0).sum(0) / count).tolist()
    assert relu_out["probes/relu/c/active_rate"] == pytest.approx(active, abs=1e-12)
    assert relu_out["probes/relu/c/nonfinite_fraction"] == pytest.approx(
        (~finite).sum().item() / h.numel()
    )
    rms = (clean.double().square().sum(0) / count).sqrt().tolist()  # one pass: the EMA's
    if block != "overflowing":  # (3e38)^2 overflows the probe's float32 squares
        assert flow_out["probes/gradient_flow/c/rms"] == pytest.approx(rms, rel=1e-6)
    assert flow_out["probes/gradient_flow/c/nonfinite_fraction"] == pytest.approx(
        (~finite).sum().item() / h.numel()
    )

    # a full buffer drained inside a hook (timed=False) decides the same way
    inside = ReLUActivation()
    inside.register_component("c")
    inside.buffer_rows = 12
    inside.update("c", h)
    inside.update("c", h)  # does not fit behind the first push: drains it inside the call
    assert (inside.buffers[("c", "h")].storage.get((0, 0)) is not None) == (block != "finite")
    assert inside.to_metrics()["probes/relu/c/active_rate"] == pytest.approx(active, abs=1e-12)


@pytest.mark.parametrize("block", ["finite", "nan"])
def test_concatenated_finite_rows_skip_the_split(block: str):
    """Several pushes (or a conv output's channels-first view) are copied into the
    buffer's storage; when the copy is all finite, its non-finite indicator is not
    written (no split), and the metrics are a hand count's either way."""
    from policy_probes.probes.relu import ReLUActivation

    g = torch.Generator().manual_seed(6)
    conv = torch.randn(3, 4, 5, 5, generator=g)  # (B, C, H, W): a conv output
    if block == "nan":
        conv[1, 2, 3, 4] = float("nan")
    view = conv.movedim(1, -1)  # (B, H, W, C): rows of channels, not contiguous
    flat = torch.randn(10, 4, generator=g)
    relu = ReLUActivation()
    relu.register_component("c")
    relu.update("c", view)
    relu.update("c", flat)
    out = relu.to_metrics()
    storage = relu.buffers[("c", "h")].storage
    assert storage.get((0, 0)) is not None  # the rows were copied together
    assert (storage.get((0, 1)) is not None) == (block == "nan")  # split only with a NaN
    rows = torch.cat([view.reshape(-1, 4), flat])
    finite = torch.isfinite(rows)
    clean = torch.where(finite, rows, torch.zeros(()))
    active = ((clean > 0).sum(0) / finite.sum(0).double()).tolist()
    assert out["probes/relu/c/active_rate"] == pytest.approx(active, abs=1e-12)
    assert out["probes/relu/c/nonfinite_fraction"] == pytest.approx(
        (~finite).sum().item() / rows.numel()
    )


def test_a_window_end_releases_large_storage_and_keeps_small(device: torch.device):
    """reset() frees a buffer's storage and the scratch of 1 MiB or more (they would sit
    among the training step's own large allocations until the next report) and keeps the
    small ones for reuse; the next window reduces as before."""
    from policy_probes.probes.relu import ReLUActivation
    from policy_probes.probes.state import RELEASED_BYTES

    g = torch.Generator().manual_seed(2)
    large = torch.randn(300, 1024, generator=g)  # 1.2 MB of float32 rows
    small = torch.randn(10, 8, generator=g)
    for t in (large, small):
        t[0, 0] = float("nan")  # held rows are copied into the buffer's storage
    large, small = large.to(device), small.to(device)
    tracker = ReLUActivation()
    for name, rows in (("large", large), ("small", small)):
        tracker.register_component(name)
        tracker.update(name, rows)
    first = tracker.to_metrics()
    storage = {name: tracker.buffers[(name, "h")].storage for name in ("large", "small")}
    assert storage["large"][(0, 0)].numel() * 4 >= RELEASED_BYTES
    tracker.reset()
    assert tracker.buffers[("large", "h")].storage == {}
    assert set(tracker.buffers[("small", "h")].storage) == set(storage["small"])
    assert all(t.numel() * t.element_size() < RELEASED_BYTES for t in tracker._scratch.values())
    for name, rows in (("large", large), ("small", small)):
        tracker.update(name, rows)
    assert tracker.to_metrics() == first
