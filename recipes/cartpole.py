"""CartPole-v1 with CleanRL's PPO defaults, a ReLU policy and the four ReLU-network
probes.

The probes watch the post-activation outputs of ``actor_mlp`` and ``critic_mlp``:
dead/dormant ReLU units, Fisher information, gradient flow and ReLU gradient pass rates.
(The saturation probe is for bounded activations: ``recipes.cartpole_tanh``; on a ReLU
network its ``saturation_tanh`` keys would read as saturated tanh units.)

    policy-probes run recipes.cartpole.train trainer.total_timesteps=50000 seed=3
"""

from __future__ import annotations

from policy_probes.probes.churn import attach_churn_hooks
from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.gradient_flow import attach_gradient_flow_hooks
from policy_probes.probes.preactivation import attach_preactivation_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.probes.relu_gradient_flow import attach_relu_gradient_flow_hooks
from policy_probes.probes.trainability import attach_trainability_hooks
from policy_probes.probes.utility import attach_utility_hooks
from policy_probes.probes.weights import attach_weights_hooks
from trainers import EnvConfig, EvalConfig, PolicyConfig, PPOConfig, TrainTool

PROBED = ("actor_mlp", "critic_mlp")
#: each probed MLP and the head its outputs feed (the utility probe's outgoing weights)
HEADS = {"actor_mlp": "actor_head", "critic_mlp": "critic_head"}


def train() -> TrainTool:
    """CleanRL ``ppo.py`` CartPole hyperparameters (4 envs x 128 steps, 4 minibatches,
    4 update epochs, lr 2.5e-4 annealed, gamma 0.99, lambda 0.95, clip 0.2, ent 0.01,
    vf 0.5, 64-64 hidden) with ReLU activations, 200k steps; the four probes for ReLU networks."""
    cfg = TrainTool(
        name="cartpole",
        env=EnvConfig(id="CartPole-v1", num_envs=4),
        policy=PolicyConfig(hidden_sizes=[64, 64], activation="relu"),
        trainer=PPOConfig(total_timesteps=200_000),  # PPOConfig's defaults are CleanRL ppo.py's
        evaluation=EvalConfig(every_epochs=10, episodes=10, num_envs=10),
        torch_threads=1,
    )
    return add_probes(cfg)


def add_probes(
    cfg: TrainTool, components: tuple[str, ...] = PROBED, *, per_layer: bool = True
) -> TrainTool:
    """The recipe's four probes on ``components`` (the benchmarks attach the same set, on
    ``actor_mlp`` alone and without per-layer keys for their bound): ReLU activations,
    Fisher information, gradient flow and ReLU gradient flow; ``per_layer`` also reports
    every layer inside each component."""
    for component in components:
        cfg.add_training_hook(component, attach_relu_activation_hooks(), per_layer=per_layer)
        cfg.add_training_backward_hook(component, attach_fisher_information_hooks())
        cfg.add_training_backward_hook(
            component, attach_gradient_flow_hooks(beta=0.95), per_layer=per_layer
        )
        cfg.add_training_backward_hook(
            component, attach_relu_gradient_flow_hooks(), per_layer=per_layer
        )
    return cfg


def train_measured() -> TrainTool:
    """:func:`train` with every plasticity measure, for the labelled findings benchmark
    (``benchmarks/findings_bench.py``): besides the four probes of :func:`train` (ReLU
    activations with the dormant fractions, Fisher information, gradient flow, ReLU
    gradient flow), weights, preactivation, utility and trainability (every 10 epochs) on
    both MLPs and churn on both heads; every pass observed (``probe_budget=None``), no evaluation. Any classic-control
    env with discrete actions runs through ``env.id=`` (``env.id=Acrobot-v1``). The probes
    never change the training trajectory: the returns are those of :func:`train`."""
    cfg = train()
    cfg.probe_budget = None
    cfg.evaluation = EvalConfig(every_epochs=0, at_end=False)
    for component, head in HEADS.items():
        # one line here adds a probe to both MLPs
        cfg.add_training_hook(component, attach_weights_hooks())
        cfg.add_training_hook(component, attach_preactivation_hooks())
        cfg.add_training_hook(component, attach_utility_hooks(outgoing=head))
        cfg.add_training_hook(component, attach_trainability_hooks(every_epochs=10))
    cfg.add_training_hook("actor_head", attach_churn_hooks(kind="categorical"))
    cfg.add_training_hook("critic_head", attach_churn_hooks())
    return cfg
