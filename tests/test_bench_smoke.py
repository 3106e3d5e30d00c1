"""Smoke runs of the benchmark scripts (``--quick --inprocess``): every script runs end to
end on tiny runs and writes a results JSON with its comparisons and extras. Timings are
not checked (no timing assertions); one real subprocess measurement covers run_case."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import (
    ab,
    cases,
    compile_overhead,
    empty_path,
    fisher_conv_routes,
    gpu_overhead,
    lifecycle_cost,
    per_epoch_default,
    probe_cadence,
    probe_overhead,
    sampling_overhead,
    scaling,
    throughput,
)

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _restore_in_process():
    yield
    ab.IN_PROCESS = False


def run_script(module, tmp_path, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    module.main(["--quick", "--inprocess", "--out", str(out)])
    payload = json.loads(out.read_text())
    assert payload["machine"]["torch"] == torch.__version__
    for comp in payload["comparisons"]:
        assert len(comp["ratios_b_over_a"]) == 1
        ratio = comp["median_ratio_b_over_a"]
        assert ratio > 0 and math.isfinite(ratio)
        assert comp["ratios_b_over_a"][0] == pytest.approx(
            comp["median_seconds_b"] / comp["median_seconds_a"]
        )
    return payload


def names(payload: dict) -> list[str]:
    return [c["name"] for c in payload["comparisons"]]


def test_throughput_smoke(tmp_path):
    payload = run_script(throughput, tmp_path, "throughput")
    assert names(payload) == ["sync (headline)", "vector_entry_point"]
    for comp in payload["comparisons"]:
        assert comp["b"]["case"] == "sb3"
        assert comp["extra_a"][0]["steps"] == comp["extra_b"][0]["steps"] == 512
    assert payload["comparisons"][1]["a"]["params"]["vectorization"] == "vector_entry_point"
    assert set(payload["speedup_over_sb3"]) == set(names(payload))


def test_probe_overhead_smoke(tmp_path):
    payload = run_script(probe_overhead, tmp_path, "probe_overhead")
    probes, per_layer, watch, atari = payload["comparisons"]
    assert not per_layer["a"]["params"]["per_layer"] and per_layer["b"]["params"]["per_layer"]
    assert probes["b"]["params"]["probes"] and probes["b"]["params"]["activation"] == "relu"
    assert probes["extra_a"][0]["tracker_bytes_per_epoch"] == [0]  # nothing attached
    assert probes["extra_b"][0]["tracker_bytes_per_epoch"][0] > 0
    assert watch["b"]["params"]["wandb_watch"]
    assert atari["b"]["params"]["encoder"] == "nature_cnn" and atari["b"]["params"]["probes"]
    assert atari["extra_a"][0]["tracker_bytes_per_epoch"] == [0]
    assert atari["extra_b"][0]["tracker_bytes_per_epoch"][0] > 0
    assert atari["extra_a"][0]["steps"] == atari["extra_b"][0]["steps"] == 128


def test_probe_overhead_only_subset(tmp_path):
    out = tmp_path / "atari.json"
    probe_overhead.main(["--quick", "--inprocess", "--only", "atari", "--out", str(out)])
    assert [c["name"] for c in json.loads(out.read_text())["comparisons"]] == [
        "atari recipe probes (NatureCNN)"
    ]
    with pytest.raises(SystemExit):
        probe_overhead.main(["--quick", "--inprocess", "--only", "cnn"])


def test_empty_path_smoke(tmp_path):
    payload = run_script(empty_path, tmp_path, "empty_path")
    (comp,) = payload["comparisons"]
    assert 0 <= payload["callback_share"] < 1 and len(payload["callback_shares"]) == 1
    assert comp["a"]["case"] == "bare" and comp["b"]["case"] == "ours"
    assert comp["extra_a"][0]["steps"] == comp["extra_b"][0]["steps"] == 512


def test_scaling_smoke(tmp_path):
    payload = run_script(scaling, tmp_path, "scaling")
    memory = payload["tracker_bytes_per_epoch"]
    short, long = memory["1 epochs"], memory["2 epochs"]
    assert len(short) == 1 and len(long) == 2
    assert short[0] == long[0] == long[1] > 0  # independent of the number of steps


def test_lifecycle_cost_smoke(tmp_path):
    payload = run_script(lifecycle_cost, tmp_path, "lifecycle_cost")
    cost = payload["cost_per_firing"]
    for name in lifecycle_cost.HOOKS:
        every = cost[f"{name} (every epoch)"]
        assert every["firings"] == 2, name  # 2 epochs, fires in each
        assert every["update_phase_equivalents"] is not None


def test_per_epoch_default_compares_the_default_and_every_pass_with_no_probes(tmp_path):
    out = tmp_path / "per_epoch.json"
    argv = ["--quick", "--inprocess", "--only", "sb3,every_five", "--out", str(out)]
    per_epoch_default.main(argv)
    sb3, every = json.loads(out.read_text())["comparisons"]
    assert sb3["b"]["params"]["probe_budget"] == 0.05 and sb3["b"]["params"]["probe_callback"]
    assert "probe_callback" not in sb3["a"]["params"]
    assert every["b"]["params"]["probe_budget"] is None and every["b"]["params"]["probes"]
    assert not every["a"]["params"].get("probes")
    assert [c["target"] for c in (sb3, every)] == ["<= 1.05", "<= 1.30"]


def test_probe_cadence_writes_a_ratio_per_probe_and_cadence(tmp_path):
    out = tmp_path / "cadence.json"
    probe_cadence.main(["--quick", "--repeats", "1", "--models", "mlp", "--out", str(out)])
    ratios = json.loads(out.read_text())["ratios"]["mlp"]
    assert set(ratios) == {*probe_cadence.PROBES, "all five"}
    for by_k in ratios.values():
        assert set(by_k) == {"1", "4"} and all(r > 0 and math.isfinite(r) for r in by_k.values())


def test_run_case_uses_a_fresh_interpreter():
    result = ab.run_case("bare", {"total_timesteps": 512})
    assert result["steps"] == 512 and result["seconds"] > 0


def test_adding_runs_side_a_case_with_more_parameters():
    a = ab.Side("no probes", "ours", {"total_timesteps": 512})
    comp = ab.adding("x", a, "probes", target="<= 1.05", probes=True, probe_budget=0.05)
    assert comp.a is a and comp.target == "<= 1.05"
    assert (comp.b.label, comp.b.case) == ("probes", "ours")
    assert comp.b.params == {"total_timesteps": 512, "probes": True, "probe_budget": 0.05}
    assert a.params == {"total_timesteps": 512}  # A's own parameters are left alone


def test_a_subset_of_comparisons_never_replaces_the_full_results(tmp_path):
    keys = ["a", "b", "c"]
    full = ab.parse_args("d", 3, "x.json", [], keys)
    assert full.only == keys and full.out == ab.RESULTS / "x.json"
    subset = ab.parse_args("d", 3, "x.json", ["--only", "c,a"], keys)
    assert subset.only == ["c", "a"] and subset.out == ab.RESULTS / "x_c_a.json"
    chosen = ab.parse_args(
        "d", 3, "x.json", ["--only", "c", "--out", str(tmp_path / "y.json")], keys
    )
    assert chosen.out == tmp_path / "y.json"


def test_keys_outside_the_default_set_run_only_when_asked(tmp_path):
    keys, default = ["a", "b", "again_a"], ["a", "b"]
    full = ab.parse_args("d", 3, "x.json", [], keys, default)
    assert full.only == default and full.out == ab.RESULTS / "x.json"
    extra = ab.parse_args("d", 3, "x.json", ["--only", "again_a"], keys, default)
    assert extra.only == ["again_a"] and extra.out == ab.RESULTS / "x_again_a.json"
    (sb3_default,) = sampling_overhead.comparisons(True, ["sb3_default"])
    assert sb3_default == sampling_overhead.comparisons(True, ["sb3"])[0]
    assert sb3_default.name == "SB3 + ProbeCallback, default"


def test_sampling_overhead_comparisons():
    comps = sampling_overhead.comparisons(True, ["probe_batch", "widths", "sb3"])
    assert [(c.name, c.a.label, c.b.label, c.target) for c in comps] == [
        ("five probes x 2, probe_batch", "no probes", "probes, probe_batch", "reported"),
        ("width 256, default", "no probes", "probes, default", "<= 1.05"),
        ("width 256, every", "no probes", "probes, every", "reported"),
        ("width 1024, default", "no probes", "probes, default", "<= 1.05"),
        ("width 1024, every", "no probes", "probes, every", "reported"),
        ("SB3 + ProbeCallback, default", "sb3", "+ ProbeCallback, default", "<= 1.05"),
        ("SB3 + ProbeCallback, every", "sb3", "+ ProbeCallback, every", "reported"),
    ]
    batch, _, every, *_, sb3 = comps
    assert batch.a.params == {"total_timesteps": 512, "activation": "relu"}
    assert batch.b.params == {
        "total_timesteps": 512,
        "activation": "relu",
        "probes": True,
        "probe_budget": 0.05,
        "probe_schedule": "probe_batch:256",
    }
    assert every.b.params == {
        "activation": "relu",
        "hidden": 256,
        "total_timesteps": 512,
        "probes": True,
        "probe_budget": None,
        "probe_schedule": "every",
    }
    assert sb3.a.case == sb3.b.case == "sb3"
    assert sb3.b.params == {
        "total_timesteps": 1024,
        "activation": "relu",
        "probe_callback": True,
        "probe_budget": None,
        "probe_schedule": "every",
    }


def test_sampling_overhead_long_runs_at_the_default_only():
    sb3, recipe = {"total_timesteps": 131_072, "activation": "relu"}, {"total_timesteps": 200_000}
    comps = sampling_overhead.comparisons(False, ["sb3_long", "recipe_full"])
    assert [(c.name, c.target, c.a.case, c.b.case, c.a.params, c.b.params) for c in comps] == [
        (
            "SB3 + ProbeCallback, 131072 steps, default",
            "<= 1.05",
            "sb3",
            "sb3",
            sb3,
            {**sb3, "probe_callback": True, "probe_budget": 0.05},
        ),
        (
            "cartpole recipe, 200000 steps, default",
            "<= 1.05",
            "recipe",
            "recipe",
            recipe,
            {**recipe, "probes": True, "probe_budget": 0.05},
        ),
    ]


def test_compile_overhead_smoke(tmp_path):
    """The compiled-policy benchmark end to end with the eager backend (inductor's compile
    is too slow for the suite): every comparison, and dynamo's counts in every run."""
    out = tmp_path / "compile_overhead.json"
    compile_overhead.main(["--quick", "--inprocess", "--backend", "eager", "--out", str(out)])
    payload = json.loads(out.read_text())
    assert [c["a"]["label"] for c in payload["comparisons"]] == [
        "compiled, no probes",
        "compiled, no probes",
        "eager",
        "eager, probes every pass",
    ]
    for comp in payload["comparisons"]:
        for extra in comp["extra_a"] + comp["extra_b"]:
            assert extra["graph_breaks"] == 0
        assert comp["b"]["params"].get("compile_backend", "eager") == "eager"
        assert len(comp["steady_update_ratios_b_over_a"]) == 1
    assert payload["comparisons"][2]["extra_b"][0]["compiled_graphs"] >= 1  # "compiled" ran


def test_cleanrl_style_loop_trains_the_trainers_env_for_whole_rollouts():
    """The GPU table's baseline (a CleanRL ppo_atari-style loop) on the CPU: it counts the
    trainer's steps (whole rollouts of 2 envs x 64 steps) and its losses stay finite."""
    params = {**cases.DEFAULTS, **ab.atari_params(True, 128), "total_timesteps": 300}
    result = cases.CASES["cleanrl_atari"](params)
    assert result["steps"] == 256  # two rollouts of 128; the trainer drops the rest too
    assert result["losses_finite"]


def test_gpu_overhead_sides_run_on_cuda_and_differ_in_probes_or_loop_only():
    comps = {c.name: c for c in gpu_overhead.comparisons(quick=True)}
    assert len(comps) == len(gpu_overhead.KEYS)
    for comp in comps.values():
        assert comp.a.params["device"] == comp.b.params["device"] == "cuda"
    loop = comps["trainer vs CleanRL ppo_atari-style loop, no probes (GPU)"]
    assert (loop.a.case, loop.b.case) == ("cleanrl_atari", "ours")
    assert loop.a.params == loop.b.params
    for name, comp in comps.items():
        if comp is not loop:
            extra = {k: v for k, v in comp.b.params.items() if comp.a.params.get(k) != v}
            assert extra.pop("probes") is True, name
            assert set(extra) <= {"probe_budget"}, name


def test_fisher_conv_routes_agree_and_are_timed(tmp_path):
    out = tmp_path / "routes.json"
    fisher_conv_routes.main(["--batches", "3", "--repeats", "1", "--out", str(out)])
    payload = json.loads(out.read_text())
    assert [r["layer"] for r in payload["rows"]] == ["conv_0", "conv_1", "conv_2"]
    for row in payload["rows"]:
        assert row["correlate_ms"] > 0 and row["unfold_ms"] > 0


@pytest.fixture
def run_dirs(monkeypatch, tmp_path) -> list[str]:
    """The run directories the recipe case makes (``tempfile.mkdtemp(prefix="pp-bench-")``),
    in order, under ``tmp_path``; other temporary folders (W&B's) are left alone."""
    made: list[str] = []
    real_mkdtemp = cases.tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        if kwargs.get("prefix") != "pp-bench-":
            return real_mkdtemp(*args, **kwargs)
        made.append(real_mkdtemp(*args, dir=tmp_path, **kwargs))
        return made[-1]

    monkeypatch.setattr(cases.tempfile, "mkdtemp", mkdtemp)
    return made


def test_the_run_overhead_figure_sums_every_records_overhead_seconds(run_dirs):
    """``run_overhead_fraction`` of the recipe case is the sum of ``probes/overhead_seconds``
    over every record the run wrote (read back from its metrics.jsonl) over the timed
    seconds; a run without probes has none."""
    from policy_probes.records import read_jsonl

    p = dict(cases.DEFAULTS, total_timesteps=2048, probes=True, probe_budget=0.05)
    out = cases.recipe(p)
    records = read_jsonl(f"{run_dirs[-1]}/metrics.jsonl")
    charged = [r["probes/overhead_seconds"] for r in records if "probes/overhead_seconds" in r]
    assert len(charged) == 4  # 2048 steps: 4 epochs, each with its figure
    assert out["run_overhead_fraction"] == pytest.approx(sum(charged) / out["seconds"])
    assert out["overhead_fraction"] == records[-1]["probes/overhead_fraction"]
    bare = cases.recipe(dict(p, probes=False))
    assert bare["run_overhead_fraction"] is None


def test_the_recipe_case_with_the_headline_sinks_writes_the_offline_wandb_run(run_dirs):
    """``recipe_sinks="headline"``: the recipe runs with the console and an offline W&B run
    beside its files, as ``policy-probes run`` starts it; the W&B run holds every epoch the
    JSONL file does. The default ("files") opens no W&B run."""
    from wandb_reader import history_rows, run_file, wandb_records

    from policy_probes.records import read_jsonl

    p = dict(cases.DEFAULTS, total_timesteps=1024, probes=True, probe_budget=0.05)
    cases.recipe(dict(p, recipe_sinks="headline"))
    epochs = [r["epoch"] for r in read_jsonl(f"{run_dirs[-1]}/metrics.jsonl")]
    rows = history_rows(wandb_records(run_file(Path(run_dirs[-1]))))
    assert sorted({row["epoch"] for row in rows if "train/value_loss" in row}) == epochs
    cases.recipe(p)
    assert not (Path(run_dirs[-1]) / "wandb").exists()


def test_the_recipe_case_with_one_component_probes_reports_actor_mlp_alone(run_dirs):
    """``recipe_probes="one_component"`` (the ``recipe_floor`` comparison): the recipe's
    four probes report ``actor_mlp`` and nothing else, no layer inside it and no
    ``critic_mlp``; the recipe's own probes report both components per layer."""
    from policy_probes.records import read_jsonl

    p = dict(cases.DEFAULTS, total_timesteps=1024, probes=True, probe_budget=0.05)

    def reported() -> set[tuple[str, str]]:
        record = read_jsonl(f"{run_dirs[-1]}/metrics.jsonl")[-1]
        parts = [k.split("/") for k in record if k.startswith("probes/")]
        return {(k[1], k[2]) for k in parts if len(k) == 4 and k[1] != "overhead_seconds"}

    cases.recipe(dict(p, recipe_probes="one_component"))
    probes = {"relu", "fisher", "gradient_flow", "relu_gradient_flow"}
    assert reported() == {(probe, "actor_mlp") for probe in probes}
    cases.recipe(p)
    shipped = reported()
    assert {c for _, c in shipped} >= {"actor_mlp", "actor_mlp.layer_0", "critic_mlp"}
    assert {probe for probe, _ in shipped} == probes
    with pytest.raises(ValueError, match="recipe_probes"):
        cases.recipe(dict(p, recipe_probes="two"))


def test_the_sb3_case_with_one_component_probes_reports_actor_mlp_alone():
    """``sb3_floor``: ProbeCallback's five probes on ``actor_mlp`` alone without per-layer
    keys; the ``sb3`` comparison's own probes report both components and their layers."""
    p = dict(cases.DEFAULTS, total_timesteps=512, probe_callback=True, probe_budget=0.05)
    p.update(activation="relu", num_steps=128)
    floor = cases.sb3(dict(p, per_layer=False, probe_components=["actor_mlp"]))
    assert floor["probed_components"] == ["actor_mlp"] and floor["probe_errors"] == []
    shipped = cases.sb3(p)
    components = shipped["probed_components"]
    assert {"actor_mlp", "critic_mlp"} <= set(components)
    assert any(c.startswith("actor_mlp.") for c in components)  # SB3's layers: actor_mlp.1, ...
    assert floor["probe_keys"] < shipped["probe_keys"]
    assert cases.probed_components(
        {"probes/relu/a/dead_fraction": 0.0, "probes/overhead_seconds/report": 1.0, "x/y/z/w": 1}
    ) == ["a"]
