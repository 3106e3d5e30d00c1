"""PPO trainer, TrainTool and trainer callbacks for policy-probes (depends on policy_probes)."""

from trainers.callbacks import CallbackList, TrainerHook, TrainerState
from trainers.checkpoint import CheckpointHook, load_checkpoint, restore_trainer
from trainers.cnn_policy import CNNActorCriticPolicy, make_policy
from trainers.config import (
    AtariConfig,
    CheckpointConfig,
    EnvConfig,
    EvalConfig,
    PolicyConfig,
    PPOConfig,
)
from trainers.evaluation import EvaluationHook
from trainers.model_context import PPOModelDataContext
from trainers.nature_cnn import NatureCNN
from trainers.policy import ActorCriticPolicy
from trainers.ppo import PPOTrainer, ppo_loss
from trainers.progress import ProgressHook
from trainers.rollout import Minibatch, RolloutStorage, compute_gae
from trainers.train_tool import TrainResult, TrainTool

__all__ = [
    "ActorCriticPolicy",
    "AtariConfig",
    "CNNActorCriticPolicy",
    "CallbackList",
    "CheckpointConfig",
    "CheckpointHook",
    "EnvConfig",
    "EvalConfig",
    "EvaluationHook",
    "Minibatch",
    "NatureCNN",
    "PPOConfig",
    "PPOModelDataContext",
    "PPOTrainer",
    "PolicyConfig",
    "ProgressHook",
    "RolloutStorage",
    "TrainResult",
    "TrainTool",
    "TrainerHook",
    "TrainerState",
    "compute_gae",
    "load_checkpoint",
    "make_policy",
    "ppo_loss",
    "restore_trainer",
]
