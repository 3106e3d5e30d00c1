"""Timed cases for the A/B benchmarks (docs/benchmarks.md, "Method"); each prints one JSON
line.

    python -m benchmarks.cases ours '{"total_timesteps": 20480, "probes": true}'

* ``ours``: the built-in PPO trainer through :class:`trainers.TrainTool` (:func:`train_tool`),
  optionally with W&B's ``wandb.watch(log="all", log_freq=1)``;
* ``bare``: :class:`trainers.PPOTrainer` driven directly with the session it makes itself: no
  TrainTool, no sinks, no run directory (the empty-path benchmark's reference);
* ``recipe``: ``recipes.cartpole`` as it ships (:func:`recipe`);
* ``sb3``: Stable-Baselines3 PPO with the same hyperparameters (sb3-contrib's
  ``RecurrentPPO`` with ``recurrent``), optionally (``probe_callback``) with
  :class:`policy_probes.integrations.sb3.ProbeCallback` carrying :func:`probe_builders`
  (and :func:`recurrent_probe_builders`);
* ``cleanrl_atari``: :mod:`benchmarks.cleanrl_style`.

Parameters: :data:`DEFAULTS` updated with the JSON given. The timed region (building the
run and training it; not interpreter start and imports) is reported by :class:`Clocks`; the
probed cases add the sampler's figures (:func:`sampling_of`, :class:`OverheadTotal`).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from typing import Any

import torch

import policy_probes as pp
import trainers
from benchmarks.cleanrl_style import cleanrl_atari
from benchmarks.clocks import Clocks
from policy_probes.sinks import SinksConfig, WandbConfig

DEFAULTS: dict[str, Any] = {
    "env_id": "CartPole-v1",
    "total_timesteps": 20_480,
    "num_envs": 4,
    "num_steps": 128,
    "num_minibatches": 4,
    "update_epochs": 4,
    "hidden": 64,
    "activation": "tanh",
    "encoder": "none",
    "clip_reward": None,
    "vectorization": "sync",
    "probes": False,
    # which probes ``probes=True`` attaches: "core" (probe_builders) or "plasticity"
    # (plasticity_probe_builders)
    "probe_set": "core",
    "fisher_param_every": 1,
    "per_layer": True,
    "jsonl": False,
    "wandb_watch": False,
    # record the trackers' bytes after every epoch (tracker_bytes_per_epoch)
    "track_memory": True,
    # TrainTool.hooks, hook_config and snapshot_every (None keeps its default)
    "lifecycle_hooks": [],
    "hook_config": {},
    "snapshot_every": None,
    # time every trainer-callback dispatch and session call (callback_seconds)
    "time_callbacks": False,
    "seed": 1,
    # the probes' sampling (policy_probes.sampling); None/None = every pass. The
    # toolkit's default is budget 0.05.
    "probe_budget": None,
    "probe_schedule": None,
    # trainer.compile (docs/compile.md): torch.compile the update's forward
    "compile": False,
    "compile_backend": "inductor",
    # the torch device of ``ours``, ``recipe`` and ``cleanrl_atari`` ("cpu" or "cuda")
    "device": "cpu",
    # the sinks of ``recipe``: "files" (JSONL and CSV) or "headline" (console and
    # offline W&B as well, as ``policy-probes run`` starts it)
    "recipe_sinks": "files",
    # the probes of ``recipe``: "shipped" or "one_component" (its four on ``actor_mlp``
    # alone, ``per_layer=False``: the least a report of these probes can reduce)
    "recipe_probes": "shipped",
    # probe specs ``recipe`` attaches besides its own (``"trainability@actor_mlp"``)
    "extra_probes": [],
    # the components the five probes of ``sb3`` (ProbeCallback) watch
    "probe_components": ["actor_mlp", "critic_mlp"],
}
#: the PPOConfig fields every case takes from its parameters
PPO_KEYS = ("total_timesteps", "num_steps", "num_minibatches", "update_epochs")


class OverheadTotal:
    """While active, sums the ``probes/overhead_seconds`` of every record the run's
    sessions make (this process only): the sampler's cost figure over a whole run. The
    last epoch's ``overhead_fraction`` alone understates it: an epoch's end is charged to
    the next epoch, and the last one has none."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: Any = None

    def __enter__(self) -> OverheadTotal:
        self._saved = original = pp.ProbeSession.epoch_end

        def epoch_end(session: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            record = original(session, *args, **kwargs)
            self.seconds += float(record.get("probes/overhead_seconds") or 0.0)
            return record

        pp.ProbeSession.epoch_end = epoch_end
        return self

    def __exit__(self, *exc: object) -> None:
        pp.ProbeSession.epoch_end = self._saved

    def fraction(self, clocks: Clocks) -> float | None:
        """The summed overhead as a share of the timed region (None: nothing charged)."""
        return self.seconds / clocks.seconds if self.seconds else None


def probe_builders(
    fisher_param_every: int = 1,
    per_layer: bool = True,
    components: tuple[str, ...] = ("actor_mlp", "critic_mlp"),
) -> list[tuple[str, Any, dict[str, Any]]]:
    """``(component, builder, placement)`` of the five module probes (relu,
    saturation_tanh, fisher, gradient_flow, relu_gradient_flow) on each of ``components``."""
    layers = {"per_layer": per_layer}
    out = []
    for component in components:
        out += [
            (component, pp.attach_relu_activation_hooks(), layers),
            (component, pp.attach_saturated_activation_hooks("tanh"), layers),
            (component, pp.attach_fisher_information_hooks(param_every=fisher_param_every), {}),
            (component, pp.attach_gradient_flow_hooks(), layers),
            (component, pp.attach_relu_gradient_flow_hooks(), layers),
        ]
    return out


def plasticity_probe_builders() -> list[tuple[str, Any, dict[str, Any]]]:
    """The plasticity measures: weights, preactivation and utility on both MLPs, churn on
    both heads (the actor's as categorical logits)."""
    out = []
    for component, head in (("actor_mlp", "actor_head"), ("critic_mlp", "critic_head")):
        out += [
            (component, pp.attach_weights_hooks(), {}),
            (component, pp.attach_preactivation_hooks(), {}),
            (component, pp.attach_utility_hooks(outgoing=head), {}),
        ]
    return out + [
        ("actor_head", pp.attach_churn_hooks(kind="categorical"), {}),
        ("critic_head", pp.attach_churn_hooks(), {}),
    ]


def recurrent_probe_builders() -> list[tuple[str, Any, dict[str, Any]]]:
    """The probes that apply to an LSTM's output, on RecurrentPPO's two LSTMs."""
    out = []
    for component in ("lstm_actor", "lstm_critic"):
        out += [
            (component, pp.attach_relu_activation_hooks(), {}),
            (component, pp.attach_saturated_activation_hooks("tanh"), {}),
            (component, pp.attach_fisher_information_hooks(), {}),
            (component, pp.attach_gradient_flow_hooks(), {}),
        ]
    return out


def env_and_policy(p: dict[str, Any]) -> tuple[trainers.EnvConfig, trainers.PolicyConfig]:
    """The environment and policy settings of ``p`` (``ours`` and ``bare``)."""
    env = trainers.EnvConfig(
        id=p["env_id"],
        num_envs=p["num_envs"],
        vectorization=p["vectorization"],
        clip_reward=p["clip_reward"],
    )
    hidden = [p["hidden"], p["hidden"]]
    policy = trainers.PolicyConfig(
        hidden_sizes=hidden, activation=p["activation"], encoder=p["encoder"]
    )
    return env, policy


def train_tool(p: dict[str, Any], prefix: str = "pp-bench-") -> trainers.TrainTool:
    """The ``ours`` case's run of ``p`` in a new temporary directory (``prefix``):
    evaluation, checkpoints and every sink but JSONL (``jsonl``) off, with the lifecycle
    hooks and, with ``probes``, the probes ``p`` names (with ``encoder="nature_cnn"``
    those of :func:`recipes.atari.add_probes`)."""
    env, policy = env_and_policy(p)
    tool = trainers.TrainTool(
        env=env,
        policy=policy,
        trainer=trainers.PPOConfig(
            **{k: p[k] for k in PPO_KEYS},
            compile=p["compile"],
            compile_backend=p["compile_backend"],
        ),
        evaluation=trainers.EvalConfig(every_epochs=0, at_end=False),
        checkpoint=trainers.CheckpointConfig(every_epochs=0, at_end=False),
        sinks=SinksConfig(
            console=False, jsonl=p["jsonl"], csv=False, wandb=False, tensorboard=False
        ),
        wandb=WandbConfig(mode="disabled"),
        seed=p["seed"],
        device=p["device"],
        run_dir=tempfile.mkdtemp(prefix=prefix),
        torch_threads=1,
        probe_budget=p["probe_budget"],
        probe_schedule=p["probe_schedule"],
    )
    if p["lifecycle_hooks"]:
        tool.hooks = list(p["lifecycle_hooks"])
        tool.hook_config = dict(p["hook_config"])
    if p["snapshot_every"] is not None:
        tool.snapshot_every = p["snapshot_every"]
    if p["probes"] and p["encoder"] == "nature_cnn":
        from recipes.atari import add_probes

        add_probes(tool)
    elif p["probes"]:
        builders = (
            plasticity_probe_builders()
            if p["probe_set"] == "plasticity"
            else probe_builders(p["fisher_param_every"], p["per_layer"])
        )
        for component, builder, placement in builders:
            tool.add_training_hook(component, builder, **placement)
    return tool


def time_session_calls(totals: list[float]) -> None:
    """Time every trainer-callback dispatch and the session calls through which the
    trainer reaches probes, hooks and sinks, into ``totals`` (seconds, calls): the
    measurement instrument of ``time_callbacks``, in this process only."""

    def timed(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[0] += time.perf_counter() - t
                totals[1] += 1

        return call

    trainers.CallbackList._each = timed(trainers.CallbackList._each)
    for name in ("epoch_start", "rollout_end", "pre_step", "post_step", "epoch_end"):
        setattr(pp.ProbeSession, name, timed(getattr(pp.ProbeSession, name)))


def ours(p: dict[str, Any]) -> dict[str, Any]:
    """:func:`train_tool` timed, with per epoch the trackers' bytes, the update phase's
    seconds and the lifecycle hooks that reported (``lifecycle_fired``), and dynamo's
    counts (:func:`dynamo_counts`)."""
    tool = train_tool(p)
    memory: list[int] = []
    update_seconds: list[float] = []
    fired: dict[str, int] = {name: 0 for name in p["lifecycle_hooks"]}

    class EpochRecorder(trainers.TrainerHook):
        def on_epoch_end(self, state: Any) -> None:
            if p["track_memory"]:
                memory.append(sum(t.nbytes() for t in state.context.model_metrics.values()))
            update_seconds.append(state.rollout_stats.get("update_seconds", float("nan")))
            for name in fired:
                if any(k.startswith(f"{name}/") for k in state.metrics):
                    fired[name] += 1

    tool.add_trainer_hook(EpochRecorder())
    run = None
    if p["wandb_watch"]:
        import wandb

        run = wandb.init(mode="offline", dir=str(tool.run_dir), project="policy-probes-bench")

        class Watch(trainers.TrainerHook):
            def on_new_training_run(self, state: Any) -> None:
                wandb.watch(state.policy, log="all", log_freq=1)

        tool.add_trainer_hook(Watch())
    callback_time = [0.0, 0]
    if p["time_callbacks"]:
        time_session_calls(callback_time)
    clocks = Clocks()
    with OverheadTotal() as overhead:
        result = tool.invoke()
    clocks.stop()
    if run is not None:
        run.finish()
    return clocks.result(
        result.agent_step,
        tracker_bytes_per_epoch=memory,
        update_seconds=update_seconds,
        lifecycle_fired=fired,
        callback_seconds=callback_time[0],
        **sampling_of(result.metrics),
        run_overhead_fraction=overhead.fraction(clocks),
        callback_calls=callback_time[1],
        **dynamo_counts(),
    )


def dynamo_counts() -> dict[str, int]:
    """Graphs torch.compile produced in this process and the graph breaks it met."""
    from torch._dynamo.utils import counters

    return {
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def bare(p: dict[str, Any]) -> dict[str, Any]:
    from trainers.envs import make_vector_env
    from trainers.train_tool import seed_everything

    cfg = trainers.PPOConfig(**{k: p[k] for k in PPO_KEYS})
    clocks = Clocks()
    seed_everything(p["seed"])
    env_config, policy_config = env_and_policy(p)
    envs = make_vector_env(env_config, gamma=cfg.gamma)
    policy = trainers.make_policy(
        envs.single_observation_space, envs.single_action_space, policy_config
    )
    state = trainers.PPOTrainer(envs, policy, cfg, seed=p["seed"]).train()
    clocks.stop()
    envs.close()
    return clocks.result(state.agent_step)


def sb3(p: dict[str, Any]) -> dict[str, Any]:
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    algo, policy, extra = PPO, "MlpPolicy", {}
    if p.get("recurrent"):
        from sb3_contrib import RecurrentPPO

        algo, policy, extra = RecurrentPPO, "MlpLstmPolicy", {"lstm_hidden_size": p["hidden"]}

    lr = 2.5e-4
    clocks = Clocks()
    env = make_vec_env(p["env_id"], n_envs=p["num_envs"], seed=p["seed"])
    batch = p["num_envs"] * p["num_steps"]
    model = algo(
        policy,
        env,
        n_steps=p["num_steps"],
        batch_size=batch // p["num_minibatches"],
        n_epochs=p["update_epochs"],
        learning_rate=lambda progress: lr * progress,  # linear annealing, as ours
        gamma=0.99,
        gae_lambda=0.95,
        clip_range=0.2,
        ent_coef=0.01,
        vf_coef=0.5,
        max_grad_norm=0.5,
        policy_kwargs={
            "net_arch": {"pi": [p["hidden"]] * 2, "vf": [p["hidden"]] * 2},
            "activation_fn": torch.nn.ReLU if p["activation"] == "relu" else torch.nn.Tanh,
            **extra,
        },
        device="cpu",
        seed=p["seed"],
        verbose=0,
    )
    callback = None
    if p.get("probe_callback"):
        from policy_probes.integrations.sb3 import ProbeCallback

        builders = probe_builders(per_layer=p["per_layer"], components=tuple(p["probe_components"]))
        if p.get("recurrent"):
            builders += recurrent_probe_builders()
        callback = ProbeCallback(
            probes=builders,
            run_dir=tempfile.mkdtemp(prefix="pp-bench-sb3-"),
            probing=pp.ProbeSettings(
                sinks=SinksConfig(console=False, jsonl=True, csv=False, wandb=False),
                wandb=WandbConfig(mode="disabled"),
                probe_budget=p["probe_budget"],
                probe_schedule=p["probe_schedule"],
            ),
        )
    with OverheadTotal() as overhead:
        model.learn(total_timesteps=p["total_timesteps"], callback=callback)
    clocks.stop()
    env.close()
    out = clocks.result(model.num_timesteps)
    if callback is not None:
        last = callback.history[-1] if callback.history else {}
        out["records"] = len(callback.history)
        out["probe_keys"] = sum(1 for k in last if k.startswith("probes/"))
        out["probed_components"] = probed_components(last)
        out.update(sampling_of(last))
        out["run_overhead_fraction"] = overhead.fraction(clocks)
    return out


def probed_components(metrics: dict[str, Any]) -> list[str]:
    """The components (and layers) a record's probe keys report,
    ``probes/<probe>/<component>/<metric>``."""
    parts = [k.split("/") for k in metrics if k.startswith("probes/")]
    return sorted({p[2] for p in parts if len(p) == 4 and p[1] != "overhead_seconds"})


def sampling_of(metrics: dict[str, Any]) -> dict[str, Any]:
    """The last epoch's measured probe overhead, sampling strides (``observe_every``) and
    the probes disabled after a fault (a disabled probe costs nothing: the ratio would lie)."""
    return {
        "overhead_fraction": metrics.get("probes/overhead_fraction"),
        "probe_errors": sorted(k for k in metrics if k.startswith("probes/errors/")),
        "observe_every": {
            k.split("/")[1]: v for k, v in metrics.items() if k.endswith("/observe_every")
        },
    }


def recipe(p: dict[str, Any]) -> dict[str, Any]:
    """``recipes.cartpole`` as it ships (evaluation, JSONL and CSV metrics, checkpoints)
    with the sinks of ``recipe_sinks`` and ``total_timesteps`` and the sampling from
    ``p``; without ``probes`` the same configuration with no probe attached; with
    ``recipe_probes="one_component"`` :func:`recipes.cartpole.add_probes` on
    ``actor_mlp`` alone without per-layer keys."""
    from recipes.cartpole import add_probes, train

    if p["recipe_probes"] not in ("shipped", "one_component"):
        raise ValueError(f"recipe_probes: 'shipped' or 'one_component', not {p['recipe_probes']!r}")
    tool = train()
    if not p["probes"] or p["recipe_probes"] != "shipped":
        tool = trainers.TrainTool.model_validate(tool.model_dump())  # the configuration alone
    if p["probes"] and p["recipe_probes"] == "one_component":
        add_probes(tool, ("actor_mlp",), per_layer=False)
    tool.trainer.total_timesteps = p["total_timesteps"]
    headline = p["recipe_sinks"] == "headline"
    tool.sinks.console = headline
    tool.sinks.wandb = headline
    tool.wandb.mode = "offline" if headline else "disabled"
    tool.seed = p["seed"]
    tool.device = p["device"]
    tool.run_dir = tempfile.mkdtemp(prefix="pp-bench-")
    tool.probe_budget = p["probe_budget"]
    tool.probe_schedule = p["probe_schedule"]
    tool.probes = [*tool.probes, *p["extra_probes"]]
    clocks = Clocks()
    with OverheadTotal() as overhead:
        result = tool.invoke()
    clocks.stop()
    return clocks.result(
        result.agent_step,
        **sampling_of(result.metrics),
        run_overhead_fraction=overhead.fraction(clocks),
    )


CASES = {"ours": ours, "bare": bare, "sb3": sb3, "recipe": recipe, "cleanrl_atari": cleanrl_atari}


def warm_imports(case: str) -> None:
    """Import what the timed region would otherwise import lazily, for both sides alike
    (the first ``torch.optim`` optimizer imports ``torch._dynamo``: 1-2 s; the toolkit and
    the trainer are imported with this module)."""
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([param])
    param.sum().backward()
    opt.step()
    if case == "sb3":
        import sb3_contrib  # noqa: F401
        import stable_baselines3  # noqa: F401
        from stable_baselines3.common.env_util import make_vec_env  # noqa: F401

        # the callback side would otherwise import the toolkit (~0.5 s) inside its region
        from policy_probes.integrations import sb3  # noqa: F401
        from policy_probes.sinks import jsonl  # noqa: F401


def main() -> None:
    torch.set_num_threads(1)
    case = sys.argv[1]
    warm_imports(case)
    params = dict(DEFAULTS)
    params.update(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    if params["compile"]:  # inductor's import (~1.5 s), not compiling, outside the region
        from torch._inductor import compile_fx  # noqa: F401
    if params["device"] != "cpu":  # the CUDA context (~1 s) outside the region
        torch.zeros(1, device=params["device"]).add_(1).cpu()
    print(json.dumps(CASES[case](params)), flush=True)


if __name__ == "__main__":
    main()
