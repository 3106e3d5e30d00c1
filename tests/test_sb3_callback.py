"""ProbeCallback on real Stable-Baselines3 PPO and A2C (CartPole-v1, a few updates): one
record per rollout/update cycle, every metric checked against plain torch hooks
registered by the test, the rollout left out, and the trajectory unchanged."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from conftest import hook_counts, sb3_cartpole
from stable_baselines3 import A2C, PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import configure
from test_session import (
    Capture,
    check_fisher_unit,
    check_relu,
    check_tanh_saturation,
    fisher_reference,
)
from torch import nn
from wandb_reader import history_rows, run_file, wandb_records

from policy_probes import (
    ProbeError,
    attach_fisher_information_hooks,
    attach_relu_activation_hooks,
    attach_saturated_activation_hooks,
)
from policy_probes.integrations.sb3 import ProbeCallback, sb3_components
from policy_probes.probe_settings import ProbeSettings
from policy_probes.records import read_jsonl
from policy_probes.sinks import SinksConfig, WandbConfig

N_ENVS, N_STEPS, BATCH, N_EPOCHS, CYCLES = 2, 64, 64, 2, 3
ROWS = N_ENVS * N_STEPS


def ppo(activation: type[nn.Module] = nn.ReLU, seed: int = 0) -> PPO:
    return sb3_cartpole(
        n_steps=N_STEPS,
        batch_size=BATCH,
        n_epochs=N_EPOCHS,
        hidden=(16, 16),
        n_envs=N_ENVS,
        seed=seed,
        activation_fn=activation,
    )


def policy_capture(policy: nn.Module, mlp: str) -> Capture:
    net = policy.get_submodule(f"mlp_extractor.{mlp}")
    return Capture(
        {"mlp": net, "act0": net[1]},
        {"lin0": net[0], "lin2": net[2]},
    )


def test_ppo_relu_and_fisher_once_per_cycle_match_plain_torch_and_wandb(tmp_path):
    model = ppo()
    model.set_logger(configure(str(tmp_path / "sb3"), ["csv"]))
    cap = policy_capture(model.policy, "policy_net")
    own_hooks = hook_counts(model.policy)
    callback = ProbeCallback(
        probes=[("actor_mlp", attach_relu_activation_hooks())],
        backward_probes=[("actor_mlp", attach_fisher_information_hooks())],
        run_dir=tmp_path / "run",
        probing=ProbeSettings(
            sinks=SinksConfig(console=False),
            wandb=WandbConfig(mode="offline", project="pp-sb3"),
            probe_budget=None,
        ),
    )
    callback.add_training_hook("actor_mlp.1", attach_relu_activation_hooks())
    model.learn(CYCLES * ROWS, callback=callback)
    assert hook_counts(model.policy) == own_hooks  # the callback's hooks are gone
    cap.remove()
    assert callback.session.closed
    records = [
        r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"
    ]
    assert [(r["epoch"], r["agent_step"]) for r in records] == [
        (c + 1, ROWS * (c + 1)) for c in range(CYCLES)
    ]
    calls = N_EPOCHS * ROWS // BATCH  # training forwards per cycle
    assert len(cap.out["mlp"]) == CYCLES * calls  # train() forwards only (rollout: no_grad)
    for c, rec in enumerate(records):
        window = slice(c * calls, (c + 1) * calls)
        for name, key in (("actor_mlp", "mlp"), ("actor_mlp.1", "act0")):
            check_relu(rec, name, torch.cat(cap.out[key][window]))
            # only the training minibatches: n_epochs passes over the rollout
            assert rec[f"probes/relu/{name}/samples"] == N_EPOCHS * ROWS
        layers = [(cap.inp[n][window], cap.grad[n][window]) for n in ("lin0", "lin2")]
        ref = fisher_reference(cap.grad["mlp"][window], layers)
        check_fisher_unit(rec, "actor_mlp", ref["unit"])
        assert rec["probes/fisher/actor_mlp/trace"] == pytest.approx(ref["trace"], rel=1e-5)
        assert rec["probes/fisher/actor_mlp/samples"] == N_EPOCHS * ROWS
    assert callback.history == [
        {k: v for k, v in r.items() if k not in ("epoch", "agent_step", "hook_point", "time")}
        for r in records
    ]

    # SB3's own train/* values: the callback reports them with the cycle they belong to;
    # SB3's CSV logger writes them one dump later (and never for the last update)
    with open(tmp_path / "sb3" / "progress.csv") as f:
        dumped = [row for row in csv.DictReader(f) if row.get("train/value_loss")]
    assert len(dumped) == CYCLES - 1
    for rec, row in zip(records, dumped, strict=False):
        for key in ("train/value_loss", "train/approx_kl", "train/n_updates"):
            assert rec[key] == pytest.approx(float(row[key]), rel=1e-6), key
    assert records[-1]["train/n_updates"] == CYCLES * N_EPOCHS

    # the offline W&B run holds the same series
    rows = [
        r
        for r in history_rows(wandb_records(run_file(tmp_path / "run")))
        if "probes/fisher/actor_mlp/trace" in r
    ]
    assert [r["epoch"] for r in rows] == list(range(1, CYCLES + 1))
    for rec, row in zip(records, rows, strict=True):
        assert row["agent_step"] == rec["agent_step"]
        for key in ("probes/relu/actor_mlp/dead_fraction", "probes/fisher/actor_mlp/trace"):
            assert row[key] == rec[key]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["sb3"]["algo"] == "PPO" and config["sb3"]["n_steps"] == N_STEPS


def test_a2c_tanh_saturation_and_fisher_per_cycle(tmp_path):
    model = A2C(
        "MlpPolicy",
        make_vec_env("CartPole-v1", n_envs=N_ENVS, seed=1),
        n_steps=16,
        policy_kwargs=dict(net_arch=dict(pi=[16, 16], vf=[16, 16])),  # tanh by default
        device="cpu",
        seed=1,
    )
    with torch.no_grad():  # push two units of the critic's first layer into saturation
        model.policy.mlp_extractor.value_net[0].bias[:2] = 20.0
    cap = policy_capture(model.policy, "value_net")
    with ProbeCallback(
        probes=[("critic_mlp.[13]", attach_saturated_activation_hooks("tanh"))],
        backward_probes=[("critic_mlp", attach_fisher_information_hooks())],
        run_dir=tmp_path,
        probing=ProbeSettings(sinks=SinksConfig(console=False, wandb=False), probe_budget=None),
    ) as callback:
        model.learn(3 * 16 * N_ENVS, callback=callback)
    cap.remove()
    assert len(callback.history) == 3
    rows = 16 * N_ENVS  # A2C: one pass over the whole rollout
    for c, rec in enumerate(callback.history):
        check_tanh_saturation(rec, "critic_mlp.1", cap.out["act0"][c])
        assert rec["probes/saturation_tanh/critic_mlp.1/samples"] == rows
        assert rec["probes/saturation_tanh/critic_mlp.1/saturated_units_fraction"] >= 2 / 16
        layers = [(cap.inp[n][c : c + 1], cap.grad[n][c : c + 1]) for n in ("lin0", "lin2")]
        ref = fisher_reference(cap.grad["mlp"][c : c + 1], layers)
        assert rec["probes/fisher/critic_mlp/trace"] == pytest.approx(ref["trace"], rel=1e-5)
        assert "train/value_loss" in rec and "train/policy_loss" in rec


def test_callback_leaves_the_sb3_trajectory_bit_identical(tmp_path):
    plain = ppo(seed=4)
    plain.learn(2 * ROWS)
    probed = ppo(seed=4)
    callback = ProbeCallback(
        probes=[("actor_mlp", attach_relu_activation_hooks())],
        backward_probes=[("critic_mlp", attach_fisher_information_hooks())],
        run_dir=tmp_path,
        probing=ProbeSettings(
            sinks=SinksConfig(console=False, wandb=False), hooks=["norms", "adam_dynamics"]
        ),
    )
    probed.learn(2 * ROWS, callback=callback)
    a, b = plain.policy.state_dict(), probed.policy.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert callback.history[-1]["adam_dynamics/optimizer_step"] == 2 * N_EPOCHS * ROWS // BATCH
    assert callback.history[-1]["norms/dist_from_init"] > 0


def test_component_names_and_builder_errors():
    names = sb3_components(ppo().policy)
    assert names["actor_mlp"] == "mlp_extractor.policy_net"
    assert names["critic_head"] == "value_net" and names["value_net"] == "value_net"
    with pytest.raises(TypeError, match="parentheses"):
        ProbeCallback(probes=[("actor_mlp", attach_relu_activation_hooks)])


def test_the_probe_settings_are_one_argument_and_no_other_keyword_is_taken():
    settings = ProbeSettings(probe_budget=None, hooks=["norms"], snapshot_every=3)
    assert ProbeCallback(probing=settings).probing is settings
    for wrong in ("budget", "probe_budget", "hooks"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{wrong}'"):
            ProbeCallback(**{wrong: None})


@pytest.mark.parametrize(
    ("kind", "component", "make", "error", "match"),
    [
        ("probes", "actor_mpl", attach_relu_activation_hooks, KeyError, "Closest: actor_mlp"),
        # a tuple output (the extractor's (pi, vf) pair) without an extractor
        (
            "backward_probes",
            "mlp_extractor",
            attach_fisher_information_hooks,
            ProbeError,
            "extractor",
        ),
    ],
)
def test_attach_errors_stop_learn_and_leave_no_hooks(tmp_path, kind, component, make, error, match):
    model = ppo()
    callback = ProbeCallback(
        **{kind: [(component, make())]},
        run_dir=tmp_path,
        probing=ProbeSettings(sinks=SinksConfig(console=False, wandb=False)),
    )
    with pytest.raises(error, match=match):
        model.learn(ROWS, callback=callback)
    assert hook_counts(model.policy) == 0


def test_second_learn_continues_the_cycle_count_in_the_same_run_dir(tmp_path):
    model = ppo()
    callback = ProbeCallback(
        probes=[("actor_mlp", attach_relu_activation_hooks())],
        run_dir=tmp_path,
        probing=ProbeSettings(sinks=SinksConfig(console=False, wandb=False), probe_budget=None),
    )
    model.learn(ROWS, callback=callback)
    assert hook_counts(model.policy) == 0
    model.learn(2 * ROWS, callback=callback, reset_num_timesteps=False)
    assert hook_counts(model.policy) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["epoch"], r["agent_step"]) for r in records] == [
        (1, ROWS),
        (2, 2 * ROWS),
        (3, 3 * ROWS),
    ]
    assert all(r["probes/relu/actor_mlp/samples"] == N_EPOCHS * ROWS for r in records)


def test_the_default_reports_every_cycle_from_the_passes_it_observed(tmp_path):
    """Under the default budget every cycle observes pass 0 of its update phase (4 passes
    per cycle here, stride 16) and reports it: every record carries the probe's metrics,
    and the rows each reports are the rows a plain torch hook saw while the probe's
    hooks were armed in that cycle."""
    model = ppo()
    seen: list[int] = []
    callback = ProbeCallback(
        probes=[("actor_mlp", attach_relu_activation_hooks(), {"per_layer": False})],
        run_dir=tmp_path,
        probing=ProbeSettings(sinks=SinksConfig(console=False, wandb=False)),
    )

    def count(_module, _inputs, output):
        session = callback.session  # None while the callback traces the policy
        handles = session.policy.hook_handles if session is not None else []
        if any(h.armed and h.hook.probe == "relu" for h in handles) and torch.is_grad_enabled():
            seen.append(output.shape[0])

    model.policy.mlp_extractor.policy_net.register_forward_hook(count)
    cycles = 6
    model.learn(cycles * ROWS, callback=callback)
    assert len(callback.history) == cycles
    assert seen == [BATCH] * cycles  # one observed pass per cycle
    for record in callback.history:
        assert record["probes/relu/actor_mlp/passes_observed"] == 1
        assert record["probes/relu/actor_mlp/rows_observed"] == BATCH
        assert record["probes/relu/actor_mlp/samples"] == BATCH
        assert "probes/relu/actor_mlp/dead_fraction" in record
