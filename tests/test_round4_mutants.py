"""Issue 42, items 9 and 10: tests that kill the one-line bugs the mutation run left alive,
and values no test compared with anything, each against an independent computation.

Every test drives the code as a user does (a ``ProbeSession`` loop, a checkpoint written
with ``torch.save`` and a second session resumed from it, the CLI) and checks the
reported numbers against the formula written out here on hook-free copies of the model:

* churn: the held-out batch a resumed epoch compares on; ``output_change_max`` and
  ``kind="output"``;
* weights: ``update_ratio`` after a mid-epoch resume, the component's ``magnitude``;
* utility: the running scores across a resume, ``contribution_mean``, the ``tau=0``
  boundary;
* L2 Init under gradient clipping and across a resume; plasticity injection's frozen copy
  and its optimizer under a learning-rate schedule;
* ``arms``' last quarter, a one-row CSV in a run directory, the budget's per-epoch stride
  and a mid-epoch resume of the sampler, two holders of the eager stance;
* the gradient noise scale against McCandlish et al.'s two-batch-size estimates from
  per-sample gradients of one backward pass per sample.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import JSONL_ONLY, TinyPolicy
from torch import nn

from policy_probes import (
    ComponentContext,
    ProbeSettings,
    Run,
    StatsReporter,
    attach_fisher_information_hooks,
    attach_relu_activation_hooks,
)
from policy_probes.cli import main
from policy_probes.probes.churn import attach_churn_hooks
from policy_probes.probes.utility import attach_utility_hooks
from policy_probes.probes.weights import attach_weights_hooks
from policy_probes.remedies import l2_init, plasticity_injection
from policy_probes.run import RunDirConflict
from policy_probes.session import ProbeSession


class Agent(nn.Module):
    """``body`` (Linear 4->16, ReLU, Linear 16->8, ReLU) read by a policy head ``pi``
    (3 logits) and a value head ``v``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU())
        self.pi = nn.Linear(8, 3)
        self.v = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.pi(h), self.v(h)


def clean_copy(model: Agent) -> Agent:
    """A hook-free copy with ``model``'s values (what the reference computations run)."""
    twin = Agent()
    twin.load_state_dict(model.state_dict())
    return twin


def loss_of(model: nn.Module, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    logits, v = model(x)
    return F.cross_entropy(logits, a) + v.square().mean()


def minibatches(n: int, seed: int, rows: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g))
        for _ in range(n)
    ]


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
    for x, a in batches:
        opt.zero_grad()
        loss_of(model, x, a).backward()
        opt.step()


def open_session(
    run_dir: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    *,
    resume: bool = False,
    budget: float | None = None,
) -> ProbeSession:
    """Every pass observed (or the default budget's passes), records in metrics.jsonl."""
    probing = ProbeSettings(sinks=JSONL_ONLY, probe_budget=budget)
    return ProbeSession(model, run=Run(run_dir, resume=resume), probing=probing, optimizer=opt)


def save_checkpoint(
    path: Path, model: nn.Module, opt: torch.optim.Optimizer, session: ProbeSession
) -> None:
    state = {"session": session.state_dict()}  # first: it flushes the records
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), **state}, path)


def resumed(path: Path, lr: float, seed: int = 99) -> tuple[Agent, torch.optim.Optimizer, dict]:
    """A new process's model and optimizer (built from another seed) loaded from ``path``."""
    ckpt = torch.load(path, weights_only=False)
    torch.manual_seed(seed)
    model = Agent()
    model.load_state_dict(ckpt["model"])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.load_state_dict(ckpt["optimizer"])
    return model, opt, ckpt


def rollout_end(session: ProbeSession, obs: torch.Tensor) -> None:
    session.set_phase("rollout")
    session.rollout_end(observations=obs)
    session.set_phase("train")


def flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in params])


# ------------------------------------------------------------------------------ churn
def test_churn_resumed_between_epochs_compares_on_the_previous_rollouts_states(tmp_path):
    """Epoch 2 compares on epoch 1's rollout (the pending batch), also when the run was
    checkpointed after epoch 1 and resumed in a new session."""
    torch.manual_seed(0)
    model = Agent()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    g = torch.Generator().manual_seed(1)
    obs1, obs2 = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt.pt"
    session = open_session(run_dir, model, opt)
    session.add_training_hook("v", attach_churn_hooks(batch_size=8))  # 8 rows: all of them
    rollout_end(session, obs1)
    train(model, opt, minibatches(3, seed=2))
    session.epoch_end(step=8)
    save_checkpoint(ckpt, model, opt, session)
    session.close()

    model, opt, saved = resumed(ckpt, lr=0.3)
    session = open_session(run_dir, model, opt, resume=True)
    session.add_training_hook("v", attach_churn_hooks(batch_size=8))
    session.load_state_dict(saved["session"])
    before = clean_copy(model)
    rollout_end(session, obs2)
    train(model, opt, minibatches(3, seed=3))
    got = session.epoch_end(step=16)
    session.close()
    after = clean_copy(model)
    with torch.no_grad():
        dv = [(after(o)[1] - before(o)[1]).abs().reshape(-1).double() for o in (obs1, obs2)]
    assert got["probes/churn/v/value_change"] == pytest.approx(float(dv[0].mean()), rel=1e-6)
    assert got["probes/churn/v/value_change_max"] == pytest.approx(float(dv[0].max()), rel=1e-6)
    assert got["probes/churn/v/states"] == 8.0
    # the current rollout's states give another number: the test tells the batches apart
    assert abs(float(dv[1].mean()) - float(dv[0].mean())) > 1e-3 * float(dv[0].mean())


def test_churn_output_change_max_and_kind_output_against_the_outputs(tmp_path):
    """``output_change`` / ``output_change_max`` of a categorical head and of a component
    read with ``kind="output"`` (8 features): the mean over entries of |y' - y| per state,
    averaged and maximised over the held-out states; the policy KL written out."""
    torch.manual_seed(4)
    model = Agent()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    obs = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
    with open_session(tmp_path / "run", model, opt) as session:
        session.add_training_hook("pi", attach_churn_hooks(kind="categorical", batch_size=8))
        session.add_training_hook("body", attach_churn_hooks(kind="output", batch_size=8))
        before = clean_copy(model)
        rollout_end(session, obs)
        train(model, opt, minibatches(4, seed=6))
        got = session.epoch_end(step=8)
    after = clean_copy(model)
    with torch.no_grad():
        outputs = {
            "body": (before.body(obs), after.body(obs)),
            "pi": (before(obs)[0], after(obs)[0]),
        }
    for component, (y0, y1) in outputs.items():
        per_state = [
            sum(abs(float(b) - float(a)) for a, b in zip(r0, r1, strict=True)) / len(r0)
            for r0, r1 in zip(y0.tolist(), y1.tolist(), strict=True)
        ]
        key = f"probes/churn/{component}/output_change"
        assert got[key] == pytest.approx(sum(per_state) / len(per_state), rel=1e-6)
        assert got[key + "_max"] == pytest.approx(max(per_state), rel=1e-6)
        assert got[key + "_max"] > got[key]  # the states differ: max is not the mean
    assert "probes/churn/body/policy_kl" not in got  # kind="output": no KL
    assert "probes/churn/body/value_change" not in got
    kl = []
    for lp, lq in zip(outputs["pi"][0].tolist(), outputs["pi"][1].tolist(), strict=True):
        zp, zq = math.log(sum(map(math.exp, lp))), math.log(sum(map(math.exp, lq)))
        kl.append(
            sum(math.exp(p - zp) * ((p - zp) - (q - zq)) for p, q in zip(lp, lq, strict=True))
        )
    assert got["probes/churn/pi/policy_kl"] == pytest.approx(sum(kl) / len(kl), rel=1e-5)
    assert got["probes/churn/pi/policy_kl_max"] == pytest.approx(max(kl), rel=1e-5)


# ---------------------------------------------------------------------------- weights
def test_weights_update_ratio_after_a_mid_epoch_resume_and_the_components_magnitude(tmp_path):
    """Checkpointed in the middle of epoch 2 and resumed: epoch 2's ``update_ratio`` is
    ||theta_2 - theta_1|| / ||theta_1|| with theta_1 the parameters at epoch 1's report
    (not at the checkpoint), ``init_distance`` is measured from the first session's
    initialisation; ``magnitude`` of the component is the mean |theta_j| over all its
    parameters together."""
    torch.manual_seed(7)
    model = Agent()
    theta0 = flat(list(model.body.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    run_dir, ckpt = tmp_path / "run", tmp_path / "mid.pt"
    session = open_session(run_dir, model, opt)
    session.add_training_hook("body", attach_weights_hooks())
    train(model, opt, minibatches(3, seed=8))
    got1 = session.epoch_end(step=1)
    theta1 = flat(list(model.body.parameters()))
    train(model, opt, minibatches(2, seed=9))  # epoch 2, up to the checkpoint
    save_checkpoint(ckpt, model, opt, session)
    session.close()

    model, opt, saved = resumed(ckpt, lr=0.2)
    session = open_session(run_dir, model, opt, resume=True)
    session.add_training_hook("body", attach_weights_hooks())
    session.load_state_dict(saved["session"])
    train(model, opt, minibatches(2, seed=10))  # the rest of epoch 2
    got2 = session.epoch_end(step=2)
    session.close()
    theta2 = flat(list(model.body.parameters()))

    key = "probes/weights/body/"
    assert got1[key + "magnitude"] == pytest.approx(float(theta1.abs().mean()), rel=1e-12)
    assert got2[key + "magnitude"] == pytest.approx(float(theta2.abs().mean()), rel=1e-12)
    layers = [flat(list(m.parameters())) for m in (model.body[0], model.body[2])]
    mean_of_layers = sum(float(t.abs().mean()) for t in layers) / 2
    assert abs(got2[key + "magnitude"] - mean_of_layers) > 1e-3  # not the layers' mean
    want = float((theta2 - theta1).norm() / theta1.norm())
    assert got2[key + "update_ratio"] == pytest.approx(want, rel=1e-9)
    since_checkpoint = flat(list(saved["model"][k] for k in saved["model"] if k.startswith("body")))
    assert abs(float((theta2 - since_checkpoint).norm() / since_checkpoint.norm()) - want) > 1e-4
    assert got2[key + "init_distance"] == pytest.approx(
        float((theta2 - theta0).norm() / theta0.norm()), rel=1e-9
    )
    first = model.body[0]
    w = flat([first.weight, first.bias])
    w1 = theta1[: w.numel()]
    assert got2["probes/weights/body.0/update_ratio"] == pytest.approx(
        float((w - w1).norm() / w1.norm()), rel=1e-9
    )


# ---------------------------------------------------------------------------- utility
def hidden_units(model: Agent, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of ``body.1`` and ``body.3`` (the two ReLUs) on a hook-free copy."""
    ref = clean_copy(model)
    with torch.no_grad():
        h1 = ref.body[1](ref.body[0](x))
        return h1, ref.body[3](ref.body[2](h1))


def contributions(rows: list[torch.Tensor], w_next: torch.Tensor) -> list[float]:
    """c_i = mean over rows |h_i| * sum_k |w_ki|, unit by unit on host floats."""
    h = torch.cat(rows).tolist()
    w = w_next.detach().tolist()
    return [
        sum(abs(r[i]) for r in h) / len(h) * sum(abs(row[i]) for row in w) for i in range(len(h[0]))
    ]


def test_utility_scores_survive_a_resume_and_tau_zero_counts_the_dead_units(tmp_path):
    """Two epochs, a checkpoint between them, the second in a resumed session: the
    utility is decay * c_1 + (1 - decay) * c_2 per unit (c from this file's loops over
    units, rows and outgoing weights), ``contribution_mean`` the mean of the epoch's c,
    and with ``tau=0`` the low-utility fraction counts exactly the units whose
    contribution is 0 (three units of ``body.1`` and one of ``body.3`` made dead)."""
    torch.manual_seed(11)
    model = Agent()
    with torch.no_grad():  # dead ReLU units: never positive on N(0, 1) inputs
        model.body[0].bias[:3] = -50.0
        model.body[2].bias[0] = -50.0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    decay = 0.7
    probe = attach_utility_hooks(outgoing="pi", decay=decay, tau=0.0)
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt.pt"
    seen: list[dict[str, list[float]]] = []
    got = []

    def epoch(model: Agent, opt: torch.optim.Optimizer, seed: int) -> None:
        rows: dict[str, list[torch.Tensor]] = {"body.1": [], "body.3": []}
        for x, a in minibatches(3, seed=seed):
            h1, h3 = hidden_units(model, x)  # the values the pass's forward sees
            rows["body.1"].append(h1)
            rows["body.3"].append(h3)
            train(model, opt, [(x, a)])
        seen.append(
            {
                "body.1": contributions(rows["body.1"], model.body[2].weight),
                "body.3": contributions(rows["body.3"], model.pi.weight),
            }
        )

    session = open_session(run_dir, model, opt)
    session.add_training_hook("body", probe)
    epoch(model, opt, seed=12)
    got.append(session.epoch_end(step=1))
    save_checkpoint(ckpt, model, opt, session)
    session.close()

    model, opt, saved = resumed(ckpt, lr=0.1)
    session = open_session(run_dir, model, opt, resume=True)
    session.add_training_hook("body", attach_utility_hooks(outgoing="pi", decay=decay, tau=0.0))
    session.load_state_dict(saved["session"])
    epoch(model, opt, seed=13)
    got.append(session.epoch_end(step=2))
    session.close()

    for layer, dead in (("body.1", 3), ("body.3", 1)):
        key = f"probes/utility/{layer}/"
        c1, c2 = seen[0][layer], seen[1][layer]
        u2 = [decay * a + (1 - decay) * b for a, b in zip(c1, c2, strict=True)]
        for record, c, u in ((got[0], c1, c1), (got[1], c2, u2)):
            assert record[key + "utility"] == pytest.approx(u, rel=1e-6, abs=1e-12)
            assert record[key + "contribution_mean"] == pytest.approx(sum(c) / len(c), rel=1e-6)
            assert record[key + "utility_mean"] == pytest.approx(sum(u) / len(u), rel=1e-6)
            zero = sum(1 for v in u if v == 0.0)
            assert zero >= dead  # the units killed above, and any dead by chance
            assert record[key + "low_utility_fraction"] == zero / len(u)
        assert max(abs(a - b) for a, b in zip(u2, c2, strict=True)) > 1e-4  # the resume shows


# ------------------------------------------------------------------ L2 Init, injection
def body_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("body.")}


def assert_params_close(model: nn.Module, ref: nn.Module) -> None:
    mine = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, mine[n], rtol=1e-6, atol=1e-7, msg=n)


def l2_sgd_by_hand(
    ref: Agent,
    x: torch.Tensor,
    a: torch.Tensor,
    *,
    lr: float,
    coef: float,
    anchors: dict,
    max_norm: float | None = None,
) -> float:
    """One SGD step of ``ref`` on the loss's gradient, clipped to ``max_norm`` when given,
    plus coef * (theta - theta_0) on ``body`` (L2 Init after the clipping); returns the
    gradient's global norm before clipping."""
    params = list(ref.named_parameters())
    grads = torch.autograd.grad(loss_of(ref, x, a), [p for _, p in params])
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    scale = min(1.0, max_norm / (norm + 1e-6)) if max_norm is not None else 1.0
    with torch.no_grad():
        for (n, p), g in zip(params, grads, strict=True):
            step = g * scale
            if n in anchors:
                step = step + coef * (p - anchors[n])
            p -= lr * step
    return norm


def test_l2_init_term_is_added_after_the_loops_gradient_clipping(tmp_path):
    """A loop that clips the global gradient norm to 0.05 before ``optimizer.step()``:
    each SGD step is theta - lr * (clip(g) + coef * (theta - theta_0)) on ``body``, the
    clipping leaving the L2 term alone (docs/remedies.md)."""
    torch.manual_seed(21)
    model = Agent()
    ref = clean_copy(model)
    anchors = body_params(model)
    lr, coef = 0.5, 2.0
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with open_session(tmp_path / "run", model, opt) as session:
        session.add_remedy("body", l2_init(coef=coef))
        for x, a in minibatches(4, seed=22):
            opt.zero_grad()
            loss_of(model, x, a).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            norm = l2_sgd_by_hand(ref, x, a, lr=lr, coef=coef, anchors=anchors, max_norm=0.05)
            assert norm > 0.05  # the clipping acts at every step
            assert_params_close(model, ref)
        got = session.epoch_end(step=1)
    distance = math.sqrt(
        sum(
            float((p.detach() - anchors[n]).double().square().sum())
            for n, p in model.named_parameters()
            if n in anchors
        )
    )
    assert got["remedies/l2_init/body/steps"] == 4.0
    assert got["remedies/l2_init/body/distance"] == pytest.approx(distance, rel=1e-9)


def test_l2_init_resumed_pulls_towards_the_first_sessions_initialisation(tmp_path):
    """theta_0 comes from the checkpoint: a resumed session whose remedy is attached to
    the loaded (trained) parameters still pulls towards the run's initialisation."""
    torch.manual_seed(41)
    model = Agent()
    anchors = body_params(model)
    lr, coef = 0.3, 1.5
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt.pt"
    session = open_session(run_dir, model, opt)
    session.add_remedy("body", l2_init(coef=coef))
    train(model, opt, minibatches(3, seed=42))
    session.epoch_end(step=1)
    save_checkpoint(ckpt, model, opt, session)
    session.close()

    model, opt, saved = resumed(ckpt, lr=lr)
    ref = clean_copy(model)
    at_resume = body_params(model)
    session = open_session(run_dir, model, opt, resume=True)
    session.add_remedy("body", l2_init(coef=coef))
    session.load_state_dict(saved["session"])
    with session:
        for x, a in minibatches(3, seed=43):
            train(model, opt, [(x, a)])
            l2_sgd_by_hand(ref, x, a, lr=lr, coef=coef, anchors=anchors)
            assert_params_close(model, ref)
        got = session.epoch_end(step=2)
    theta = body_params(model)
    distance = math.sqrt(sum(float((theta[n] - anchors[n]).double().square().sum()) for n in theta))
    assert got["remedies/l2_init/body/distance"] == pytest.approx(distance, rel=1e-9)
    moved = sum(float((at_resume[n] - anchors[n]).abs().sum()) for n in anchors)
    assert moved > 1e-3  # the checkpoint's parameters are not theta_0: the test tells


def fresh_body() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU())


def injected_sgd_step(model: Agent, inj: Any, x: torch.Tensor, a: torch.Tensor, lr: float):
    """theta' - lr * dL/dtheta' for the injected output body(x) + t(x) - t0(x), on
    hook-free copies (the loss is this file's, the heads the model's)."""
    ref = clean_copy(model)  # the policy's state: the frozen body and the heads
    twins = []
    for source in (inj.trainable, inj.frozen):
        twin = fresh_body()
        twin.load_state_dict(source.state_dict())
        twins.append(twin)
    trainable, frozen = twins
    frozen.requires_grad_(False)
    h = ref.body(x) + trainable(x) - frozen(x)
    logits, v = ref.pi(h), ref.v(h)
    loss = F.cross_entropy(logits, a) + v.square().mean()
    params = list(trainable.parameters())
    grads = torch.autograd.grad(loss, params)
    return [(p - lr * g).detach() for p, g in zip(params, grads, strict=True)]


def test_plasticity_injection_copy_under_a_schedule_and_a_frozen_copy_without_gradients(
    tmp_path,
):
    """After the injection (epoch 1's end) the loop's scheduler lowers the learning rate
    each epoch: every step moves theta' by exactly -lr_now * its gradient (SGD written
    out on hook-free copies), and the frozen theta'_0 neither requires nor accumulates
    a gradient."""
    torch.manual_seed(31)
    model = Agent()
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)
    with open_session(tmp_path / "run", model, opt) as session:
        session.add_remedy("body", plasticity_injection(every_epochs=1, seed=3))
        train(model, opt, minibatches(2, seed=32))
        assert session.epoch_end(step=1)["remedies/plasticity_injection/body/fired"] == 1.0
        inj = session.remedies.bound[0].prepared
        for epoch, seed in ((2, 33), (3, 34)):
            schedule.step()
            lr = opt.param_groups[0]["lr"]
            assert lr == pytest.approx(0.4 * 0.25 ** (epoch - 1))
            for x, a in minibatches(2, seed=seed):
                want = injected_sgd_step(model, inj, x, a, lr)
                train(model, opt, [(x, a)])
                for p, w in zip(inj.trainable.parameters(), want, strict=True):
                    torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-8)
                for p in inj.frozen.parameters():
                    assert not p.requires_grad and p.grad is None
            session.epoch_end(step=epoch)


# ------------------------------------------------------------------------- arms, run
def write_records(run_dir: Path, returns: dict[int, float]) -> None:
    """A finished run directory: config.json and one POST_EPOCH record per epoch."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"seed": 0}) + "\n")
    lines = [
        json.dumps({"epoch": e, "agent_step": 64 * e, "hook_point": "POST_EPOCH", RETURN: r})
        for e, r in sorted(returns.items())
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


RETURN = "rollout/episode_return"


@pytest.mark.parametrize("after", [5, 6, 7, 9])
def test_arms_return_last_is_the_mean_of_the_last_quarter_rounded_up(tmp_path, capsys, after):
    """``policy-probes arms`` on a parent of 1 + ``after`` epochs forked after epoch 1,
    its children complete already (reused, not trained): ``return_last`` is the mean
    return of the last ceil(after / 4) epochs (2, 2, 2 and 3 here), ``return`` of all."""
    epochs = range(2, 2 + after)
    parent = tmp_path / "parent"
    write_records(parent, {e: float(e) for e in range(1, 2 + after)})
    out = tmp_path / "arms"
    returns = {e: float(e * e) for e in epochs}  # every epoch's its own
    write_records(out / "parent" / "none", returns)
    args = ["arms", str(parent), "--epoch", "1", "--arm", "none", "--out", str(out)]
    assert main([*args, "--no-report"]) == 0
    capsys.readouterr()
    got = json.loads((out / "arms.json").read_text())["comparison"]["none"]
    quarter = -(-after // 4)  # ceil, in integers
    last = [returns[e] for e in list(epochs)[-quarter:]]
    assert got["return_last"]["mean"] == pytest.approx(sum(last) / len(last), rel=1e-12)
    assert got["return"]["mean"] == pytest.approx(sum(returns.values()) / after, rel=1e-12)


@pytest.mark.parametrize("columns", [2, 4000])
def test_a_run_dir_with_one_csv_record_is_a_run_not_an_aborted_start(tmp_path, columns):
    """A run directory holding only ``metrics.csv`` with a header and one record (its
    ``config.json`` lost) holds a run: a new session there is refused and the file kept,
    also when the header is longer than 64 KiB (4000 probe columns); a header alone is
    what a run killed while it started leaves, and is replaced."""
    keys = [f"probes/fisher/encoder.{i}/weight.grad_noise_scale" for i in range(columns)]
    header = ",".join(["epoch", "agent_step", "hook_point", *keys]) + "\n"
    one_row = header + ",".join(["1", "64", "POST_EPOCH", *["0.5"] * columns]) + "\n"
    for text, refused in ((one_row, True), (header, False)):
        run_dir = tmp_path / ("one_row" if refused else "header")
        run_dir.mkdir()
        (run_dir / "metrics.csv").write_text(text)
        model = Agent()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if refused:
            with pytest.raises(RunDirConflict, match="already holds a run"):
                open_session(run_dir, model, opt)
            assert (run_dir / "metrics.csv").read_text() == text
        else:
            with open_session(run_dir, model, opt) as session:  # JSONL only: no new CSV
                session.epoch_end(step=1)
            assert not (run_dir / "metrics.csv").exists()
            assert [r["epoch"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())] == [1]


# ---------------------------------------------------------------------------- sampler
#: passes per epoch in the sampler tests: not a multiple of the budget's stride of 16
PASSES = 20


def body_outputs(model: Agent, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return clean_copy(model).body(x)


def train_passes(
    model: Agent, opt: torch.optim.Optimizer, first: int, last: int, seed: int
) -> dict[int, torch.Tensor]:
    """Passes ``first .. last - 1`` of an epoch, pass i on 2 + i rows (the rows observed
    name the passes); returns the ``body`` output each pass's forward computed."""
    g = torch.Generator().manual_seed(seed)
    batches = [
        (torch.randn(2 + i, 4, generator=g), torch.randint(0, 3, (2 + i,), generator=g))
        for i in range(PASSES)
    ]
    outputs = {}
    for i in range(first, last):
        x, a = batches[i]
        outputs[i] = body_outputs(model, x)
        train(model, opt, [(x, a)])
    return outputs


def assert_observed(record: dict, outputs: dict[int, torch.Tensor], passes: list[int]) -> None:
    """The relu probe's counts and per-unit active rate over the rows of ``passes``."""
    h = torch.cat([outputs[i] for i in passes])
    assert record["probes/relu/body/passes_observed"] == len(passes)
    assert record["probes/relu/body/rows_observed"] == sum(2 + i for i in passes)
    rate = [sum(1 for v in h[:, u].tolist() if v > 0) / h.shape[0] for u in range(h.shape[1])]
    assert record["probes/relu/body/active_rate"] == pytest.approx(rate, rel=1e-12)


def test_budget_observes_passes_0_and_16_of_every_epoch_of_20_passes(tmp_path):
    """The default budget's stride counts the passes of each epoch: with 20 passes per
    epoch, epoch 2 observes its own passes 0 and 16 (the run's 20 and 36), not the run's
    32 (its pass 12)."""
    torch.manual_seed(51)
    model = Agent()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with open_session(tmp_path / "run", model, opt, budget=0.05) as session:
        session.add_training_hook("body", attach_relu_activation_hooks(), per_layer=False)
        for epoch in (1, 2):
            outputs = train_passes(model, opt, 0, PASSES, seed=50 + epoch)
            record = session.epoch_end(step=epoch)
            assert record["probes/relu/observe_every"] == 16.0
            assert_observed(record, outputs, [0, 16])


def test_a_mid_epoch_resume_continues_the_epochs_pass_count(tmp_path):
    """Checkpointed after pass 5 of epoch 2 and resumed: the resumed session goes on
    counting from pass 5, so epoch 2 observes passes 0 (before the checkpoint) and 16."""
    torch.manual_seed(52)
    model = Agent()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run_dir, ckpt = tmp_path / "run", tmp_path / "mid.pt"
    session = open_session(run_dir, model, opt, budget=0.05)
    session.add_training_hook("body", attach_relu_activation_hooks(), per_layer=False)
    train_passes(model, opt, 0, PASSES, seed=53)
    session.epoch_end(step=1)
    outputs = train_passes(model, opt, 0, 5, seed=54)
    save_checkpoint(ckpt, model, opt, session)
    session.close()

    model, opt, saved = resumed(ckpt, lr=0.1)
    session = open_session(run_dir, model, opt, resume=True, budget=0.05)
    session.add_training_hook("body", attach_relu_activation_hooks(), per_layer=False)
    session.load_state_dict(saved["session"])
    with session:
        outputs.update(train_passes(model, opt, 5, PASSES, seed=54))
        record = session.epoch_end(step=2)
    assert_observed(record, outputs, [0, 16])


# ---------------------------------------------------------------------------- compile
def test_a_session_closed_beside_another_leaves_the_others_compiled_passes_observed(tmp_path):
    """Two loops, each with a ``torch.compile``d policy and every pass observed: closing
    the first session gives back only its claim on the eager stance, so the second's
    passes still run eagerly (nothing compiles) and its probe sees each of them."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from policy_probes.compiled import eager_held

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    try:
        torch.manual_seed(61)
        models = [Agent(), Agent()]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        sessions = [open_session(tmp_path / f"run{i}", models[i], opts[i]) for i in (0, 1)]
        for s in sessions:
            s.add_training_hook("body", attach_relu_activation_hooks(), per_layer=False)
        sessions[0].close()
        policy, opt = torch.compile(models[1], backend=counter), opts[1]
        g = torch.Generator().manual_seed(62)
        outputs = {}
        for i in range(3):
            x, a = torch.randn(2 + i, 4, generator=g), torch.randint(0, 3, (2 + i,), generator=g)
            outputs[i] = body_outputs(models[1], x)
            opt.zero_grad()
            loss_of(policy, x, a).backward()
            opt.step()
        record = sessions[1].epoch_end(step=1)
        sessions[1].close()
        assert not eager_held()
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 0  # every pass ran eagerly
    assert_observed(record, outputs, [0, 1, 2])


# ---------------------------------------------------------------- gradient noise scale
def per_sample_gradients(policy: TinyPolicy, x: torch.Tensor, a: torch.Tensor) -> list[dict]:
    """One backward pass per sample through a hook-free copy: d loss_i / d theta."""
    twin = TinyPolicy()
    twin.load_state_dict(policy.state_dict())
    params = dict(twin.actor_mlp.named_parameters())
    out = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(twin(x[i : i + 1]), a[i : i + 1])
        grads = torch.autograd.grad(loss, list(params.values()))
        out.append({n: g.double().reshape(-1) for n, g in zip(params, grads, strict=True)})
    return out


def two_batch_estimates(per_sample: list[torch.Tensor]) -> tuple[float, float]:
    """McCandlish et al. (2018), appendix A.1: from |G_B|^2 measured at a small and a big
    batch size, |G|^2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small) and
    S = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big). Here B_small = 1 (the
    mean over samples of |g_i|^2) and B_big = N (|mean g_i|^2)."""
    n = len(per_sample)
    small = sum(float(g @ g) for g in per_sample) / n
    mean = sum(per_sample) / n
    big = float(mean @ mean)
    g2 = (n * big - 1 * small) / (n - 1)
    s = (small - big) / (1 / 1 - 1 / n)
    # the same from the sample covariance: tr(Sigma) = sum_i |g_i - mean|^2 / (N - 1)
    trace = sum(float((g - mean) @ (g - mean)) for g in per_sample) / (n - 1)
    assert s == pytest.approx(trace, rel=1e-9)
    assert g2 == pytest.approx(big - trace / n, rel=1e-9, abs=1e-15)
    return g2, s


def test_gradient_noise_scale_against_mcCandlish_two_batch_estimates() -> None:
    """The Fisher probe's ``grad_sq_norm``, ``grad_var_trace`` and ``grad_noise_scale``
    over a window of two backward passes (10 and 6 samples), per parameter and for the
    component, against the paper's estimators from per-sample gradients of one backward
    pass per sample (docs/probes/fisher.md, *Gradient noise scale*)."""
    torch.manual_seed(71)
    policy = TinyPolicy()
    ctx = ComponentContext()
    policy.attach("actor_mlp", attach_fisher_information_hooks(), ctx, backward=True)
    g = torch.Generator().manual_seed(72)
    data = [
        (torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (10, 6)
    ]
    for x, a in data:
        F.cross_entropy(policy(x), a).backward()
    got = StatsReporter(ctx).collect()
    policy.remove_hooks()
    samples = [s for x, a in data for s in per_sample_gradients(policy, x, a)]
    prefix = "probes/fisher/actor_mlp/"
    names = list(samples[0])
    for name in names:
        g2, s = two_batch_estimates([sample[name] for sample in samples])
        assert got[f"{prefix}{name}.grad_sq_norm"] == pytest.approx(g2, rel=1e-4, abs=1e-10)
        assert got[f"{prefix}{name}.grad_var_trace"] == pytest.approx(s, rel=1e-5)
        if g2 > 1e-6 * s:
            assert got[f"{prefix}{name}.grad_noise_scale"] == pytest.approx(s / g2, rel=1e-3)
    whole = [torch.cat([sample[n] for n in names]) for sample in samples]
    g2, s = two_batch_estimates(whole)
    assert got[prefix + "grad_sq_norm"] == pytest.approx(g2, rel=1e-4)
    assert got[prefix + "grad_var_trace"] == pytest.approx(s, rel=1e-5)
    assert got[prefix + "grad_noise_scale"] == pytest.approx(s / g2, rel=1e-3)
    assert got[prefix + "grad_noise_scale"] > 0
