"""CartPole-v1 with a tanh policy and saturation probes on every hidden layer.

``attach_saturated_activation_hooks(activation="tanh")`` counts elements with |h| > 0.95
and the mean derivative 1 - h^2 per unit; attached to ``actor_mlp.*`` and
``critic_mlp.*`` it reports each hidden layer (``actor_mlp.layer_0``, ``actor_mlp.layer_1``,
...) separately. Gradient flow shows whether saturated units still pass gradient.
"""

from __future__ import annotations

from policy_probes.probes.gradient_flow import attach_gradient_flow_hooks
from policy_probes.probes.saturation import attach_saturated_activation_hooks
from trainers import EnvConfig, EvalConfig, PolicyConfig, PPOConfig, TrainTool


def train() -> TrainTool:
    """CleanRL CartPole defaults with the tanh MLP (CleanRL's own activation)."""
    cfg = TrainTool(
        name="cartpole_tanh",
        env=EnvConfig(id="CartPole-v1", num_envs=4),
        policy=PolicyConfig(hidden_sizes=[64, 64], activation="tanh"),
        trainer=PPOConfig(
            total_timesteps=200_000, num_steps=128, num_minibatches=4, update_epochs=4
        ),
        evaluation=EvalConfig(every_epochs=10, episodes=10, num_envs=10),
        torch_threads=1,
    )
    cfg.add_training_hook("actor_mlp.*", attach_saturated_activation_hooks(activation="tanh"))
    cfg.add_training_hook("critic_mlp.*", attach_saturated_activation_hooks(activation="tanh"))
    cfg.add_training_backward_hook("actor_mlp.*", attach_gradient_flow_hooks())
    return cfg
