"""CartPole-v1 whose observation features are permuted every 40 epochs: a task that keeps
changing, on which a ReLU policy loses plasticity (docs/plasticity.md).

The permutation of period k is drawn from the run's seed and k
(:class:`trainers.envs.PermuteObservation`): every arm of an experiment with the same seed
sees the same tasks. The constant learning rate keeps later periods from being learnt
more slowly merely because the step size decayed. Only the ReLU probe is attached (the
dormant scores that ReDo reads). Switch a remedy on from the command line::

    policy-probes run recipes.cartpole_permuted.train \\
        remedies='["redo@actor_mlp:tau=0.1,every_epochs=10","redo@critic_mlp:tau=0.1,every_epochs=10"]'
"""

from __future__ import annotations

from policy_probes.probes.churn import attach_churn_hooks
from policy_probes.probes.fisher import attach_fisher_information_hooks
from policy_probes.probes.preactivation import attach_preactivation_hooks
from policy_probes.probes.relu import attach_relu_activation_hooks
from policy_probes.probes.trainability import attach_trainability_hooks
from policy_probes.probes.utility import attach_utility_hooks
from policy_probes.probes.weights import attach_weights_hooks
from trainers import EnvConfig, EvalConfig, PolicyConfig, PPOConfig, TrainTool

NUM_ENVS, NUM_STEPS = 4, 128
#: epochs per permutation period
PERIOD_EPOCHS = 40


def train() -> TrainTool:
    """CartPole with its 4 observation features permuted every 40 epochs (20,480 agent
    steps), 64-64 ReLU actor and critic, constant lr 3e-3, 480 epochs (12 periods);
    ReLU activation probes on both MLPs, no evaluation (its envs would not be permuted)."""
    cfg = TrainTool(
        name="cartpole_permuted",
        env=EnvConfig(
            id="CartPole-v1",
            num_envs=NUM_ENVS,
            permute_obs_every=PERIOD_EPOCHS * NUM_ENVS * NUM_STEPS,
        ),
        policy=PolicyConfig(hidden_sizes=[64, 64], activation="relu"),
        trainer=PPOConfig(
            total_timesteps=12 * PERIOD_EPOCHS * NUM_ENVS * NUM_STEPS,
            num_steps=NUM_STEPS,
            num_minibatches=4,
            update_epochs=4,
            learning_rate=3e-3,
            anneal_lr=False,
        ),
        evaluation=EvalConfig(every_epochs=0, at_end=False),
        probe_budget=None,  # every pass: dormant scores from the whole update phase
        torch_threads=1,
    )
    for component in ("actor_mlp", "critic_mlp"):
        cfg.add_training_hook(component, attach_relu_activation_hooks())
    return cfg


def train_measured() -> TrainTool:
    """:func:`train` with every plasticity measure (docs/plasticity.md, "Which measure
    predicts the decline"): besides the ReLU probe (dormant fractions at tau 0, 0.025,
    0.1), the Fisher probe (trace, gradient noise scale), weights, preactivation and
    utility on both MLPs, churn on both heads, and the trainability probe on both MLPs
    every 10 epochs (docs/probes/trainability.md). The probes never change the training
    trajectory: the returns are those of :func:`train`."""
    cfg = train()
    for component, head in (("actor_mlp", "actor_head"), ("critic_mlp", "critic_head")):
        cfg.add_training_backward_hook(component, attach_fisher_information_hooks())
        cfg.add_training_hook(component, attach_weights_hooks())
        cfg.add_training_hook(component, attach_preactivation_hooks())
        cfg.add_training_hook(component, attach_utility_hooks(outgoing=head))
        cfg.add_training_hook(component, attach_trainability_hooks(every_epochs=10))
    cfg.add_training_hook("actor_head", attach_churn_hooks(kind="categorical"))
    cfg.add_training_hook("critic_head", attach_churn_hooks())
    return cfg
