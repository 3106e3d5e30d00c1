"""The TorchRL PPO loop of docs/external.md (ClipPPOLoss, GAE, ProbabilisticActor,
ValueOperator, GymEnv CartPole) with a ProbeSession: every epoch record is checked against
the same minibatches' activations and gradients captured with plain torch hooks."""

from __future__ import annotations

import pytest
import torch
import torchrl  # noqa: F401  (the torchrl extra: the suite runs this test for real)
from conftest import hook_counts
from test_session import Capture, check_fisher_unit, check_tanh_saturation, load_doc_example
from torch import nn

from policy_probes import ProbeSettings, Run
from policy_probes.records import read_jsonl

HEADER = "# torchrl_ppo_with_probes.py"
DEAD = (0, 1, 2)  # units of actor_mlp.0 killed before training
BETA = 0.95  # attach_gradient_flow_hooks' default


def per_sample(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-sample gradients of a loss that is a minibatch mean (ClipPPOLoss's three terms
    are): n * g_i."""
    return [g.double() * g.shape[0] for g in grads]


def test_torchrl_ppo_loop_records_match_independent_computation(tmp_path) -> None:
    ns = load_doc_example(HEADER, "docs_torchrl_example")
    args = ns["Args"](
        total_frames=384,
        frames_per_batch=128,
        update_epochs=2,
        minibatch_size=64,
        hidden=16,
        run_dir=str(tmp_path),
        wandb_mode="disabled",
    )
    env = ns["GymEnv"](args.env_id)
    torch.manual_seed(0)
    actor, critic = ns["make_agent"](env, args.hidden)
    mlp = actor.module[0].module  # the nn.Sequential inside the actor's TensorDictModule
    assert actor.module[0].inplace is True  # TensorDictModule's default, accepted
    with torch.no_grad():
        for u in DEAD:
            mlp[0].weight[u].zero_()
            mlp[0].bias[u] = -50.0
    own_hooks = hook_counts(actor) + hook_counts(critic)
    cap = Capture(
        {"actor_mlp.1": mlp[1], "actor_mlp.3": mlp[3], "critic_mlp.1": critic.module[1]},
        {
            "actor_mlp": mlp,
            "actor_mlp.0": mlp[0],
            "actor_mlp.2": mlp[2],
            "actor_mlp.4": mlp[4],
        },
    )

    returned = ns["train"](args, env, (actor, critic))

    cap.remove()
    assert hook_counts(actor) + hook_counts(critic) == own_hooks  # session hooks removed
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    epochs = args.total_frames // args.frames_per_batch
    assert [r["epoch"] for r in records] == list(range(1, epochs + 1))
    assert [r["agent_step"] for r in records] == [args.frames_per_batch * (e + 1) for e in range(3)]
    assert len(returned) == epochs
    calls = args.update_epochs * (args.frames_per_batch // args.minibatch_size)
    assert len(cap.out["actor_mlp.1"]) == len(cap.grad["actor_mlp"]) == epochs * calls

    for e, rec in enumerate(records):
        window = slice(e * calls, (e + 1) * calls)
        samples = args.update_epochs * args.frames_per_batch
        for name in ("actor_mlp.1", "actor_mlp.3"):
            h = torch.cat(cap.out[name][window]).double()
            active = (h > 0).double().mean(0)
            assert rec[f"probes/relu/{name}/samples"] == samples == h.shape[0]
            assert rec[f"probes/relu/{name}/active_rate"] == pytest.approx(active.tolist())
            assert rec[f"probes/relu/{name}/dead_fraction"] == pytest.approx(
                float((active == 0).double().mean())
            )
            assert rec[f"probes/relu/{name}/zero_fraction"] == pytest.approx(
                float((h <= 0).double().mean())
            )
        assert rec["probes/relu/actor_mlp.1/dead_fraction"] >= len(DEAD) / args.hidden
        # ReLU gradient flow per ReLU layer: gradient passes where the unit was active
        # and received a non-zero gradient; the killed units never pass any
        for name in ("actor_mlp.1", "actor_mlp.3"):
            grads = cap.grad[name][window]
            passed = [
                ((g != 0) & (h > 0)).double()
                for h, g in zip(cap.out[name][window], grads, strict=True)
            ]
            rate = torch.cat(passed).mean(0)
            key = f"probes/relu_gradient_flow/{name}/"
            assert rec[key + "pass_rate"] == pytest.approx(rate.tolist())
            assert rec[key + "blocked_fraction"] == pytest.approx(
                float((rate == 0).double().mean())
            )
        assert all(rec["probes/relu_gradient_flow/actor_mlp.1/pass_rate"][u] == 0 for u in DEAD)

        check_tanh_saturation(rec, "critic_mlp.1", torch.cat(cap.out["critic_mlp.1"][window]))

        # Fisher of the actor MLP: per output unit (logits) and per parameter, from the
        # per-sample gradients n g_i: weight g_i x_i^T, bias g_i
        logits_grads = cap.grad["actor_mlp"][window]
        check_fisher_unit(rec, "actor_mlp", torch.cat(per_sample(logits_grads)).square().mean(0))
        trace = 0.0
        for layer in ("0", "2", "4"):
            g = torch.cat(per_sample(cap.grad[f"actor_mlp.{layer}"][window]))
            x = torch.cat(cap.inp[f"actor_mlp.{layer}"][window]).double()
            weight = float(torch.einsum("iu,iv->uv", g.square(), x.square()).sum()) / len(g)
            bias = float(g.square().sum()) / len(g)
            assert rec[f"probes/fisher/actor_mlp/{layer}.weight.trace"] == pytest.approx(
                weight, rel=1e-5
            )
            assert rec[f"probes/fisher/actor_mlp/{layer}.bias.trace"] == pytest.approx(
                bias, rel=1e-5
            )
            trace += weight + bias
        assert rec["probes/fisher/actor_mlp/trace"] == pytest.approx(trace, rel=1e-5)

        # gradient flow of "logits" read through the TensorDictModule with extractor="logits":
        # bias-corrected EMA over the window's passes of the per-unit RMS gradient
        ema = torch.zeros(logits_grads[0].shape[-1], dtype=torch.float64)
        for g in logits_grads:
            ema = BETA * ema + (1 - BETA) * g.double().square().mean(0).sqrt()
        ema /= 1 - BETA ** len(logits_grads)
        assert rec["probes/gradient_flow/policy/passes"] == len(logits_grads)
        torch.testing.assert_close(
            torch.tensor(rec["probes/gradient_flow/policy/rms"], dtype=torch.float64),
            ema,
            rtol=1e-5,
            atol=1e-12,
        )
        assert not any(k.startswith("probes/errors/") for k in rec)
        for key in ("train/loss_objective", "train/loss_critic", "norms/grad_norm"):
            assert isinstance(rec[key], float)


def test_tanh_normal_actor_is_probed_through_its_tensordict_keys(tmp_path) -> None:
    """A continuous ProbabilisticActor (TanhNormal over NormalParamExtractor's loc and
    scale) on Pendulum: the Fisher probe sits on the TensorDictModule and reads "loc"."""
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torchrl.envs import GymEnv
    from torchrl.envs.utils import ExplorationType, set_exploration_type
    from torchrl.modules import ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    from policy_probes import (
        ProbeError,
        attach_fisher_information_hooks,
        attach_relu_activation_hooks,
    )
    from policy_probes.session import ProbeSession
    from policy_probes.sinks import SinksConfig, WandbConfig

    torch.manual_seed(0)
    env = GymEnv("Pendulum-v1")
    env.set_seed(0)
    net = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2), NormalParamExtractor())
    box = env.action_spec.space
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=TanhNormal,
        distribution_kwargs={"low": box.low, "high": box.high},
        spec=env.action_spec,
        return_log_prob=True,
    )
    critic = ValueOperator(
        nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)), in_keys=["observation"]
    )
    loss_module = ClipPPOLoss(actor, critic)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=1e-3)
    with torch.no_grad(), set_exploration_type(ExplorationType.RANDOM):
        data = env.rollout(96, actor, break_when_any_done=False)
        GAE(gamma=0.99, lmbda=0.95, value_network=critic)(data)

    cap = Capture({"actor_mlp.1": net[1]}, {"actor_mlp.0": net[0], "actor_mlp.2": net[2]})
    cap.grad["loc"] = []

    def loc_grad(_m, _i, out):
        if torch.is_grad_enabled():
            out[0].register_hook(lambda g: cap.grad["loc"].append(g.detach().clone()))

    cap.handles.append(net[3].register_forward_hook(loc_grad))
    with ProbeSession(
        actor,
        components={"policy": "module.0", "actor_mlp": "module.0.module"},
        example_inputs=(data[:2].clone(),),
        run=Run(tmp_path),
        probing=ProbeSettings(
            sinks=SinksConfig(console=False, wandb=False), wandb=WandbConfig(mode="disabled")
        ),
    ) as session:
        with pytest.raises(ProbeError, match=r"TensorDict with keys .*Pass extractor=\"loc\""):
            session.add_training_backward_hook("policy", attach_fisher_information_hooks())
        # a TensorDict policy cannot run on reference states: no _ref keys asked for
        session.add_training_hook("actor_mlp.1", attach_relu_activation_hooks(reference=False))
        fisher = attach_fisher_information_hooks()
        session.add_training_backward_hook("policy", fisher, extractor="loc")
        for idx in torch.randperm(96).split(32):
            out = loss_module(data[idx])
            loss = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        rec = session.epoch_end(step=96)
    cap.remove()

    assert not any(k.startswith("probes/errors/") for k in rec)
    h = torch.cat(cap.out["actor_mlp.1"]).double()
    assert rec["probes/relu/actor_mlp.1/samples"] == 96 == h.shape[0]
    assert rec["probes/relu/actor_mlp.1/active_rate"] == pytest.approx(
        (h > 0).double().mean(0).tolist()
    )
    assert len(cap.grad["loc"]) == 3
    check_fisher_unit(rec, "policy", torch.cat(per_sample(cap.grad["loc"])).square().mean(0))
    trace = 0.0
    for layer in ("0", "2"):
        g = torch.cat(per_sample(cap.grad[f"actor_mlp.{layer}"]))
        x = torch.cat(cap.inp[f"actor_mlp.{layer}"]).double()
        trace += float(torch.einsum("iu,iv->uv", g.square(), x.square()).sum() + g.square().sum())
    assert rec["probes/fisher/policy/trace"] == pytest.approx(trace / 96, rel=1e-5)
