"""CartPole-v1 with CleanRL's PPO defaults, a ReLU policy and the four ReLU-network
probes.

The probes watch the post-activation outputs of ``actor_mlp`` and ``critic_mlp``:
dead/dormant ReLU units, Fisher information, gradient flow and ReLU gradient pass rates.
(The saturation probe is for bounded activations: ``recipes.cartpole_tanh``; on a ReLU
network its ``saturation_tanh`` keys would read as saturated tanh units.)

    policy-probes run recipes.cartpole.train trainer.total_timesteps=50000 seed=3
"""

from __future__ import annotations

from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.gradient_flow import attach_gradient_flow_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.probes.relu_gradient_flow import attach_relu_gradient_flow_hooks
from trainers import EnvConfig, EvalConfig, PolicyConfig, PPOConfig, TrainTool

PROBED = ("actor_mlp", "critic_mlp")


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
