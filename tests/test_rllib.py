"""RLlib (new API stack) integration, for real: PPO on CartPole with ``num_learners=0`` and
``num_learners=2`` (two Ray actors, gloo), records checked against plain torch hooks on the
same minibatches with RLlib's loss mask applied, and a restore in a new process.

Runs in the RLlib venv (``make test`` builds ``.venv-rllib``); the main venv has no ray and
leaves this file out (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray
import torch
from ray import cloudpickle
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

from policy_probes import ProbeSettings, attach_relu_activation_hooks
from policy_probes.integrations.rllib import probe_config
from policy_probes.records import read_jsonl
from policy_probes.run import Run
from policy_probes.session import ProbeSession
from policy_probes.sinks import SinksConfig, WandbConfig

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the reference hooks, to actors
pytestmark = pytest.mark.timeout(900)  # Ray's start on a loaded 2-core machine

ACTOR = "encoder.actor_encoder.net.mlp"  # RLLIB_COMPONENTS["actor_mlp"], spelled out
CRITIC = "encoder.critic_encoder.net.mlp"  # RLLIB_COMPONENTS["critic_mlp"]
ITERATIONS = 2


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def make_config(
    run_dir: Path, num_learners: int, remedies: tuple[str, ...] = (), wandb: str = "disabled"
) -> PPOConfig:
    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=0)
        .learners(num_learners=num_learners)
        .training(train_batch_size_per_learner=64, minibatch_size=32, num_epochs=2)
        .rl_module(
            model_config=DefaultModelConfig(
                fcnet_hiddens=[16, 16], fcnet_activation="relu", vf_share_layers=False
            )
        )
        .debugging(seed=3)
    )
    probing = ProbeSettings(
        probe_budget=None,  # every pass: the reference sees every minibatch too
        sinks=SinksConfig(console=False),
        wandb=WandbConfig(mode=wandb),
    )
    return probe_config(
        config,
        run_dir=run_dir,
        probes=["relu@actor_mlp", "relu@critic_mlp", "fisher@actor_mlp"],
        remedies=remedies,
        probing=probing,
    )


# -- the reference: plain torch hooks in every learner, independent of policy_probes --------


def install_reference(learner) -> None:
    """Record, for every minibatch update, the loss mask, the last ReLU's output of the
    actor and critic MLPs and each Linear's input and output gradient of the actor MLP."""
    module = learner.module["default_policy"]
    module = module.unwrapped() if hasattr(module, "unwrapped") else module
    mlp = module.get_submodule(ACTOR)
    learner._ref_passes, learner._ref_now = [], None
    update = learner._update

    def recording_update(batch, **kwargs):
        mask = batch["default_policy"][Columns.LOSS_MASK].detach().to(torch.float64)
        learner._ref_now = {"mask": mask, "actor": [], "critic": [], "linear": {}}
        try:
            return update(batch, **kwargs)
        finally:
            learner._ref_passes.append(learner._ref_now)
            learner._ref_now = None

    def on_relu(which):
        def hook(mod, inputs, output):
            if learner._ref_now is not None:
                learner._ref_now[which].append(output.detach().to(torch.float64))

        return hook

    def on_linear(name):
        def hook(mod, inputs, output):
            now = learner._ref_now
            if now is None or not output.requires_grad:
                return
            entry = now["linear"].setdefault(name, [])
            x = inputs[0].detach().to(torch.float64)

            def on_grad(grad):
                entry.append((x, grad.detach().to(torch.float64)))

            output.register_hook(on_grad)

        return hook

    for which, path in (("actor", ACTOR), ("critic", CRITIC)):
        last_relu = [m for m in module.get_submodule(path) if isinstance(m, torch.nn.ReLU)][-1]
        last_relu.register_forward_hook(on_relu(which))
    for name, layer in mlp.named_children():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_hook(on_linear(name))
    learner._update = recording_update

    # the reference states: the first train batch's observations the loss keeps (fewer
    # than 512 rows here, so all of them), scored with the weights the update ends with
    make_batch, after_update = learner._make_batch_if_necessary, learner.after_gradient_based_update
    learner._ref_set, learner._ref_alive = None, {}

    def recording_batch(training_data):
        batch = make_batch(training_data)
        if learner._ref_set is None:
            rows = batch.policy_batches["default_policy"]
            learner._ref_set = rows[Columns.OBS][rows[Columns.LOSS_MASK].to(torch.bool)].clone()
        return batch

    def scoring_after_update(**kwargs):
        with torch.no_grad():
            for which, path in (("actor", ACTOR), ("critic", CRITIC)):
                h, layers = learner._ref_set, list(module.get_submodule(path))
                last = max(i for i, m in enumerate(layers) if isinstance(m, torch.nn.ReLU))
                for layer in layers[: last + 1]:
                    h = layer(h)
                learner._ref_alive[which] = (h > 0).any(dim=0)
        return after_update(**kwargs)

    learner._make_batch_if_necessary = recording_batch
    learner.after_gradient_based_update = scoring_after_update


def take_reference(learner):
    passes, learner._ref_passes = learner._ref_passes, []
    assert learner._ref_set is not None and learner._ref_set.shape[0] <= 512
    return {"passes": passes, "alive": dict(learner._ref_alive)}


def reference_set_values(alive: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Dead fractions on the reference states: units with no positive output on any
    learner's set (the union of the learners' sets)."""
    out = {}
    for which in ("actor", "critic"):
        union = torch.stack([a[which] for a in alive]).any(dim=0)
        out[f"probes/relu/{which}_mlp/dead_fraction_ref"] = float((~union).sum()) / union.numel()
    return out


def reference_values(passes: list[dict]) -> dict[str, float]:
    """Dead fractions and samples of the actor and critic MLPs' outputs and the actor's
    Fisher trace over the kept rows of every pass (docs/probes/relu.md,
    docs/probes/fisher.md: a masked mean loss, so f = the kept rows of the pass)."""
    out: dict[str, float] = {}
    for which in ("actor", "critic"):
        active, samples = None, 0
        for p in passes:
            keep = p["mask"] > 0
            for h in p[which]:
                hit = (h[keep] > 0).any(dim=0)
                active = hit if active is None else active | hit
                samples += int(keep.sum())
        out[f"probes/relu/{which}_mlp/dead_fraction"] = float((~active).sum()) / active.numel()
        out[f"probes/relu/{which}_mlp/samples"] = samples
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}
    for p in passes:
        keep = p["mask"] > 0
        f = keep.sum().to(torch.float64)  # a masked mean loss: n = the kept rows
        for name, pairs in p["linear"].items():
            for x, g in pairs:
                g2 = ((f * g[keep]) ** 2).sum(dim=1)
                x2 = (x[keep] ** 2).sum(dim=1)
                sums[name] = sums.get(name, 0.0) + (g2 * (x2 + 1.0)).sum()  # W and b
                counts[name] = counts.get(name, 0.0) + keep.sum()
    out["probes/fisher/actor_mlp/trace"] = sum(float(sums[n] / counts[n]) for n in sums)
    return out


def inner_weights(learner) -> dict[str, torch.Tensor]:
    module = learner.module["default_policy"]
    module = module.unwrapped() if hasattr(module, "unwrapped") else module
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def train_and_compare(
    run_dir: Path, num_learners: int, remedies: tuple[str, ...] = (), wandb: str = "disabled"
) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    """Train ITERATIONS iterations; check every record against the reference; return the
    records and every learner's weights at the end."""
    algo = make_config(run_dir, num_learners, remedies, wandb).build_algo()
    try:
        algo.learner_group.foreach_learner(install_reference)
        expected = []
        for _ in range(ITERATIONS):
            result = algo.train()
            taken = [r.get() for r in algo.learner_group.foreach_learner(take_reference)]
            passes = [p for t in taken for p in t["passes"]]
            assert any((p["mask"] == 0).any() for p in passes)  # phantom rows to leave out
            expected.append(
                {**reference_values(passes), **reference_set_values([t["alive"] for t in taken])}
            )
            learner_result = result["learners"]["default_policy"]
            assert "probes/relu/actor_mlp/dead_fraction" in learner_result
            assert "probes/fisher/actor_mlp/trace" in learner_result
        weights = [r.get() for r in algo.learner_group.foreach_learner(inner_weights)]
    finally:
        algo.stop()
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    assert [r["epoch"] for r in records] == list(range(1, ITERATIONS + 1))
    for record, values in zip(records, expected, strict=True):
        for key, value in values.items():
            if key.endswith("/trace"):
                assert record[key] == pytest.approx(value, rel=1e-6), key
            else:  # fractions and counts: exact
                assert record[key] == value, key
        assert len(record["probes/relu/actor_mlp/active_rate"]) == 16  # per-unit vectors
        assert not [k for k in record if k.startswith("probes/errors")]
    return records, weights


def test_one_local_learner_records_match_plain_hooks_on_the_masked_minibatches(
    ray_cluster, tmp_path
):
    from wandb_reader import history_rows, run_file, wandb_records

    run_dir = tmp_path / "run"
    records, _ = train_and_compare(run_dir, num_learners=0, wandb="offline")
    assert [r["agent_step"] for r in records] == [64, 128]
    assert json.loads((run_dir / "config.json").read_text())["rllib"]
    csv_rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + ITERATIONS  # a header and one row per iteration
    key = "probes/fisher/actor_mlp/trace"  # the driver's W&B run holds the same records
    rows = [r for r in history_rows(wandb_records(run_file(run_dir))) if key in r]
    assert [r[key] for r in rows] == [r[key] for r in records]


def test_two_learners_records_are_the_union_of_both_learners_data_and_remedies_stay_in_sync(
    ray_cluster, tmp_path
):
    remedies = (
        "redo@actor_mlp:tau=0.1,every_epochs=1,consumer=actor_head",
        "shrink_and_perturb@critic_mlp:every_epochs=1",
    )
    records, weights = train_and_compare(tmp_path / "run", num_learners=2, remedies=remedies)
    assert [r["agent_step"] for r in records] == [128, 256]
    for record in records:  # both remedies fired at every epoch end, on both learners
        assert record["remedies/redo/actor_mlp/fired"] == 1
        assert record["remedies/shrink_and_perturb/critic_mlp/fired"] == 1
    assert records[0]["remedies/redo/actor_mlp/units_reset"] > 0
    first, second = weights
    assert first.keys() == second.keys()
    for name in first:  # the same seeded draws on the same weights: identical learners
        assert torch.equal(first[name], second[name]), name


RESTORE = textwrap.dedent(
    """
    import json, sys
    import ray
    sys.path.insert(0, {tests!r})
    from test_rllib import make_config
    from pathlib import Path
    ray.init(address={address!r}, log_to_driver=False)
    algo = make_config(Path({run_dir!r}), 0).build_algo()
    algo.restore_from_path({checkpoint!r})
    for _ in range(2):
        algo.train()
    algo.stop()
    """
)


def test_restore_in_a_new_process_continues_the_run_directory(ray_cluster, tmp_path):
    run_dir, checkpoint = tmp_path / "run", tmp_path / "checkpoint"
    algo = make_config(run_dir, 0).build_algo()
    try:
        algo.train()
        algo.train()
        algo.save_to_path(checkpoint)
        algo.train()  # after the checkpoint: dropped when a restored run goes on
        algo.restore_from_path(checkpoint)  # in this process: epoch 3 again
        algo.train()
    finally:
        algo.stop()
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    assert [(r["epoch"], r["agent_step"]) for r in records] == [(1, 64), (2, 128), (3, 192)]
    script = RESTORE.format(
        tests=str(Path(__file__).parent),
        address=ray_cluster,
        run_dir=str(run_dir),
        checkpoint=str(checkpoint),
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=600)
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"]
    assert [r["epoch"] for r in records] == [1, 2, 3, 4]
    assert [r["agent_step"] for r in records] == [64, 128, 192, 256]
    assert all("probes/fisher/actor_mlp/trace" in r for r in records)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


def test_a_worker_session_never_touches_the_filesystem(tmp_path, monkeypatch):
    """A learner's session next to a run the driver continues: no RunDirConflict, no lock,
    no file read back or written, in the run directory or the working directory."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}\n")
    (run_dir / "metrics.jsonl").write_text('{"epoch": 1, "agent_step": 8}\n')
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = ProbeSession(
        model,
        run=Run.worker(run_dir),
        probing=ProbeSettings(probe_budget=None),
        optimizer=optimizer,
    )
    with session:
        session.add_training_hook("0", attach_relu_activation_hooks())
        h = model(torch.randn(5, 3))
        expected = float(((h > 0).sum(dim=0) == 0).float().mean())
        h.sum().backward()
        optimizer.step()
        metrics = session.epoch_end(step=5)
        state = session.state_dict()
    assert metrics["probes/relu/0/samples"] == 5
    assert metrics["probes/relu/0/dead_fraction"] == expected
    assert state["epoch"] == 1  # counts from 0: a worker does not read the driver's records
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("algo", ["APPO", "IMPALA"])
def test_asynchronous_learners_are_refused_with_a_message(algo, tmp_path):
    from ray.rllib.algorithms.appo import APPOConfig
    from ray.rllib.algorithms.impala import IMPALAConfig

    config = {"APPO": APPOConfig, "IMPALA": IMPALAConfig}[algo]().environment("CartPole-v1")
    with pytest.raises(ValueError, match=f"{algo} updates its Learners asynchronously"):
        probe_config(config, run_dir=tmp_path / "run", probes=["relu@actor_mlp"])
    assert not (tmp_path / "run").exists()
