"""Same recipe + seed -> bit-identical parameters on CPU; probes do not change the run."""

from __future__ import annotations

import torch

from recipes.cartpole import train as cartpole
from recipes.pendulum import train as pendulum

torch.set_num_threads(1)


def run(recipe, tmp_path, name, probes=True, **trainer):
    tool = recipe()
    if not probes:
        tool = tool.model_copy(deep=True)
        object.__setattr__(
            tool, "__pydantic_private__", {**tool.__pydantic_private__, "_builders": []}
        )
    tool = tool.model_copy(
        update={
            "run_dir": tmp_path / name,
            "trainer": tool.trainer.model_copy(update=trainer),
            "wandb": tool.wandb.model_copy(update={"mode": "disabled"}),
            "sinks": tool.sinks.model_copy(update={"console": False}),
            "evaluation": tool.evaluation.model_copy(
                update={"every_epochs": 1, "episodes": 2, "num_envs": 2}
            ),
        }
    )
    return tool.invoke().policy.state_dict()


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_cartpole_two_runs_bit_identical(tmp_path):
    a = run(cartpole, tmp_path, "a", total_timesteps=1536)
    b = run(cartpole, tmp_path, "b", total_timesteps=1536)
    assert_identical(a, b)
    init = run(cartpole, tmp_path, "c", total_timesteps=512, update_epochs=1)
    assert any(not torch.equal(a[k], init[k]) for k in a)  # training did change them


def test_probes_do_not_change_the_trajectory(tmp_path):
    with_probes = run(cartpole, tmp_path, "p", total_timesteps=1024)
    without = run(cartpole, tmp_path, "n", probes=False, total_timesteps=1024)
    assert_identical(with_probes, without)


def test_pendulum_two_runs_bit_identical(tmp_path):
    kw = {"total_timesteps": 2048, "num_minibatches": 4, "update_epochs": 2}
    assert_identical(run(pendulum, tmp_path, "a", **kw), run(pendulum, tmp_path, "b", **kw))
