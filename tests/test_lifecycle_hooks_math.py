"""Every built-in hook's numbers against an independent computation."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from lifecycle_support import ActorCritic, attach_all_probes, ppo_loss
from torch import nn
from torch.distributions import Categorical

from policy_probes import ComponentContext, StatsReporter, attach_relu_activation_hooks
from policy_probes.lifecycle import HookManager, HookPoint, LoopModelDataContext, select_hooks
from policy_probes.lifecycle.hooks import (
    AdamDynamicsHook,
    CounterfactualHook,
    FeatureRankHook,
    HessianHook,
    NormsHook,
    PolicyFisherHook,
)
from policy_probes.lifecycle.hooks.counterfactual import order_generator

P = HookPoint


def rollout_data(n: int = 16, obs: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "obs": torch.randn(n, obs, generator=g),
        "actions": torch.randint(0, 2, (n,), generator=g),
        "logprobs": torch.log(torch.full((n,), 0.5)) + 0.1 * torch.randn(n, generator=g),
        "advantages": torch.randn(n, generator=g),
        "returns": torch.randn(n, generator=g),
    }


def on(data: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``data`` (drawn on the CPU) moved to ``device``."""
    return {k: v.to(device) for k, v in data.items()}


def randn_like_on_cpu(p: torch.Tensor) -> torch.Tensor:
    """``torch.randn_like(p)`` drawn from the CPU generator, on ``p``'s device."""
    return torch.randn_like(p, device="cpu").to(p.device)


def tiny(activation: str = "tanh", hidden: tuple[int, ...] = (4,)) -> ActorCritic:
    torch.manual_seed(0)
    return ActorCritic(obs=3, hidden=hidden, actions=2, activation=activation)


def context_for(model: nn.Module, data: dict, mb: int = 8, **kw) -> LoopModelDataContext:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return LoopModelDataContext(model, opt, ppo_loss, data=data, minibatch_size=mb, **kw)


# ----------------------------------------------------------------------------- hessian
def dense_hessian(model: nn.Module, data: dict, mb: int) -> torch.Tensor:
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()

    def loss(flat: torch.Tensor) -> torch.Tensor:
        params, offset = {}, 0
        for n, s in zip(names, shapes, strict=True):
            k = math.prod(s)
            params[n] = flat[offset : offset + k].reshape(s).float()
            offset += k
        total = 0.0
        n_all = data["obs"].shape[0]
        for start in range(0, n_all, mb):
            batch = {k: v[start : start + mb] for k, v in data.items()}
            out = torch.func.functional_call(model, params, (batch["obs"],))
            logits, value = out
            dist = Categorical(logits=logits)
            logp = dist.log_prob(batch["actions"])
            adv = batch["advantages"]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            ratio = (logp - batch["logprobs"]).exp()
            pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
            v_loss = 0.5 * (value - batch["returns"]).square().mean()
            total = total + (pg + 0.5 * v_loss - 0.01 * dist.entropy().mean()) * (
                batch["obs"].shape[0] / n_all
            )
        return total.double()

    return torch.autograd.functional.hessian(loss, flat0)


def test_hessian_top_eigenvalue_and_hutchinson_trace_match_the_dense_hessian(
    device: torch.device,
) -> None:
    model = tiny().to(device)
    data = on(rollout_data(), device)
    mctx = context_for(model, data)
    H = dense_hessian(model, data, mb=8)
    H = (H + H.T) / 2
    eig = torch.linalg.eigvalsh(H)
    top = eig[eig.abs().argmax()].item()
    exact_trace = torch.trace(H).item()
    samples = 400
    hook = HessianHook(iters=1000, tol=1e-9, trace_samples=samples, warm_start=False)
    torch.manual_seed(0)
    out = HookManager([hook], loop="ppo").fire(P.SNAPSHOT, epoch=0, model_ctx=mctx)
    assert out["hessian/top_eigenvalue"] == pytest.approx(top, rel=1e-4)
    assert out["hessian/loss"] == pytest.approx(mctx.compute_loss().item(), rel=1e-6)
    # Replay the hook's draws from the same seed (its random start vector, then one
    # Rademacher vector per sample, in parameter order) against the dense Hessian: the
    # estimate and its standard error are then exact, not within a few sigma. The hook
    # draws on the parameters' device (the CUDA generator on CUDA), so the replay does too
    torch.manual_seed(0)
    params = list(model.parameters())
    for p in params:
        torch.randn_like(p)  # the power iteration's start vector
    quad = []
    for _ in range(samples):
        z = torch.cat(
            [(torch.randint(0, 2, p.shape, device=p.device) * 2 - 1).reshape(-1) for p in params]
        )
        quad.append((z.double() @ H @ z.double()).item())
    quad_t = torch.tensor(quad, dtype=torch.float64)
    assert out["hessian/trace"] == pytest.approx(quad_t.mean().item(), rel=1e-4, abs=1e-6)
    se = (quad_t.var(unbiased=True) / samples).sqrt().item()
    assert out["hessian/trace_std_error"] == pytest.approx(se, rel=1e-3)
    # and the estimator is unbiased: Var[z^T H z] = 2 * sum_{i != j} H_ij^2 for Rademacher z
    off = (H.square().sum() - H.diagonal().square().sum()).item()
    assert abs(out["hessian/trace"] - exact_trace) < 4 * math.sqrt(2 * off / samples)
    # the eigenvector is kept for a warm start
    assert [t.shape for t in hook.state["v"]] == [p.shape for p in model.parameters()]


# ------------------------------------------------------------------------ policy fisher
def explicit_fisher(
    model: ActorCritic, obs: torch.Tensor, actions: torch.Tensor
) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    acc = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    for i in range(obs.shape[0]):
        logp = Categorical(logits=model.actor_head(model.actor_mlp(obs[i]))).log_prob(actions[i])
        grads = torch.autograd.grad(logp, list(params.values()), allow_unused=True)
        for (n, _), g in zip(params.items(), grads, strict=True):
            if g is not None:
                acc[n] += g.double().square()
    return {n: a / obs.shape[0] for n, a in acc.items()}


@pytest.mark.parametrize(("method", "probes"), [("vmap", False), ("loop", False), ("auto", True)])
def test_policy_fisher_matches_an_explicit_per_sample_computation(
    method: str, probes: bool, device: torch.device
) -> None:
    model = tiny(activation="relu", hidden=(5, 4)).to(device)
    cc = ComponentContext()
    if probes:  # backward module hooks stop vmap: auto must fall back to the loop
        attach_all_probes(model, cc)
    data = on(rollout_data(n=40), device)
    mctx = context_for(model, data)
    hook = PolicyFisherHook(max_samples=16, method=method)
    torch.manual_seed(3)
    out = HookManager([hook], component_context=cc, loop="ppo").fire(
        P.POST_ROLLOUT, epoch=0, observations=data["obs"], model_ctx=mctx
    )
    assert "policy_fisher/error" not in out
    idx = torch.linspace(0, 39, 16).long().to(device)  # evenly spaced states
    obs = data["obs"][idx]
    torch.manual_seed(3)  # the hook's first draw is the action sample (on obs's device)
    actions = model.get_distribution(obs).sample()
    fisher = explicit_fisher(model, obs, actions)
    comps = {
        "actor_mlp": [n for n in fisher if n.startswith("actor_mlp.")],
        "actor_head": [n for n in fisher if n.startswith("actor_head.")],
        "critic_mlp": [n for n in fisher if n.startswith("critic_mlp.")],
    }
    for comp, names in comps.items():
        flat = torch.cat([fisher[n].reshape(-1) for n in names])
        assert out[f"policy_fisher/{comp}/trace"] == pytest.approx(
            flat.sum().item(), rel=1e-5, abs=1e-12
        )
        assert out[f"policy_fisher/{comp}/max"] == pytest.approx(
            flat.max().item(), rel=1e-5, abs=1e-12
        )
        assert out[f"policy_fisher/{comp}/mean"] == pytest.approx(
            flat.mean().item(), rel=1e-5, abs=1e-12
        )
    assert out["policy_fisher/critic_mlp/trace"] == 0.0  # the value net does not shape pi
    assert out["policy_fisher/actor_head/trace"] > 0
    total = sum(f.sum().item() for f in fisher.values())
    assert out["policy_fisher/trace"] == pytest.approx(total, rel=1e-5)
    assert out["policy_fisher/samples"] == 16.0
    assert cc.model_metrics == {} or all(
        not st for t in cc.model_metrics.values() for st in t.state.values()
    )


# ------------------------------------------------------------------------ feature rank
def numpy_ranks(features: np.ndarray, delta: float = 0.01, eps: float = 0.01) -> dict[str, float]:
    s = np.linalg.svd(features.astype(np.float64), compute_uv=False)
    p = s / s.sum()
    p = p[p > 0]
    cum = np.cumsum(s) / s.sum()
    return {
        "effective_rank": float(np.exp(-(p * np.log(p)).sum())),
        "srank": float(np.argmax(cum >= 1 - delta) + 1),
        "stable_rank": float((s**2).sum() / s.max() ** 2),
        "feature_rank": float((s / np.sqrt(features.shape[0]) > eps).sum()),
    }


@pytest.mark.parametrize("activation", ["relu", "identity"])
def test_feature_rank_matches_numpy_svd_formulas(activation: str, device: torch.device) -> None:
    torch.manual_seed(1)
    model = ActorCritic(
        obs=2 if activation == "identity" else 4, hidden=(12, 10), activation=activation
    )
    obs = torch.randn(300, model.actor_mlp.layer_0.linear.in_features) * 3
    model, obs = model.to(device), obs.to(device)
    out = HookManager([FeatureRankHook(max_samples=1000)], model=model, loop="ppo").fire(
        P.POST_ROLLOUT, epoch=0, observations=obs
    )
    for comp in ("actor_mlp", "critic_mlp"):  # heads are left out by default
        with torch.no_grad():
            feats = getattr(model, comp)(obs).cpu().numpy()
        for key, value in numpy_ranks(feats).items():
            assert out[f"feature_rank/{comp}/{key}"] == pytest.approx(value, rel=1e-6), (comp, key)
    assert not any("head" in k for k in out)
    if activation == "identity":  # affine features of 2-d inputs span at most 3 directions
        assert out["feature_rank/actor_mlp/feature_rank"] <= 3


# ------------------------------------------------------------------------------- norms
def test_norms_match_manual_norms(device: torch.device) -> None:
    model = tiny().to(device)
    hook = NormsHook()
    manager = HookManager([hook], model=model, loop="ppo")
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    manager.fire(P.PRE_EPOCH, epoch=0)
    grads = []
    for step in range(2):
        for p in model.parameters():
            p.grad = randn_like_on_cpu(p)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        manager.fire(P.PRE_STEP, epoch=0, step=step)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * randn_like_on_cpu(p))
    out = manager.fire(P.POST_EPOCH, epoch=0)
    summary = manager.flush().summary
    now = {n: p.detach() for n, p in model.named_parameters()}

    def norm(ts: list[torch.Tensor]) -> float:
        return math.sqrt(sum(t.double().square().sum().item() for t in ts))

    layer = ["actor_mlp.layer_0.linear.weight", "actor_mlp.layer_0.linear.bias"]
    assert summary["norms/grad_norm"] == pytest.approx(
        np.mean([norm(list(g.values())) for g in grads]), rel=1e-6
    )
    assert summary["norms/grad_norm/actor_mlp.layer_0.linear"] == pytest.approx(
        np.mean([norm([g[n] for n in layer]) for g in grads]), rel=1e-6
    )
    assert out["norms/weight_norm"] == pytest.approx(norm(list(now.values())), rel=1e-6)
    assert out["norms/weight_norm/critic_head"] == pytest.approx(
        norm([now["critic_head.weight"], now["critic_head.bias"]]), rel=1e-6
    )
    delta = norm([now[n] - init[n] for n in now])
    assert out["norms/dist_from_init"] == pytest.approx(delta, rel=1e-6)
    assert out["norms/update_ratio"] == pytest.approx(delta / norm(list(init.values())), rel=1e-6)
    with torch.no_grad():
        model.actor_head.weight.mul_(2)
    second = manager.fire(P.POST_EPOCH, epoch=1)
    w_before = now["actor_head.weight"] / 2  # `now` views the live weights, doubled since
    assert second["norms/update_ratio/actor_head"] == pytest.approx(
        norm([w_before]) / norm([w_before, now["actor_head.bias"]]), rel=1e-6
    )
    assert second["norms/update_ratio/critic_head"] == 0.0


# ------------------------------------------------------------------------ adam dynamics
def test_adam_dynamics_match_the_adam_recurrences_and_the_last_update(
    device: torch.device,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(device)
    lr, b1, b2, eps = 0.01, 0.9, 0.99, 1e-8
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(b1, b2), eps=eps)
    params = list(model.parameters())
    m = [np.zeros(p.shape) for p in params]
    v = [np.zeros(p.shape) for p in params]
    before = None
    for _ in range(3):
        before = [p.detach().clone() for p in params]
        for i, p in enumerate(params):
            p.grad = randn_like_on_cpu(p)
            g = p.grad.double().cpu().numpy()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
        opt.step()
    t = 3
    m_hat = np.concatenate([x.ravel() for x in m]) / (1 - b1**t)
    v_hat = np.concatenate([x.ravel() for x in v]) / (1 - b2**t)
    step = lr * m_hat / (np.sqrt(v_hat) + eps)
    theta = np.concatenate([p.detach().double().cpu().numpy().ravel() for p in params])
    out = HookManager([AdamDynamicsHook()], model=model, optimizer=opt, loop="ppo").fire(
        P.POST_EPOCH, epoch=0
    )
    assert out["adam_dynamics/m_abs_mean"] == pytest.approx(np.abs(m_hat).mean(), rel=1e-5)
    assert out["adam_dynamics/v_mean"] == pytest.approx(v_hat.mean(), rel=1e-5)
    assert out["adam_dynamics/step_rms"] == pytest.approx(np.sqrt((step**2).mean()), rel=1e-5)
    assert out["adam_dynamics/step_abs_max"] == pytest.approx(np.abs(step).max(), rel=1e-5)
    assert out["adam_dynamics/update_ratio"] == pytest.approx(
        np.linalg.norm(step) / np.linalg.norm(theta), rel=1e-5
    )
    assert out["adam_dynamics/snr_mean"] == pytest.approx(
        (np.abs(m_hat) / (np.sqrt(v_hat) + eps)).mean(), rel=1e-5
    )
    assert out["adam_dynamics/optimizer_step"] == 3.0
    # the effective step read from the state is the update Adam just applied
    applied = np.concatenate(
        [
            (b - p.detach()).double().cpu().numpy().ravel()
            for b, p in zip(before, params, strict=True)
        ]
    )
    assert out["adam_dynamics/step_abs_mean"] == pytest.approx(np.abs(applied).mean(), rel=1e-4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = HookManager([AdamDynamicsHook()], model=model, optimizer=sgd, loop="ppo").fire(
        P.POST_EPOCH, epoch=0
    )
    assert bad == {"adam_dynamics/error": 1.0}


# ----------------------------------------------------------------------- counterfactual
def test_counterfactual_matches_a_manual_replay_of_the_update_phase(device: torch.device) -> None:
    model = tiny(activation="relu").to(device)
    data = on(rollout_data(n=24), device)
    mctx = context_for(model, data, mb=8, max_grad_norm=0.5, update_epochs=2)
    manager = HookManager([CounterfactualHook(replays=2, seed=5)], model=model, loop="ppo")
    manager.fire(P.PRE_EPOCH, epoch=4, model_ctx=mctx)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(copy.deepcopy(mctx.optimizer.state_dict()))
    pre_state = (copy.deepcopy(twin.state_dict()), copy.deepcopy(twin_opt.state_dict()))
    torch.manual_seed(11)
    for _ in range(2):  # the real update phase
        mctx.run_training_epoch(order=torch.randperm(24))
    real = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    out = manager.fire(P.POST_EPOCH, epoch=4, model_ctx=mctx)

    def flat(m: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).double() for p in m.parameters()])

    def loss_of(m: nn.Module) -> float:
        with torch.no_grad():
            return sum(
                ppo_loss(m, {k: v[i : i + 8] for k, v in data.items()}).item() * 8 / 24
                for i in (0, 8, 16)
            )

    gen = order_generator(5, 4)
    pre = None
    finals, losses = [], []
    for _ in range(2):
        twin.load_state_dict(pre_state[0])
        twin_opt.load_state_dict(copy.deepcopy(pre_state[1]))
        pre = flat(twin)
        for _ in range(2):
            perm = torch.randperm(24, generator=gen)
            for idx in torch.split(perm.to(device), 8):
                twin_opt.zero_grad()
                ppo_loss(twin, {k: v[idx] for k, v in data.items()}).backward()
                nn.utils.clip_grad_norm_(list(twin.parameters()), 0.5)
                twin_opt.step()
        finals.append(flat(twin))
        losses.append(loss_of(twin))
    dists = [torch.linalg.vector_norm(f - real).item() for f in finals]
    update = torch.linalg.vector_norm(real - pre).item()
    assert out["counterfactual/param_distance"] == pytest.approx(np.mean(dists), rel=1e-6)
    assert out["counterfactual/param_distance_max"] == pytest.approx(max(dists), rel=1e-6)
    assert out["counterfactual/update_norm"] == pytest.approx(update, rel=1e-6)
    assert out["counterfactual/relative_distance"] == pytest.approx(
        np.mean(dists) / update, rel=1e-6
    )
    assert out["counterfactual/replay_spread"] == pytest.approx(
        torch.linalg.vector_norm(finals[0] - finals[1]).item(), rel=1e-6
    )
    loss_real = loss_of(model)
    assert out["counterfactual/loss_real"] == pytest.approx(loss_real, rel=1e-5)
    assert out["counterfactual/loss_delta"] == pytest.approx(np.mean(losses) - loss_real, abs=1e-5)
    assert out["counterfactual/param_distance"] > 0
    assert torch.equal(flat(model), real)  # and the real parameters are back


# ------------------------------------------------------- training metrics, stats reporter
def test_training_metrics_and_the_stats_reporter_keep_their_own_keys(
    device: torch.device,
) -> None:
    model = tiny(activation="relu", hidden=(6,)).to(device)
    cc = ComponentContext()
    model.attach("actor_mlp", attach_relu_activation_hooks(), cc)
    obs = torch.randn(50, 3).to(device)
    with torch.no_grad():
        h = model.actor_mlp(obs)
    manager = HookManager(
        select_hooks(["training_metrics"]), model=model, component_context=cc, loop="ppo"
    )
    stats = {"train/policy_loss": 0.25, "rollout/episode_return": 17.0}
    out = manager.fire(P.POST_EPOCH, epoch=0, stats=stats, learning_rate=3e-4)
    assert out["train/policy_loss"] == 0.25 and out["rollout/episode_return"] == 17.0
    assert out["train/learning_rate"] == 3e-4
    assert not any(k.startswith("probes/") for k in out)  # the probes are no hook
    out = StatsReporter(cc).collect()
    active = (h > 0).double().mean(0)
    assert out["probes/relu/actor_mlp/active_rate"] == pytest.approx(active.cpu().tolist())
    assert out["probes/relu/actor_mlp/dead_fraction"] == pytest.approx(
        (active == 0).double().mean().item()
    )
    again = StatsReporter(cc).collect()  # trackers were reset by the first collect
    assert not any(k.startswith("probes/") for k in again)
