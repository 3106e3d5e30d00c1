"""``policy-probes trainability RUN_DIR``: the trainability probe's measurement from a run's
checkpoints (docs/probes/trainability.md).

The policy is rebuilt the way ``resume`` and ``fork`` rebuild it (the recipe recorded in
``config.json`` with its overrides; the tool's ``build_policy()``), the checkpoint's
parameters loaded into it, and each component's copy fits the same new random targets
on the checkpoint's reference states, against the same fresh initialisations, as the
probe does at that epoch: the same numbers for a run measured on the CPU.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from policy_probes.user_errors import CLIError, positive_int

#: end-of-epoch checkpoints (``epoch_<E>.pt``; mid-epoch ones hold ``-step_``)
EPOCH_FILE = re.compile(r"^epoch_(\d+)\.pt$")


def epoch_checkpoints(run_dir: Path) -> dict[int, Path]:
    """``epoch -> path`` of the run's end-of-epoch checkpoints, in order."""
    folder = run_dir / "checkpoints"
    found = {
        int(m.group(1)): p
        for p in (folder.glob("epoch_*.pt") if folder.is_dir() else ())
        if (m := EPOCH_FILE.match(p.name))
    }
    return dict(sorted(found.items()))


def chosen_checkpoints(run_dir: Path, epoch: int | None, every: bool) -> dict[int, Path]:
    """The checkpoints to measure: ``epoch``'s, all of them, or the last."""
    found = epoch_checkpoints(run_dir)
    if not found:
        raise CLIError(
            f"{run_dir} holds no end-of-epoch checkpoint (checkpoints/epoch_<E>.pt); give "
            f"the directory of a run trained with checkpoints"
        )
    if epoch is not None:
        if epoch not in found:
            raise CLIError(
                f"{run_dir} has no checkpoint of the end of epoch {epoch}; checkpointed "
                f"epochs: {', '.join(map(str, found))}"
            )
        return {epoch: found[epoch]}
    if every:
        return found
    last = max(found)
    return {last: found[last]}


def rebuild_policy(run_dir: Path) -> Any:
    """The run's policy, built from its recorded recipe and overrides (no probes)."""
    from policy_probes.overrides import apply_overrides
    from policy_probes.recipe_launch import build_from_recipe, call_tool, read_run_config

    config, target = read_run_config(
        run_dir, "measure it with trainability_check.measure_checkpoint(policy, path, components)"
    )
    overrides = [o for o in config.get("overrides", []) if o.partition("=")[0].strip() != "run_dir"]
    tool = call_tool(apply_overrides, build_from_recipe(target), overrides)
    build = getattr(tool, "build_policy", None)
    if not callable(build):
        raise CLIError(
            f"recipe {target} returned {type(tool).__name__}, which has no build_policy(); "
            f"the trainability check rebuilds the policy through it"
        )
    return call_tool(build)


def component_module(policy: Any, name: str) -> Any:
    """The component ``name`` of ``policy``: a clear error naming the others if absent."""
    get = getattr(policy, "get_component", None)
    try:
        return get(name) if callable(get) else policy.get_submodule(name)
    except (AttributeError, KeyError, ValueError) as exc:
        known = list(getattr(policy, "components", None) or [])
        raise CLIError(
            f"the policy has no component {name!r}"
            + (f"; its components: {', '.join(known)}" if known else "")
        ) from exc


def measure_checkpoint(
    policy: Any, path: Path, components: list[str] | None
) -> list[dict[str, Any]]:
    """One row per component (``component``, ``loss``, ``fresh_loss``, ``ratio``) of the
    checkpoint at ``path``, its parameters loaded into ``policy`` (on the CPU)."""
    import torch

    from policy_probes.probes.trainability import check_input, check_settings, measure_module
    from policy_probes.reference_states import ReferenceStates, evenly_spaced

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CLIError(f"{path} cannot be read as a checkpoint ({exc})") from exc
    session = ckpt.get("session") or {}
    saved = (session.get("trackers") or {}).get("trainability") or {}
    settings = dict(saved.get("settings") or {})
    names = components or list(settings)
    if not names:
        raise CLIError(
            "the run did not attach the trainability probe; name the components to "
            "measure with --components (e.g. --components actor_mlp,critic_mlp)"
        )
    reference = ReferenceStates()
    reference.load_state_dict(session.get("reference_states") or {})
    if reference.observations is None:
        raise CLIError(
            f"{path.name} holds no reference states (the run attached no probe that reads "
            f"them, or predates them); fork it with the probe attached, e.g. `policy-probes "
            f"fork RUN_DIR --epoch N NEW_DIR probes='[\"trainability@actor_mlp\"]'`, whose "
            f"checkpoints then carry a reference set"
        )
    try:
        policy.load_state_dict(ckpt["policy"])
    except (KeyError, RuntimeError) as exc:
        raise CLIError(f"{path.name}'s parameters do not fit the rebuilt policy ({exc})") from exc
    modules = {name: component_module(policy, name) for name in names}
    reference.forward = policy
    rows = int(reference.observations.shape[0])
    inputs = reference.capture(modules, None, inputs=True)
    out = []
    for name in names:
        cfg = check_settings(settings.get(name) or {})
        try:
            x = check_input(inputs.get(name), rows, name)
        except (TypeError, ValueError) as exc:
            raise CLIError(str(exc)) from exc
        x = evenly_spaced(x, cfg["reference_rows"])
        loss_t, fresh_t = measure_module(name, modules[name], x, cfg)
        loss, fresh = float(loss_t), float(fresh_t)
        out.append(
            {
                "component": name,
                "loss": loss,
                "fresh_loss": fresh,
                "ratio": loss / fresh if fresh > 0 else 0.0,
            }
        )
    return out


def trainability_series(
    run_dir: Path,
    *,
    epoch: int | None = None,
    every: bool = False,
    components: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Rows ``epoch, component, loss, fresh_loss, ratio`` for the chosen checkpoints of
    the run in ``run_dir`` (the last; ``epoch``'s; ``every``: all of them)."""
    if not run_dir.is_dir():
        raise CLIError(f"{run_dir} does not exist; give the directory of a training run")
    chosen = chosen_checkpoints(run_dir, epoch, every)
    policy = rebuild_policy(run_dir)
    return [
        {"epoch": e, **row}
        for e, path in chosen.items()
        for row in measure_checkpoint(policy, path, components)
    ]


def render_text(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'epoch':>6}  {'component':<24} {'loss':>9} {'fresh_loss':>10} {'ratio':>7}"]
    lines += [
        f"{r['epoch']:>6}  {r['component']:<24} {r['loss']:>9.4f} {r['fresh_loss']:>10.4f} "
        f"{r['ratio']:>7.3f}"
        for r in rows
    ]
    lines.append("ratio > 1: the component fits new targets worse than fresh networks do")
    return "\n".join(lines)


def add_trainability_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """``policy-probes trainability RUN_DIR [--epoch N | --all] [--components A,B] [--json]``."""
    p = subparsers.add_parser(
        "trainability",
        help="how well a checkpoint's components still fit new targets (Lyle et al. 2022)",
        description="Load RUN_DIR's checkpoint (the last, --epoch N, or --all), rebuild the "
        "policy from the recorded recipe, and measure the trainability probe's loss, "
        "fresh_loss and ratio on the checkpoint's reference states for the components the "
        "run attached it to (or --components); docs/probes/trainability.md.",
    )
    p.add_argument("run_dir", type=Path, help="the run directory")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--epoch", type=positive_int, help="the checkpoint of this epoch's end")
    which.add_argument("--all", action="store_true", help="every end-of-epoch checkpoint")
    p.add_argument(
        "--components", help="comma-separated components (default: the run's probed ones)"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(handler=trainability_command)


def trainability_command(args: argparse.Namespace) -> int:
    names = [c.strip() for c in (args.components or "").split(",") if c.strip()] or None
    rows = trainability_series(args.run_dir, epoch=args.epoch, every=args.all, components=names)
    print(json.dumps(rows, indent=2) if args.json else render_text(rows))
    return 0
