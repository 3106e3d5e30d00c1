"""Row masks and recurrent cores: every built-in probe against plain torch computations.

* masked rows: each probe's metrics equal an independent computation over exactly the
  kept rows (plain hooks, boolean indexing in the test, ``vmap(grad)`` per-sample
  gradients), for mean and sum losses and micro-batches;
* nn.LSTM / nn.GRU / nn.LSTMCell / nn.GRUCell with the default extractors, called on the
  whole sequence or once per step, against a plain forward and ``torch.autograd.grad``;
* bad masks and non-tensor outputs get clear errors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyPolicy, sb3_cartpole
from torch import nn
from torch.func import functional_call, grad, vmap

from policy_probes import (
    ComponentContext,
    PolicyAutoBuilder,
    ProbeError,
    ProbeSettings,
    Run,
    StatsReporter,
    attach_fisher_information_hooks,
    attach_gradient_flow_hooks,
    attach_relu_activation_hooks,
    attach_relu_gradient_flow_hooks,
    attach_saturated_activation_hooks,
)

REL = 1e-5
BETA = 0.8


def per_sample_loss(logits: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, a, reduction="none")


def ema_reference(rms_per_pass: list[torch.Tensor], beta: float = BETA) -> torch.Tensor:
    ema = torch.zeros_like(rms_per_pass[0])
    for r in rms_per_pass:
        ema = beta * ema + (1 - beta) * r
    return ema / (1 - beta ** len(rms_per_pass))


class Recorder:
    """Plain torch hooks: every output (grad enabled) of some modules and its gradient."""

    def __init__(self, modules: dict[str, nn.Module], pick=lambda out: out) -> None:
        self.out: dict[str, list[torch.Tensor]] = {k: [] for k in modules}
        self.grad: dict[str, list[torch.Tensor]] = {k: [] for k in modules}
        self.handles = [m.register_forward_hook(self._hook(k, pick)) for k, m in modules.items()]

    def _hook(self, name: str, pick):
        def hook(_m, _i, out):
            t = pick(out)
            if torch.is_grad_enabled() and t.requires_grad:
                self.out[name].append(t.detach().clone())
                slot = len(self.out[name]) - 1
                self.grad[name].append(None)

                def keep(g: torch.Tensor) -> None:
                    self.grad[name][slot] = g.detach().clone()

                t.register_hook(keep)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ---------------------------------------------------------------- masked MLP rows
def masked_batches(seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Minibatches whose masked rows are far out of distribution (x * 40), so any of
    them leaking into a statistic changes it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (12, 9):
        x = torch.randn(n, 5, generator=g)
        a = torch.randint(0, 3, (n,), generator=g)
        m = (torch.rand(n, generator=g) > 0.35).float()
        m[0], m[1] = 1.0, 0.0
        x = torch.where(m[:, None] > 0, x, x * 40)
        out.append((x, a, m))
    return out


@pytest.mark.parametrize(("reduction", "micro"), [("mean", 1), ("mean", 3), ("sum", 1), ("sum", 2)])
def test_masked_rows_are_left_out_of_every_probe(reduction: str, micro: int) -> None:
    torch.manual_seed(0)
    policy = TinyPolicy()
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    policy.attach("actor_mlp.layer_0.linear", attach_saturated_activation_hooks("tanh"), ctx)
    sigmoid = attach_saturated_activation_hooks("sigmoid", threshold=0.6)
    policy.attach("actor_mlp.layer_1.linear", sigmoid, ctx)
    policy.attach(
        "actor_mlp", attach_fisher_information_hooks(loss_reduction=reduction), ctx, backward=True
    )
    policy.attach("actor_mlp", attach_gradient_flow_hooks(beta=BETA), ctx, backward=True)
    policy.attach("actor_mlp", attach_relu_gradient_flow_hooks(), ctx, backward=True)
    mlp = policy.actor_mlp
    acts = {"layer_0.act": mlp.layer_0.act, "layer_1.act": mlp.layer_1.act}
    rec = Recorder({"mlp": mlp, **acts})
    data = masked_batches()
    pass_masks = []
    for x, a, m in data:
        kept_total = m.sum()
        for xs, as_, ms in zip(x.chunk(micro), a.chunk(micro), m.chunk(micro), strict=True):
            ctx.row_mask = ms
            ctx.loss_samples = float(kept_total)  # the loss averages over the whole minibatch
            loss = (per_sample_loss(policy(xs), as_) * ms).sum()
            if reduction == "mean":
                loss = loss / kept_total
            loss.backward()
            pass_masks.append(ms.bool())
    ctx.row_mask, ctx.loss_samples = None, None
    fisher = ctx.model_metrics["fisher"].param_fisher("actor_mlp")  # before collect() resets
    got = StatsReporter(ctx).collect()
    rec.remove()
    policy.remove_hooks()
    assert not ctx.probe_errors

    x_all = torch.cat([x for x, _, _ in data])
    a_all = torch.cat([a for _, a, _ in data])
    keep = torch.cat([m for _, _, m in data]).bool()
    xk, ak = x_all[keep], a_all[keep]
    n = int(keep.sum())
    with torch.no_grad():
        h = mlp(xk).double()
        z = mlp.layer_0.linear(xk).double()
        z1 = mlp.layer_1.linear(mlp.layer_0(xk)).double()
    # relu: the kept rows' activations
    active = (h > 0).double().mean(0)
    p = "probes/relu/actor_mlp/"
    assert got[p + "active_rate"] == pytest.approx(active.tolist(), rel=REL)
    assert got[p + "zero_fraction"] == pytest.approx(float((h <= 0).double().mean()), rel=REL)
    assert got[p + "samples"] == n
    # saturation (tanh rule on the pre-activation)
    p = "probes/saturation_tanh/actor_mlp.layer_0.linear/"
    rate = (z.abs() > 0.95).double().mean(0)
    assert got[p + "saturation_rate"] == pytest.approx(rate.tolist(), rel=REL)
    assert got[p + "mean_derivative"] == pytest.approx(float((1 - z**2).mean()), rel=REL)
    assert got[p + "samples"] == n
    p = "probes/saturation_sigmoid/actor_mlp.layer_1.linear/"
    rate = ((z1 < 0.4) | (z1 > 0.6)).double().mean(0)
    assert got[p + "saturation_rate"] == pytest.approx(rate.tolist(), rel=REL)
    assert got[p + "mean_derivative"] == pytest.approx(float((z1 - z1**2).mean()), rel=REL)
    # fisher: per-sample gradients of l_i, kept rows only
    hk = mlp(xk).detach().requires_grad_(True)
    (gh,) = torch.autograd.grad(per_sample_loss(policy.actor_head(hk), ak).sum(), hk)
    p = "probes/fisher/actor_mlp/"
    assert got[p + "unit"] == pytest.approx(gh.double().square().mean(0).tolist(), rel=REL)
    assert got[p + "samples"] == n
    params = {k: v.detach() for k, v in mlp.named_parameters()}

    def loss_one(prm: dict, x1: torch.Tensor, a1: torch.Tensor) -> torch.Tensor:
        logits = policy.actor_head(functional_call(mlp, prm, (x1[None],)))
        return per_sample_loss(logits, a1[None])[0]

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, xk, ak)
    assert set(fisher) == set(per_sample)
    for name, g in per_sample.items():
        torch.testing.assert_close(fisher[name], g.double().square().mean(0), rtol=REL, atol=1e-12)
    # gradient flow: RMS over each pass's kept rows of the delivered gradient; a pass
    # whose rows are all masked is no pass
    rms = [
        g[k].double().square().mean(0).sqrt()
        for g, k in zip(rec.grad["mlp"], pass_masks, strict=True)
        if k.any()
    ]
    if micro > 1:
        assert len(rms) < len(pass_masks)  # the data has such passes
    p = "probes/gradient_flow/actor_mlp/"
    assert got[p + "rms"] == pytest.approx(ema_reference(rms).tolist(), rel=REL)
    assert got[p + "passes"] == len(rms)
    # per layer (probes/<probe>/actor_mlp.layer_k/...): each hidden layer's output over
    # exactly the kept rows of every pass (boolean indexing of the plain-hook captures)
    for layer in acts:
        name = layer.removesuffix(".act")
        outs, grads = rec.out[layer], rec.grad[layer]
        kept_out = torch.cat([o[k] for o, k in zip(outs, pass_masks, strict=True)]).double()
        p = f"probes/relu/actor_mlp.{name}/"
        assert got[p + "active_rate"] == pytest.approx(
            (kept_out > 0).double().mean(0).tolist(), rel=REL
        )
        assert got[p + "zero_fraction"] == pytest.approx(
            float((kept_out <= 0).double().mean()), rel=REL
        )
        assert got[p + "samples"] == n
        layer_rms = [
            g[k].double().square().mean(0).sqrt()
            for g, k in zip(grads, pass_masks, strict=True)
            if k.any()
        ]
        p = f"probes/gradient_flow/actor_mlp.{name}/"
        assert got[p + "rms"] == pytest.approx(ema_reference(layer_rms).tolist(), rel=REL)
        assert got[p + "passes"] == len(layer_rms)
        # relu gradient flow: kept rows where the ReLU output is > 0 and its gradient != 0
        passed = torch.cat(
            [((g != 0) & (o > 0))[k] for o, g, k in zip(outs, grads, pass_masks, strict=True)]
        )
        p = f"probes/relu_gradient_flow/actor_mlp.{name}/"
        assert got[p + "pass_rate"] == pytest.approx(passed.double().mean(0).tolist(), rel=REL)
    p = "probes/relu_gradient_flow/actor_mlp/"
    assert got[p + "pass_rate"] == pytest.approx(
        torch.cat(
            [
                torch.cat(
                    [
                        ((g != 0) & (o > 0))[k]
                        for o, g, k in zip(rec.out[a], rec.grad[a], pass_masks, strict=True)
                    ]
                )
                .double()
                .mean(0)
                for a in acts
            ]
        ).tolist(),
        rel=REL,
    )


def test_masked_rows_need_no_host_sync_to_be_left_out() -> None:
    """The masked statistics of every probe with drains inside the hooks (small buffers)
    equal those with one drain at the end."""
    results = []
    for rows in (2048, 7):
        torch.manual_seed(0)
        policy = TinyPolicy()
        ctx = ComponentContext()
        policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
        for make in (attach_fisher_information_hooks, attach_gradient_flow_hooks):
            policy.attach("actor_mlp", make(), ctx, backward=True)
        policy.attach("actor_mlp", attach_relu_gradient_flow_hooks(), ctx, backward=True)
        for tracker in ctx.model_metrics.values():
            tracker.buffer_rows = rows
        for x, a, m in masked_batches():
            ctx.row_mask = m
            ((per_sample_loss(policy(x), a) * m).sum() / m.sum()).backward()
        results.append(StatsReporter(ctx).collect())
    small, large = results[1], results[0]
    assert small.keys() == large.keys()
    for key, value in large.items():
        assert small[key] == pytest.approx(value, rel=REL), key


def test_session_row_mask_block_and_stated_loss_samples(tmp_path) -> None:
    from policy_probes import ProbeSession
    from policy_probes.sinks import SinksConfig

    torch.manual_seed(0)
    policy = TinyPolicy()
    x, a, m = masked_batches()[0]
    keep = m.bool()
    hk = policy.actor_mlp(x[keep]).detach().requires_grad_(True)
    (gh,) = torch.autograd.grad(per_sample_loss(policy.actor_head(hk), a[keep]).sum(), hk)
    with ProbeSession(
        policy,
        run=Run(tmp_path),
        probing=ProbeSettings(sinks=SinksConfig(console=False), probe_budget=None),
    ) as session:
        session.add_training_hook("actor_mlp", attach_relu_activation_hooks())
        session.add_training_backward_hook("actor_mlp", attach_fisher_information_hooks())
        with session.row_mask(m):
            ((per_sample_loss(policy(x), a) * m).sum() / m.sum()).backward()
        assert session.context.row_mask is None  # the block restores the previous mask
        record = session.epoch_end(step=1)
        assert record["probes/relu/actor_mlp/samples"] == int(keep.sum())
        unit = gh.double().square().mean(0)
        assert record["probes/fisher/actor_mlp/unit"] == pytest.approx(unit.tolist(), rel=REL)
        # the loss averages over 2x the kept rows (e.g. the other half is another
        # micro-batch): stated in the block, the per-sample factor doubles
        n = 2 * int(keep.sum())
        with session.row_mask(m, loss_samples=n):
            ((per_sample_loss(policy(x), a) * m).sum() / n).backward()
        assert session.context.loss_samples is None
        record = session.epoch_end(step=2)
        assert record["probes/fisher/actor_mlp/unit"] == pytest.approx(unit.tolist(), rel=REL)
        session.set_loss_samples(n)
        assert session.context.loss_samples == n
        with pytest.raises(ValueError, match="positive number of samples"):
            session.set_loss_samples(0)


# ---------------------------------------------------------------- recurrent cores
T, B, F_IN, H = 4, 3, 3, 5


class SeqNet(nn.Module):
    """A recurrent core and a linear head over every step's output; the core is called
    on the whole sequence or once per step (cells: always per step)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.core = {
            "lstm": lambda: nn.LSTM(F_IN, H),
            "gru": lambda: nn.GRU(F_IN, H),
            "rnn": lambda: nn.RNN(F_IN, H),
            "lstm_batch_first": lambda: nn.LSTM(F_IN, H, batch_first=True),
            "lstm_cell": lambda: nn.LSTMCell(F_IN, H),
            "gru_cell": lambda: nn.GRUCell(F_IN, H),
        }[kind]()
        self.head = nn.Linear(H, 2)
        self.per_step = False

    def core_outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The probed tensor of every core call, for x of shape (T, B, F_IN)."""
        core = self.core
        if isinstance(core, nn.RNNBase):
            xin = x.transpose(0, 1) if core.batch_first else x
            if not self.per_step:
                return [core(xin)[0]]
            outs, state = [], None
            for t in range(T):
                step = xin[:, t : t + 1] if core.batch_first else xin[t : t + 1]
                o, state = core(step, state)
                outs.append(o)
            return outs
        outs, state = [], None
        for t in range(T):
            state = core(x[t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return outs

    def logits(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """(B, T, 2) logits from the core outputs."""
        core = self.core
        if isinstance(core, nn.RNNBase):
            seq = torch.cat(outs, dim=1 if core.batch_first else 0)
            seq = seq if core.batch_first else seq.transpose(0, 1)
        else:
            seq = torch.stack(outs, dim=1)
        return self.head(seq)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.core_outputs(x))


def sequences(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, F_IN, generator=g)
    a = torch.randint(0, 2, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 3] = mask[2, 2] = mask[2, 3] = 0.0  # padded tails of sequences 0 and 2
    return x, a, mask


def masked_mean_loss(logits: torch.Tensor, a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    losses = per_sample_loss(logits.reshape(-1, 2), a.reshape(-1)).reshape(B, T)
    return (losses * mask).sum() / mask.sum()


def run_probes(net: SeqNet, x, a, mask, per_step: bool) -> dict:
    policy = PolicyAutoBuilder.wrap(net, {"core": "core"})
    ctx = ComponentContext()
    policy.attach("core", attach_relu_activation_hooks(), ctx)
    policy.attach("core", attach_saturated_activation_hooks("tanh", threshold=0.5), ctx)
    policy.attach("core", attach_fisher_information_hooks(), ctx, backward=True)
    policy.attach("core", attach_gradient_flow_hooks(beta=BETA), ctx, backward=True)
    net.per_step = per_step
    ctx.row_mask = mask
    masked_mean_loss(net(x), a, mask).backward()
    ctx.row_mask = None
    got = StatsReporter(ctx).collect()
    policy.remove_hooks()
    assert not ctx.probe_errors
    assert not [k for k in got if "/core." in k]  # per-layer: no activation layer inside
    return got


def reference(net: SeqNet, x, a, mask) -> dict:
    """Activations from a plain forward, per-sample output gradients from autograd.grad
    (n_kept x the gradient of the masked mean loss), kept rows picked by (step, sequence)."""
    outs = net.core_outputs(x)
    loss = masked_mean_loss(net.logits(outs), a, mask)
    grads = torch.autograd.grad(loss, outs)
    keep = mask.bool()
    n = int(keep.sum())

    def by_step_and_sequence(ts: list[torch.Tensor]) -> torch.Tensor:
        """(T, B, H) from the per-call tensors of any calling convention."""
        core = net.core
        if isinstance(core, nn.RNNBase):
            seq = torch.cat(ts, dim=1 if core.batch_first else 0)
            return seq.transpose(0, 1) if core.batch_first else seq
        return torch.stack(ts)

    h = by_step_and_sequence(outs).detach().double()[keep.T]
    g = by_step_and_sequence(list(grads)).double()[keep.T] * n
    return {"h": h, "g": g, "n": n}


KINDS = ["lstm", "gru", "rnn", "lstm_batch_first", "lstm_cell", "gru_cell"]
CALLS = [(k, False) for k in KINDS[:4]] + [(k, True) for k in KINDS]


@pytest.mark.parametrize(("kind", "per_step"), CALLS)
def test_recurrent_cores_with_default_extractors_match_plain_torch(kind: str, per_step: bool):
    torch.manual_seed(0)
    net = SeqNet(kind)
    x, a, mask = sequences()
    net.per_step = per_step
    ref = reference(net, x, a, mask)
    got = run_probes(net, x, a, mask, per_step)
    h, g, n = ref["h"], ref["g"], ref["n"]
    assert n == 9
    p = "probes/relu/core/"
    assert got[p + "active_rate"] == pytest.approx((h > 0).double().mean(0).tolist(), rel=REL)
    assert got[p + "samples"] == n
    p = "probes/saturation_tanh/core/"
    assert got[p + "saturation_rate"] == pytest.approx(
        (h.abs() > 0.5).double().mean(0).tolist(), rel=REL
    )
    assert got[p + "mean_derivative"] == pytest.approx(float((1 - h**2).mean()), rel=REL)
    p = "probes/fisher/core/"
    assert got[p + "unit"] == pytest.approx(g.square().mean(0).tolist(), rel=REL)
    assert got[p + "samples"] == n
    # one row_mask block is one pass, however many calls the core made in it
    p = "probes/gradient_flow/core/"
    assert got[p + "passes"] == 1
    rms = (g / n).square().mean(0).sqrt()  # the delivered gradient over the kept rows
    assert got[p + "rms"] == pytest.approx(rms.tolist(), rel=REL)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_sequence_call_and_per_step_loop_agree(kind: str) -> None:
    """The same nn.LSTM/nn.GRU and loss, called on the whole sequence or step by step:
    the same per-unit Fisher, activations and gradient flow (the output sequence carries
    the loss's direct gradient either way)."""
    torch.manual_seed(0)
    net = SeqNet(kind)
    x, a, mask = sequences()
    at_once = run_probes(net, x, a, mask, per_step=False)
    stepwise = run_probes(net, x, a, mask, per_step=True)
    assert at_once.keys() == stepwise.keys()
    for key, value in at_once.items():
        assert stepwise[key] == pytest.approx(value, rel=REL), key


def test_per_step_cells_without_mask_use_the_stated_loss_samples() -> None:
    """Without a mask, each call is a pass and the Fisher factor is the rows of the pass,
    unless the loop states how many samples the loss averages over."""
    torch.manual_seed(0)
    net = SeqNet("lstm_cell")
    net.per_step = True
    x, a, _ = sequences()
    ones = torch.ones(B, T)
    ref = reference(net, x, a, ones)
    for stated, factor in ((None, B / (T * B)), (T * B, 1.0)):
        policy = PolicyAutoBuilder.wrap(net, {"core": "core"})
        ctx = ComponentContext()
        policy.attach("core", attach_fisher_information_hooks(), ctx, backward=True)
        policy.attach("core", attach_gradient_flow_hooks(), ctx, backward=True)
        ctx.loss_samples = stated
        masked_mean_loss(net(x), a, ones).backward()
        got = StatsReporter(ctx).collect()
        policy.remove_hooks()
        unit = (ref["g"] * factor).square().mean(0)
        assert got["probes/fisher/core/unit"] == pytest.approx(unit.tolist(), rel=REL)
        assert got["probes/gradient_flow/core/passes"] == T


def test_packed_sequences_read_the_real_steps_only() -> None:
    torch.manual_seed(0)
    lstm = nn.LSTM(F_IN, H)
    policy = PolicyAutoBuilder.wrap(nn.Sequential(lstm), {"core": lstm})
    ctx = ComponentContext()
    policy.attach("core", attach_relu_activation_hooks(), ctx)
    seqs = [torch.randn(n, F_IN) for n in (4, 2, 3)]
    packed = nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False)
    out, _ = lstm(packed)
    got = StatsReporter(ctx).collect()
    assert got["probes/relu/core/samples"] == 9
    active = (out.data > 0).double().mean(0)
    assert got["probes/relu/core/active_rate"] == pytest.approx(active.tolist(), rel=REL)


# ---------------------------------------------------------------- errors
def test_a_mask_with_the_wrong_number_of_rows_names_the_fix() -> None:
    torch.manual_seed(0)
    policy = TinyPolicy()
    ctx = ComponentContext(strict=True)
    policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    ctx.row_mask = torch.ones(7)
    with pytest.raises(ValueError, match=r"mask has shape \(7,\).*8 rows.*one mask entry per row"):
        policy(torch.randn(8, 5))
    # not strict: the probe is disabled and the message is reported once
    ctx = ComponentContext()
    policy.remove_hooks()
    policy.attach("actor_mlp", attach_relu_activation_hooks(), ctx)
    policy.attach("actor_mlp", attach_fisher_information_hooks(), ctx, backward=True)
    ctx.row_mask = torch.ones(7)
    F.cross_entropy(policy(torch.randn(8, 5)), torch.zeros(8, dtype=torch.long)).backward()
    assert set(ctx.probe_errors) == {"relu/actor_mlp", "fisher/actor_mlp"}
    assert all("one mask entry per row" in m for m in ctx.probe_errors.values())
    with pytest.raises(ValueError, match=r"shape \(rows,\) or \(batch, time\)"):
        ctx.row_mask = torch.ones(2, 3, 4)
    with pytest.raises(TypeError, match="torch.Tensor"):
        ctx.row_mask = [1, 0, 1]


def test_per_step_calls_beyond_the_mask_steps_are_an_error() -> None:
    torch.manual_seed(0)
    net = SeqNet("lstm_cell")
    net.per_step = True
    policy = PolicyAutoBuilder.wrap(net, {"core": "core"})
    ctx = ComponentContext(strict=True)
    policy.attach("core", attach_relu_activation_hooks(), ctx)
    ctx.row_mask = torch.ones(B, T - 1)
    with pytest.raises(ValueError, match="new row_mask block per minibatch"):
        net(torch.randn(T, B, F_IN))


def test_non_tensor_output_of_a_non_recurrent_module_keeps_its_probe_error() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    model = nn.Sequential(Pair())
    policy = PolicyAutoBuilder.wrap(model, {"pair": model[0]})
    ctx = ComponentContext(strict=True)
    policy.attach("pair", attach_relu_activation_hooks(), ctx)
    with pytest.raises(ProbeError, match="pass extractor=..."):
        policy(torch.randn(2, 3))
    policy.remove_hooks()
    policy.trace_outputs(torch.randn(2, 3))
    with pytest.raises(ProbeError, match="returns a sequence, not a tensor"):
        policy.attach("pair", attach_gradient_flow_hooks(), ctx, backward=True)


# ---------------------------------------------------------------- SB3 RecurrentPPO
N_ENVS, N_STEPS, BATCH, N_EPOCHS, CYCLES = 2, 16, 16, 2, 2
ROWS = N_ENVS * N_STEPS


def recurrent_ppo() -> Any:
    """sb3-contrib's RecurrentPPO on CartPole with small ReLU MLPs and LSTMs."""
    return sb3_cartpole(
        recurrent=True,
        n_steps=N_STEPS,
        batch_size=BATCH,
        n_epochs=N_EPOCHS,
        hidden=(8,),
        n_envs=N_ENVS,
        activation_fn=nn.ReLU,
        lstm_hidden_size=8,
    )


def record_masks(model: Any) -> list[tuple[int, torch.Tensor]]:
    """Each training minibatch's padding mask, (sequences, steps), read from the rollout
    buffer itself, with the agent step of its cycle: an independent record of the rows."""
    buffer = model.rollout_buffer
    masks: list[tuple[int, torch.Tensor]] = []
    plain_get_samples = buffer._get_samples

    def get_samples(*args, **kwargs):
        sample = plain_get_samples(*args, **kwargs)
        n_seq = sample.lstm_states.pi[0].shape[1]
        masks.append((model.num_timesteps, sample.mask.reshape(n_seq, -1).bool()))
        return sample

    buffer._get_samples = get_samples
    return masks


def test_recurrent_ppo_reads_its_padding_mask_and_matches_plain_hooks(tmp_path) -> None:
    from policy_probes.integrations.sb3 import ProbeCallback
    from policy_probes.sinks import SinksConfig

    bare = recurrent_ppo()
    bare.learn(CYCLES * ROWS)
    model = recurrent_ppo()
    policy = model.policy
    buffer = model.rollout_buffer
    # independent records: each training minibatch's mask and plain torch hooks on the
    # LSTM, the actor MLP and the action head
    masks = record_masks(model)
    lstm = Recorder({"lstm": policy.lstm_actor}, pick=lambda out: out[0])
    rec = Recorder({"mlp": policy.mlp_extractor.policy_net, "head": policy.action_net})
    callback = ProbeCallback(
        probes=[
            ("lstm_actor", attach_relu_activation_hooks()),
            ("lstm_actor", attach_saturated_activation_hooks("tanh")),
            ("lstm_critic", attach_relu_activation_hooks()),
            ("actor_mlp", attach_relu_activation_hooks()),
        ],
        backward_probes=[
            ("lstm_actor", attach_fisher_information_hooks()),
            ("lstm_actor", attach_gradient_flow_hooks()),
            ("lstm_critic", attach_gradient_flow_hooks()),
            ("actor_mlp", attach_relu_gradient_flow_hooks()),
            ("actor_mlp", attach_fisher_information_hooks()),
            ("actor_head", attach_fisher_information_hooks()),
            ("critic_head", attach_fisher_information_hooks()),
        ],
        run_dir=tmp_path / "run",
        probing=ProbeSettings(sinks=SinksConfig(console=False), strict=True, probe_budget=None),
    )
    model.learn(CYCLES * ROWS, callback=callback)
    lstm.remove()
    rec.remove()
    assert "get" not in vars(buffer)  # the callback's wrapper is gone with its session
    # tracing, probing and masking changed nothing in SB3's trajectory
    bare_state = bare.policy.state_dict()
    for name, p in policy.state_dict().items():
        assert torch.equal(p, bare_state[name]), name
    assert len(callback.history) == CYCLES
    assert len(masks) == len(rec.out["head"]) == len(rec.grad["head"])
    assert sum(int((~m).sum()) for _, m in masks) > 0  # the minibatches had padding

    for c, record in enumerate(callback.history):
        window = [i for i, (steps, _) in enumerate(masks) if steps == ROWS * (c + 1)]
        assert window
        kept = [masks[i][1] for i in window]
        # every real step once per epoch; no padded step
        for name in ("lstm_actor", "lstm_critic", "actor_mlp"):
            assert record[f"probes/relu/{name}/samples"] == N_EPOCHS * ROWS
        # LSTM output rows (time-major, one call or one per step) picked by (step, sequence)
        h_lstm = torch.cat(
            [
                torch.cat(outs, dim=0)[k.T]
                for outs, k in zip(lstm_calls_by_minibatch(lstm, masks, window), kept, strict=True)
            ]
        )
        assert record["probes/relu/lstm_actor/active_rate"] == pytest.approx(
            (h_lstm > 0).double().mean(0).tolist(), rel=REL
        )
        # actor MLP output and action head: flat rows in the buffer's (sequence, step) order
        h = torch.cat([rec.out["mlp"][i][k.reshape(-1)] for i, k in zip(window, kept, strict=True)])
        assert record["probes/relu/actor_mlp/active_rate"] == pytest.approx(
            (h > 0).double().mean(0).tolist(), rel=REL
        )
        # Fisher of the action head: per-sample gradient = kept rows x the gradient of
        # SB3's masked-mean loss
        per_sample = torch.cat(
            [
                rec.grad["head"][i][k.reshape(-1)].double() * int(k.sum())
                for i, k in zip(window, kept, strict=True)
            ]
        )
        assert record["probes/fisher/actor_head/unit"] == pytest.approx(
            per_sample.square().mean(0).tolist(), rel=REL
        )
        assert record["probes/fisher/actor_head/samples"] == N_EPOCHS * ROWS
        assert record["probes/gradient_flow/lstm_actor/passes"] == len(window)


def test_recurrent_ppo_at_the_default_reports_every_cycle_from_its_first_minibatch(
    tmp_path,
) -> None:
    """At the default sampling (one pass in 16 of every cycle; 4 here) each cycle observes
    its first training minibatch and reports: the actor MLP's active rate and sample
    count equal a plain torch hook's on that minibatch's real (unpadded) steps."""
    from policy_probes.integrations.sb3 import ProbeCallback
    from policy_probes.sinks import SinksConfig

    model = recurrent_ppo()
    masks = record_masks(model)
    rec = Recorder({"mlp": model.policy.mlp_extractor.policy_net})
    callback = ProbeCallback(
        probes=[("actor_mlp", attach_relu_activation_hooks(), {"per_layer": False})],
        backward_probes=[("actor_head", attach_fisher_information_hooks())],
        run_dir=tmp_path / "run",
        probing=ProbeSettings(sinks=SinksConfig(console=False, wandb=False), strict=True),
    )
    cycles = 3
    model.learn(cycles * ROWS, callback=callback)
    rec.remove()
    assert len(callback.history) == cycles
    for c, record in enumerate(callback.history):
        first = next(i for i, (steps, _) in enumerate(masks) if steps == ROWS * (c + 1))
        kept = masks[first][1].reshape(-1)
        h = rec.out["mlp"][first][kept]
        assert record["probes/relu/actor_mlp/passes_observed"] == 1
        assert record["probes/relu/actor_mlp/samples"] == int(kept.sum())
        assert record["probes/relu/actor_mlp/active_rate"] == pytest.approx(
            (h > 0).double().mean(0).tolist(), rel=REL
        )
        assert record["probes/fisher/actor_head/samples"] == int(kept.sum())
        assert isinstance(record["probes/fisher/actor_head/trace"], float)


def lstm_calls_by_minibatch(
    lstm: Recorder, masks: list[tuple[int, torch.Tensor]], window: list[int]
) -> list[list[torch.Tensor]]:
    """The recorded LSTM outputs of each training minibatch of ``window``: one call of
    (T, n_seq, H) or T calls of (1, n_seq, H), told apart by the mask's step count."""
    out, j = [], 0
    for i, (_, k) in enumerate(masks):
        steps = k.shape[1]
        calls = 1 if lstm.out["lstm"][j].shape[0] == steps else steps
        if i in window:
            out.append(lstm.out["lstm"][j : j + calls])
        j += calls
    return out
