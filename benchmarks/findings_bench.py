"""Labelled findings benchmark: healthy and injected-pathology runs, labelled by
measurements made outside the probes, and the ``policy-probes diagnose`` rules scored on
them (docs/findings.md, "Labelled benchmark").

Every run is ``recipes.cartpole.train_measured`` (every plasticity probe) with the
overrides of one healthy setting of :data:`SETTINGS`, exactly as ``policy-probes run ...
key=value`` would apply them; a pathological run adds one injection of
:mod:`benchmarks.injections` at ``--inject`` on top of its setting. The labels come from
the benchmark's own code: the episode return against the same seed's healthy run, a
trainability test on the checkpoints' weights (Lyle, Rowland, Dabney, ICLR 2022), dead
units on held-out states and the GAE returns' spread recorded from the rollouts. Then each
run's findings (at the end, and the epoch a live ``diagnose`` first showed each) are
scored against the labels.

    nice python -m benchmarks.findings_bench --jobs 2      # make findings-bench
    python -m benchmarks.findings_bench --from-results     # rescore the saved run dirs
"""

from __future__ import annotations

import argparse
import hashlib
import math
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.ab import write_json
from benchmarks.injections import INJECTIONS, RolloutRecorder
from benchmarks.plasticity import (
    command,
    load_results,
    markdown,
    moving_mean,
    plain,
    replay_findings,
    write_doc,
)

RECIPE = "recipes.cartpole.train_measured"
MLPS = ("actor_mlp", "critic_mlp")
BATCH = 4 * 128  # agent steps per epoch (the recipe's 4 envs x 128 steps)
BEGIN, END = "<!-- findings-bench:begin -->", "<!-- findings-bench:end -->"

#: healthy settings: name -> (overrides, gymnasium env id)
SETTINGS: dict[str, tuple[list[str], str]] = {
    "cartpole": ([], "CartPole-v1"),
    "cartpole_const_lr": (
        ["trainer.learning_rate=0.003", "trainer.anneal_lr=false"],
        "CartPole-v1",
    ),
    "acrobot": (
        ["env.id=Acrobot-v1", "trainer.learning_rate=0.003", "trainer.anneal_lr=false"],
        "Acrobot-v1",
    ),
}
#: pathologies: name -> (the healthy setting it is injected on, the injection's arguments)
PATHOLOGIES: dict[str, tuple[str, dict[str, float]]] = {
    "kill_units": ("cartpole", {"fraction": 0.75}),
    "lr_jump": ("cartpole_const_lr", {"factor": 30.0}),
    "reward_scale": ("cartpole_const_lr", {"factor": 100.0}),
    "obs_shift": ("acrobot", {"shift": 5.0, "scale": 3.0}),
    "permute_obs": ("cartpole_const_lr", {}),
    "reward_flip": ("cartpole", {}),
}
HEALTHY = "healthy"

# ---- label criteria, fixed before any finding was looked at (docs/findings.md)
LAST = 30  # epochs of the final return
HARM = 0.8  # harmed: final return above random below 80 % of the healthy run's
ROLL = 10  # epochs of the rolling mean of the decline epoch
LOST_RATIO = 1.5  # plasticity lost: trainability ratio >= 1.5 and above every healthy run's
DEAD = 0.25  # dead on held-out: >= 25 % of the hidden units, and above every healthy run's
SCALE_GREW = 4.0  # value-target scale grew: GAE-return std >= 4 x the healthy run's

# ---- the trainability test
HELDOUT = 2048  # held-out states, from a uniformly random policy
FIT_STEPS = 200  # Adam steps of each regression
FIT_LR = 1e-3
TARGETS = 3  # random target networks
FRESH = 2  # fresh initialisations per target
TARGET_DIM = 4  # outputs of the target network


# ====================================================================== labels
def heldout_states(env_id: str, seed: int, n: int = HELDOUT) -> tuple[np.ndarray, float]:
    """``n`` states visited by a uniformly random policy in ``env_id`` (seeded with
    ``seed``; fixed per setting and seed) and the mean return of its finished episodes
    (the random baseline of the harm label)."""
    import gymnasium as gym

    env = gym.make(env_id)
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=10_000 + seed)
    states, returns, ret = [], [], 0.0
    while len(states) < n:
        states.append(obs)
        obs, r, term, trunc, _ = env.step(env.action_space.sample())
        ret += float(r)
        if term or trunc:
            returns.append(ret)
            obs, ret = env.reset()[0], 0.0
    env.close()
    return np.asarray(states, dtype=np.float32), float(np.mean(returns)) if returns else ret


def hidden_layers(state_dict: dict[str, torch.Tensor], mlp: str) -> list[torch.Tensor]:
    """The hidden layers of ``mlp`` in a policy's state dict, as ``[W0, b0, W1, b1, ...]``
    (``<mlp>.layer_<i>.linear.weight/bias``)."""
    out, i = [], 0
    while f"{mlp}.layer_{i}.linear.weight" in state_dict:
        prefix = f"{mlp}.layer_{i}.linear"
        out += [state_dict[f"{prefix}.weight"].float(), state_dict[f"{prefix}.bias"].float()]
        i += 1
    if not out:
        raise KeyError(f"no hidden layer {mlp}.layer_0.linear in the state dict")
    return out


def features(params: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    """The ReLU output of every hidden layer ``params`` (``[W0, b0, ...]``) on ``x``."""
    outs = []
    for w, b in zip(params[::2], params[1::2], strict=True):
        x = torch.relu(x @ w.T + b)
        outs.append(x)
    return outs


def dead_fraction(params: list[torch.Tensor], states: np.ndarray) -> float:
    """The fraction of hidden units (all layers) whose ReLU output is 0 on every state."""
    with torch.no_grad():
        outs = features(params, torch.as_tensor(states, dtype=torch.float32))
    dead = sum(int((h <= 0).all(0).sum()) for h in outs)
    return dead / sum(h.shape[1] for h in outs)


def fresh_layers(shapes: list[torch.Size], generator: torch.Generator) -> list[torch.Tensor]:
    """A fresh initialisation of hidden layers of ``shapes`` (weights, biases): orthogonal
    weights of gain sqrt(2) and zero biases (the trainer's initialisation)."""
    out = []
    for shape in shapes:
        if len(shape) == 2:
            w = torch.empty(shape)
            torch.nn.init.orthogonal_(w, math.sqrt(2), generator=generator)
            out.append(w)
        else:
            out.append(torch.zeros(shape))
    return out


def fit_loss(
    params: list[torch.Tensor],
    states: torch.Tensor,
    targets: torch.Tensor,
    generator: torch.Generator,
    steps: int = FIT_STEPS,
) -> float:
    """The final mean squared error of the hidden layers ``params`` (trained, from their
    values) plus a fresh linear head (orthogonal init, gain 1) regressing ``targets`` on
    ``states`` with ``steps`` full-batch Adam steps (lr :data:`FIT_LR`)."""
    width = params[-1].shape[0]
    head_w = torch.empty(targets.shape[1], width)
    torch.nn.init.orthogonal_(head_w, 1.0, generator=generator)
    trained = [p.detach().clone().requires_grad_(True) for p in params]
    trained += [head_w.requires_grad_(True), torch.zeros(targets.shape[1], requires_grad=True)]
    opt = torch.optim.Adam(trained, lr=FIT_LR)

    def loss() -> torch.Tensor:
        h = features(trained[:-2], states)[-1]
        return (h @ trained[-2].T + trained[-1] - targets).square().mean()

    for _ in range(steps):
        opt.zero_grad()
        value = loss()
        value.backward()
        opt.step()
    with torch.no_grad():
        return float(loss())


def trainability(
    params: list[torch.Tensor],
    states: np.ndarray,
    seed: int,
    steps: int = FIT_STEPS,
    targets: int = TARGETS,
    fresh: int = FRESH,
) -> dict[str, float]:
    """Lyle, Rowland & Dabney's (ICLR 2022) capacity test: the final loss of ``params``'
    hidden layers with a fresh head regressing the outputs of a freshly initialised random
    network of the same architecture (standardised per output) on ``states``, against
    fresh initialisations trained the same way; ``ratio`` = checkpoint loss / fresh loss
    (means over ``targets`` target networks and ``fresh`` fresh inits each; all seeded by
    ``seed``). Above 1: the weights fit new targets worse than a fresh network."""
    x = torch.as_tensor(states, dtype=torch.float32)
    shapes = [p.shape for p in params]
    key = (
        hashlib.sha1(x.numpy().tobytes()).hexdigest(),
        tuple(shapes),
        seed,
        steps,
        targets,
        fresh,
    )
    ckpt, new = [], []
    with torch.enable_grad():
        for k in range(targets):
            y = target_outputs(shapes, x, torch.Generator().manual_seed(1000 * seed + k))
            head = torch.Generator().manual_seed(1000 * seed + 100 + k)
            ckpt.append(fit_loss(params, x, y, head, steps))
            if key not in _FRESH:
                for j in range(fresh):
                    g = torch.Generator().manual_seed(1000 * seed + 200 + 10 * k + j)
                    new.append(fit_loss(fresh_layers(shapes, g), x, y, g, steps))
    if key not in _FRESH:  # the fresh networks' loss depends on the states alone
        _FRESH[key] = float(np.mean(new))
    loss, fresh_loss = float(np.mean(ckpt)), _FRESH[key]
    return {"loss": loss, "fresh_loss": fresh_loss, "ratio": loss / max(fresh_loss, 1e-12)}


#: the fresh networks' mean loss per (states, architecture, seed, steps, targets, fresh):
#: the same for every checkpoint measured on the same states (a worker runs many runs)
_FRESH: dict[tuple, float] = {}


def target_outputs(
    shapes: list[torch.Size], x: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """The outputs on ``x`` of a freshly initialised random network with hidden layers of
    ``shapes`` and a :data:`TARGET_DIM`-output linear head (orthogonal, gain 1),
    standardised per output."""
    params = fresh_layers(shapes, generator)
    head = torch.empty(TARGET_DIM, shapes[-1][0])
    torch.nn.init.orthogonal_(head, 1.0, generator=generator)
    with torch.no_grad():
        y = features(params, x)[-1] @ head.T
        return (y - y.mean(0)) / (y.std(0) + 1e-6)


def measure_checkpoint(path: Path, states: np.ndarray, seed: int) -> dict[str, Any]:
    """Trainability and held-out dead fraction of each MLP of the checkpoint at ``path``."""
    from trainers.checkpoint import load_checkpoint

    sd = load_checkpoint(path)["policy"]
    out: dict[str, Any] = {}
    for mlp in MLPS:
        params = hidden_layers(sd, mlp)
        name = mlp.removesuffix("_mlp")
        out[f"dead_{name}"] = dead_fraction(params, states)
        out.update({f"{k}_{name}": v for k, v in trainability(params, states, seed).items()})
    return out


# ====================================================================== runs
def run_name(setting: str, pathology: str, seed: int) -> str:
    return f"{setting}-{pathology}-seed{seed}"


def run_overrides(setting: str, seed: int, epochs: int, inject: int, run_dir: Path) -> list[str]:
    """The overrides of one run: seed, length, run directory, checkpoints just before the
    injection (``inject - 1``, every that many epochs) and at the end, no console, CSV,
    TensorBoard or W&B, then the setting's own."""
    return [
        f"seed={seed}",
        f"run_dir={run_dir}",
        f"trainer.total_timesteps={epochs * BATCH}",
        f"checkpoint.every_epochs={inject - 1}",
        "checkpoint.at_end=true",
        "checkpoint.keep_last=100",
        "sinks.console=false",
        "sinks.csv=false",
        "sinks.tensorboard=false",
        "wandb.mode=disabled",
        *SETTINGS[setting][0],
    ]


def read_series(run_dir: Path, epochs: int) -> dict[str, list[float]]:
    """Per epoch: the training episode return (the trainer's record) and the benchmark's
    own rollout measurements (``labels.jsonl``); NaN where an epoch has none."""
    import json

    from policy_probes.records import RunRecords

    ret = RunRecords.read(run_dir).scalars.get("rollout/episode_return", {})
    out = {"return": [float(ret.get(e, math.nan)) for e in range(1, epochs + 1)]}
    lines = [json.loads(x) for x in (run_dir / "labels.jsonl").read_text().splitlines()]
    by_epoch = {line["epoch"]: line for line in lines}
    for key in ("reward_abs", "return_std", "return_abs", "obs_abs", "lr"):
        out[key] = [float(by_epoch.get(e, {}).get(key, math.nan)) for e in range(1, epochs + 1)]
    return out


def run_one(job: tuple[str, str, int, int, int, str]) -> dict[str, Any]:
    """Train one run (a setting, with a pathology or healthy) and measure its labels."""
    setting, pathology, seed, epochs, inject, out_root = job
    from policy_probes.overrides import apply_overrides
    from policy_probes.recipe_launch import load_recipe
    from trainers.checkpoint import list_checkpoints

    torch.set_num_threads(1)
    run_dir = Path(out_root) / run_name(setting, pathology, seed)
    tool = apply_overrides(
        load_recipe(RECIPE)(), run_overrides(setting, seed, epochs, inject, run_dir)
    )
    injection = None
    if pathology != HEALTHY:
        injection = INJECTIONS[pathology](inject, seed, **PATHOLOGIES[pathology][1])
        tool.add_trainer_hook(injection)
    run_dir.mkdir(parents=True, exist_ok=True)
    tool.add_trainer_hook(RolloutRecorder(run_dir / "labels.jsonl"))
    t0 = time.perf_counter()
    error = None
    try:
        tool.invoke(overwrite=True)
    except Exception as exc:  # a run the pathology crashed is a labelled run too
        error = f"{type(exc).__name__}: {exc}"
    wall = time.perf_counter() - t0
    states, random_return = heldout_states(SETTINGS[setting][1], seed)
    measures: dict[str, Any] = {}
    for ckpt in list_checkpoints(run_dir / "checkpoints"):
        epoch = int(ckpt.stem.split("_")[-1])
        if epoch not in (inject - 1, epochs):
            continue
        seen = states if injection is None or epoch < inject else injection.observe(states)
        when = "inject" if epoch == inject - 1 else "end"
        m = measure_checkpoint(ckpt, seen, seed)
        measures.update({f"{k}_{when}": v for k, v in m.items()})
    return {
        "setting": setting,
        "pathology": pathology,
        "seed": seed,
        "run_dir": str(run_dir),
        "wall_seconds": wall,
        "error": error,
        "random_return": random_return,
        **measures,
        **read_series(run_dir, epochs),
    }


# ====================================================================== labelling
def decline_epoch(
    ret: list[float], healthy: list[float], baseline: float, inject: int
) -> int | None:
    """The first epoch from ``inject`` on whose ``ROLL``-epoch rolling mean return, above
    the random ``baseline``, is below ``HARM`` of the healthy run's at the same epoch."""
    mine = moving_mean(np.asarray(ret, dtype=float), ROLL) - baseline
    ref = moving_mean(np.asarray(healthy, dtype=float), ROLL) - baseline
    for e in range(inject, len(ret) + 1):
        if np.isfinite(mine[e - 1]) and np.isfinite(ref[e - 1]) and mine[e - 1] < HARM * ref[e - 1]:
            return e
    return None


def final_return(ret: list[float]) -> float:
    with np.errstate(all="ignore"):
        return float(np.nanmean(np.asarray(ret[-LAST:], dtype=float)))


def label_runs(runs: list[dict[str, Any]], inject: int) -> None:
    """Add every run's labels (``labels``), from its measurements and those of the healthy
    run of its setting and seed, with the criteria fixed above."""
    healthy = {(r["setting"], r["seed"]): r for r in runs if r["pathology"] == HEALTHY}
    worst: dict[tuple[str, str], float] = {}  # (setting, measure) -> max over healthy runs
    for r in healthy.values():
        for key in ("ratio_actor_end", "ratio_critic_end", "dead_actor_end", "dead_critic_end"):
            v = r.get(key, math.nan)
            worst[(r["setting"], key)] = max(worst.get((r["setting"], key), -math.inf), v)
    for r in runs:
        ref = healthy.get((r["setting"], r["seed"]))
        base = r["random_return"]
        final = final_return(r["return"]) - base
        lab: dict[str, Any] = {"final_return": final + base}
        if ref is None or r["pathology"] == HEALTHY:
            lab["return_vs_healthy"] = 1.0
            lab["harms_learning"] = False
            lab["decline_epoch"] = None
            lab["return_std_vs_healthy"] = 1.0
        else:
            ref_final = final_return(ref["return"]) - base
            learnt = ref_final > 0  # else the healthy run never beat random: no harm label
            lab["return_vs_healthy"] = final / ref_final if learnt else math.nan
            lab["harms_learning"] = bool(final < HARM * ref_final) if learnt else None
            lab["decline_epoch"] = (
                decline_epoch(r["return"], ref["return"], base, inject) if learnt else None
            )
            with np.errstate(all="ignore"):
                after = np.nanmean(np.asarray(r["return_std"][inject - 1 :], float))
                ref_after = np.nanmean(np.asarray(ref["return_std"][inject - 1 :], float))
            lab["return_std_vs_healthy"] = float(after / ref_after) if ref_after > 0 else math.nan
        lab["value_target_scale_grew"] = bool(lab["return_std_vs_healthy"] >= SCALE_GREW)
        lost, dead = [], []
        for name in ("actor", "critic"):
            ratio = r.get(f"ratio_{name}_end", math.nan)
            bound = worst.get((r["setting"], f"ratio_{name}_end"), math.inf)
            if ratio >= LOST_RATIO and (r["pathology"] == HEALTHY or ratio > bound):
                lost.append(name)
            frac = r.get(f"dead_{name}_end", math.nan)
            bound = worst.get((r["setting"], f"dead_{name}_end"), math.inf)
            if frac >= DEAD and (r["pathology"] == HEALTHY or frac > bound):
                dead.append(name)
        lab["plasticity_lost"] = lost
        lab["dead_on_heldout"] = dead
        r["labels"] = lab


# ====================================================================== findings
def first_fires(run_dir: Path) -> list[dict[str, Any]]:
    """Every finding at the run's end (rule, tier, component, onset, last epoch) with the
    first epoch at which a live ``diagnose`` of the records up to that epoch showed it
    (:func:`benchmarks.plasticity.replay_findings`, with the run's own rules)."""
    from policy_probes.analysis.findings import run_rules

    first, end = replay_findings(run_dir, run_rules(run_dir))
    return [
        {
            "rule": f.rule,
            "tier": f.tier,
            "component": f.component,
            "onset_epoch": f.onset_epoch,
            "last_epoch": f.last_epoch,
            "first_epoch": first.get((f.rule, f.component), f.onset_epoch),
        }
        for f in end
    ]


def score(runs: list[dict[str, Any]], inject: int) -> dict[str, Any]:
    """The rules against the labels. Per (rule, tier): healthy runs it flags; per
    pathology, the harmed runs carrying it (recall); median onset delay after the
    injection and median lead over the return's decline (decline epoch - first-fire
    epoch; positive: the finding came first). Per tier: healthy runs with any finding and,
    per pathology, seeds with a finding whose onset is at or after the injection."""
    healthy = [r for r in runs if r["pathology"] == HEALTHY]
    pathologies = sorted({r["pathology"] for r in runs} - {HEALTHY})
    kinds = sorted({(f["rule"], f["tier"]) for r in runs for f in r.get("findings", [])})
    rules: dict[str, Any] = {}
    for rule, tier in kinds:

        def carrying(r: dict[str, Any], rule: str = rule, tier: str = tier) -> list[dict]:
            return [f for f in r.get("findings", []) if f["rule"] == rule and f["tier"] == tier]

        entry: dict[str, Any] = {
            "rule": rule,
            "tier": tier,
            "healthy_flagged": sum(bool(carrying(r)) for r in healthy),
            "healthy_runs": len(healthy),
            "recall": {},
        }
        delays, leads, after = [], [], [0, 0]
        for p in pathologies:
            harmed = [r for r in runs if r["pathology"] == p and r["labels"]["harms_learning"]]
            entry["recall"][p] = [sum(bool(carrying(r)) for r in harmed), len(harmed)]
            after[0] += sum(any(f["onset_epoch"] >= inject for f in carrying(r)) for r in harmed)
            after[1] += len(harmed)
            for r in (r for r in runs if r["pathology"] == p):
                found = carrying(r)
                if not found:
                    continue
                delays.append(min(f["onset_epoch"] for f in found) - inject)
                decline = r["labels"]["decline_epoch"]
                if decline is not None:
                    leads.append(decline - min(f["first_epoch"] for f in found))
        #: harmed runs (all pathologies) carrying it with an onset at or after the injection
        entry["harmed_from_injection"] = after
        entry["onset_delay_median"] = float(np.median(delays)) if delays else None
        entry["onset_delays"] = delays
        entry["lead_median"] = float(np.median(leads)) if leads else None
        entry["leads"] = leads
        rules[f"{rule}/{tier}"] = entry
    tiers: dict[str, Any] = {}
    for tier in sorted({t for _, t in kinds} | {"finding"}):

        def any_of(r: dict[str, Any], tier: str = tier, after: bool = False) -> bool:
            return any(
                f["tier"] == tier and (not after or f["onset_epoch"] >= inject)
                for f in r.get("findings", [])
            )

        per = {}
        for p in pathologies:
            mine = [r for r in runs if r["pathology"] == p]
            per[p] = {
                "seeds": len(mine),
                "harmed": sum(bool(r["labels"]["harms_learning"]) for r in mine),
                "with_finding_after_injection": sum(any_of(r, after=True) for r in mine),
            }
        tiers[tier] = {
            "healthy_with_any": sum(any_of(r) for r in healthy),
            "healthy_runs": len(healthy),
            "pathologies": per,
        }
    return {"rules": rules, "tiers": tiers}


# ====================================================================== tables
def _f(v: Any, fmt: str = "{:.2f}") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return fmt.format(v)


def label_table(runs: list[dict[str, Any]]) -> str:
    """One row per run: its labels and the measurements behind them."""
    rows = []
    for r in runs:
        lab = r["labels"]
        rows.append(
            [
                r["setting"],
                r["pathology"],
                str(r["seed"]),
                _f(lab["final_return"], "{:.0f}"),
                _f(lab["return_vs_healthy"]),
                {True: "yes", False: "no", None: "n/a (healthy run at random)"}[
                    lab["harms_learning"]
                ],
                _f(lab["decline_epoch"], "{}"),
                f"{_f(r.get('ratio_actor_inject'))} / {_f(r.get('ratio_critic_inject'))}",
                f"{_f(r.get('ratio_actor_end'))} / {_f(r.get('ratio_critic_end'))}",
                ", ".join(lab["plasticity_lost"]) or "no",
                f"{_f(r.get('dead_actor_end'))} / {_f(r.get('dead_critic_end'))}",
                ", ".join(lab["dead_on_heldout"]) or "no",
                _f(lab["return_std_vs_healthy"]),
                "yes" if lab["value_target_scale_grew"] else "no",
            ]
        )
    head = [
        "setting",
        "pathology",
        "seed",
        f"return, last {LAST}",
        "vs healthy (above random)",
        "harms",
        "decline epoch",
        "trainability ratio at injection, actor / critic",
        "ratio at end",
        "plasticity lost",
        "dead on held-out at end",
        "dead label",
        "GAE-return std vs healthy",
        "target scale grew",
    ]
    return markdown(head, rows)


def rules_table(scored: dict[str, Any], pathologies: list[str]) -> str:
    """One row per rule and tier: healthy runs flagged, recall per pathology, delays."""
    rows = []
    for e in scored["rules"].values():
        rows.append(
            [
                e["rule"],
                e["tier"],
                f"{e['healthy_flagged']}/{e['healthy_runs']}",
                *(f"{k}/{n}" for k, n in (e["recall"].get(p, [0, 0]) for p in pathologies)),
                "{}/{}".format(*e["harmed_from_injection"]),
                _f(e["onset_delay_median"], "{:+.0f}"),
                _f(e["lead_median"], "{:+.0f}"),
            ]
        )
    head = [
        "rule",
        "tier",
        "healthy runs flagged",
        *(f"recall, {p} (of harmed)" for p in pathologies),
        "harmed runs with onset >= injection",
        "median onset - injection",
        "median lead over decline",
    ]
    return markdown(head, rows) if rows else "(no finding in any run)"


def summary_lines(scored: dict[str, Any]) -> str:
    """Per tier: healthy runs with any finding and, per pathology, seeds with one whose
    onset is at or after the injection."""
    lines = []
    for tier, t in scored["tiers"].items():
        per = "; ".join(
            f"{p} {v['with_finding_after_injection']}/{v['seeds']} (harmed {v['harmed']})"
            for p, v in t["pathologies"].items()
        )
        lines.append(
            f"- **{tier}** tier: healthy runs with any: {t['healthy_with_any']}/"
            f"{t['healthy_runs']} (goal <= 1); seeds with one from the injection on: {per} "
            f"(goal >= 3 of 4 where harmed)"
        )
    return "\n".join(lines)


def block(data: dict[str, Any], scored: dict[str, Any]) -> str:
    runs = data["runs"]
    pathologies = sorted({r["pathology"] for r in runs} - {HEALTHY})
    return (
        f"Reproduce: `nice {data['command']}` ({len(runs)} runs, "
        f"{data['wall_seconds'] / 60:.1f} min wall with --jobs {data['jobs']}); rescore "
        f"the saved runs with `python -m benchmarks.findings_bench --from-results`. "
        f"{data['epochs']} epochs of 512 agent steps, injection at epoch {data['inject']}.\n\n"
        f"{summary_lines(scored)}\n\n"
        f"Rules against the labels:\n\n{rules_table(scored, pathologies)}\n\n"
        f"Labels of every run:\n\n{label_table(runs)}"
    )


# ====================================================================== command line
def jobs_of(seeds: list[int], pathologies: list[str], epochs: int, inject: int, out: str) -> list:
    """The runs: every healthy setting a pathology needs (all settings when it is in
    ``pathologies`` as ``healthy``), then each pathology, for every seed."""
    settings = list(SETTINGS) if HEALTHY in pathologies else []
    settings += [PATHOLOGIES[p][0] for p in pathologies if p != HEALTHY]
    jobs = [
        (s, HEALTHY, seed, epochs, inject, out) for s in dict.fromkeys(settings) for seed in seeds
    ]
    for p in pathologies:
        if p != HEALTHY:
            jobs += [(PATHOLOGIES[p][0], p, seed, epochs, inject, out) for seed in seeds]
    return jobs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", default="1,2,3,4", help="comma-separated seeds")
    p.add_argument("--epochs", type=int, default=100, help="epochs per run (512 steps each)")
    p.add_argument("--inject", type=int, default=50, help="first epoch under the pathology")
    names = [HEALTHY, *PATHOLOGIES]
    p.add_argument("--runs", default=",".join(names), help=f"comma-separated, of {names}")
    p.add_argument("--jobs", type=int, default=2, help="parallel processes (one core each)")
    p.add_argument("--out", default="runs/findings-bench", help="run directories go here")
    p.add_argument("--results", default="benchmarks/results/findings_bench.json")
    p.add_argument("--doc", default="docs/findings.md")
    p.add_argument(
        "--from-results",
        action="store_true",
        help="train nothing: rescore the runs of --results (their findings read again from "
        "the run directories' metrics.jsonl when present) and rewrite the table",
    )
    args = p.parse_args(argv)
    if args.from_results:
        data = load_results(Path(args.results))
    else:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        chosen = [n.strip() for n in args.runs.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in names]
        if unknown or not seeds or not 1 < args.inject <= args.epochs:
            p.error(f"unknown runs {unknown} (of {names}), no seeds, or --inject not in 2..epochs")
        jobs = jobs_of(seeds, chosen, args.epochs, args.inject, args.out)
        t0 = time.perf_counter()
        if args.jobs == 1:
            runs = [run_one(j) for j in jobs]
        else:
            with mp.get_context("spawn").Pool(args.jobs) as pool:
                runs = pool.map(run_one, jobs, chunksize=1)
        data = {
            "command": command("benchmarks.findings_bench", argv),
            "settings": {k: v[0] for k, v in SETTINGS.items()},
            "pathologies": {k: {"setting": v[0], **v[1]} for k, v in PATHOLOGIES.items()},
            "seeds": seeds,
            "epochs": args.epochs,
            "inject": args.inject,
            "jobs": args.jobs,
            "wall_seconds": time.perf_counter() - t0,
            "runs": runs,
        }
    runs = data["runs"]
    for r in runs:
        if (Path(r["run_dir"]) / "metrics.jsonl").is_file():
            r["findings"] = first_fires(Path(r["run_dir"]))
    label_runs(runs, data["inject"])
    scored = score(runs, data["inject"])
    data["score"] = scored
    write_json(Path(args.results), {**data, "runs": [plain(r) for r in runs]}, None)
    write_doc(Path(args.doc), block(data, scored), BEGIN, END)
    print(summary_lines(scored))
    print(rules_table(scored, sorted({r["pathology"] for r in runs} - {HEALTHY})))
    print(f"tables: {args.doc}; results: {args.results}; run dirs: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
