"""The plugin registry: probes and remedies registered by declaration, selected by name
from configuration (``probes=``, ``remedies=``), listed by ``policy-probes plugins``."""

from __future__ import annotations

import json

import pytest

from policy_probes import ProbeSettings, ReLUActivation, plugins
from policy_probes.cli import main
from policy_probes.remedies import ReDo
from trainers import TrainTool

BUILTIN_PROBES = {
    "churn",
    "fisher",
    "gradient_flow",
    "preactivation",
    "relu",
    "relu_gradient_flow",
    "saturation_sigmoid",
    "saturation_tanh",
    "trainability",
    "utility",
    "weights",
}


def builtin(kind: str) -> set[str]:
    """The built-in plugins of ``kind`` (other test modules register their own)."""
    return {
        n for n, c in plugins.registered(kind).items() if c.__module__.startswith("policy_probes.")
    }


def test_the_builtins_are_registered_and_declare_their_rules_and_console_metrics() -> None:
    assert builtin("probe") == BUILTIN_PROBES
    assert list(plugins.registered("sink"))[:5] == [
        "jsonl",
        "csv",
        "tensorboard",
        "wandb",
        "console",
    ]
    relu = plugins.get("probe", "relu")
    assert relu is ReLUActivation and relu.direction == "forward"
    assert [r.name for r in relu.rules] == ["dead_units", "dormant_units"]
    dead = relu.rules[0]
    assert dead.probe == "relu"  # bound to its probe when registered
    assert dead.matches("probes/relu/actor_mlp.layer_0/dead_fraction_ref") == "actor_mlp.layer_0"
    assert dead.matches("probes/relu/actor_mlp/dead_fraction") is None
    assert "probes/relu/*/dead_fraction" in plugins.console_metrics()
    names = [r.name for r in plugins.findings_rules()]
    assert len(names) == len(set(names)) and {"dead_units", "churn_rising"} <= set(names)
    with pytest.raises(ValueError, match=r"unknown probe 'rellu'. Did you mean 'relu'\?"):
        plugins.get("probe", "rellu")


def test_a_second_class_under_a_taken_name_is_refused() -> None:
    class Other(ReLUActivation):
        pass

    with pytest.raises(ValueError, match="a probe named 'relu' is already registered"):
        plugins.register(Other)


def test_specs_build_probes_and_remedies_and_say_what_is_wrong() -> None:
    component, probe, placement = plugins.from_spec(
        "relu@actor_mlp:tau=0.1,taus=0|0.2,per_layer=false", "probe"
    )
    assert component == "actor_mlp" and isinstance(probe, ReLUActivation)
    assert probe.options["tau"] == 0.1 and probe.options["taus"] == (0.0, 0.2)
    assert placement == {"per_layer": False}
    component, remedy, rest = plugins.from_spec("redo@critic_mlp:tau=0.05,every_epochs=3", "remedy")
    assert isinstance(remedy, ReDo) and remedy.tau == 0.05 and rest == {}
    with pytest.raises(ValueError, match=r"'layout' is no key of fisher; keys: \["):
        plugins.from_spec("fisher@actor_mlp:layout=auto", "probe")  # fisher takes no layout
    with pytest.raises(ValueError, match="tau must be >= 0"):
        plugins.from_spec("relu@actor_mlp:tau=-1", "probe")
    with pytest.raises(ValueError, match="name@component"):
        plugins.from_spec("relu", "probe")
    with pytest.raises(ValueError, match="unknown probe 'nope'"):
        ProbeSettings(probes=["nope@actor_mlp"])
    assert ProbeSettings(probes="relu@a; fisher@b").probes == ["relu@a", "fisher@b"]


def test_a_probe_from_configuration_reports_what_the_same_probe_attached_in_code_does(
    tmp_path,
) -> None:
    def tool(run_dir, **kw) -> TrainTool:
        return TrainTool(
            run_dir=run_dir,
            env={"num_envs": 2},
            policy={"hidden_sizes": [8, 8], "activation": "relu"},
            trainer={"total_timesteps": 64, "num_steps": 16, "num_minibatches": 2},
            evaluation={"every_epochs": 0, "at_end": False},
            checkpoint={"every_epochs": 0, "at_end": False},
            sinks={"console": False, "csv": False, "wandb": False},
            probe_budget=None,
            torch_threads=1,
            **kw,
        )

    configured = tool(tmp_path / "a", probes=["relu@actor_mlp:tau=0.1,per_layer=false"]).invoke()
    coded = tool(tmp_path / "b")
    coded.add_training_hook("actor_mlp", ReLUActivation(tau=0.1), per_layer=False)
    expected = coded.invoke()
    ours = {k: v for k, v in configured.metrics.items() if k.startswith("probes/relu/")}
    theirs = {k: v for k, v in expected.metrics.items() if k.startswith("probes/relu/")}
    assert ours == theirs and "probes/relu/actor_mlp/dead_fraction" in ours
    assert not any(k.startswith("probes/relu/actor_mlp.layer_0/") for k in ours)  # per_layer


def test_the_plugins_command_lists_what_is_registered(capsys) -> None:
    assert main(["plugins", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert set(listed["probe"]) >= BUILTIN_PROBES
    assert {"jsonl", "csv", "tensorboard", "wandb", "console"} <= set(listed["sink"])
    assert listed["probe"]["relu"]["findings"] == ["dead_units", "dormant_units"]
    assert listed["probe"]["fisher"]["findings"] == []  # its rules were noise (docs/findings.md)
    assert listed["probe"]["relu"]["console"] == [
        "probes/relu/*/dead_fraction",
        "probes/relu/*/dormant_fraction",
    ]
    assert "redo" in listed["remedy"]
    assert main(["plugins", "--kind", "remedy"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("remedies:\n  redo: ReDo (Sokar et al., ICML 2023)")
