"""Probe overhead and trainer speed on a CUDA GPU: the GPU rows of docs/benchmarks.md.

Every side on ``device=cuda``: the cartpole recipe (``recipe``, ``recipe_every``) and the
Atari recipe's probes on Breakout (``atari``, ``atari_every``) against no probes, at the
default sampling and at every pass; and (``cleanrl``) the trainer without probes against
the CleanRL ``ppo_atari.py``-style loop of :mod:`benchmarks.cleanrl_style` (ratio > 1:
the trainer is slower). Sides whose probes a fault disabled list them under
``probe_errors``.

    python -m benchmarks.gpu_overhead [--quick] [--repeats N] [--out PATH] [--only KEYS]
"""

from __future__ import annotations

from typing import Any

from benchmarks.ab import Comparison, Side, adding, atari_params, measure_and_record, parse_args

KEYS = ["recipe", "recipe_every", "atari", "atari_every", "cleanrl"]
DEFAULT = {"probe_budget": 0.05, "probe_schedule": None}
EVERY = {"probe_budget": None, "probe_schedule": None}
CUDA = {"device": "cuda"}


def comparisons(quick: bool, only: list[str] | None = None) -> list[Comparison]:
    recipe = Side(
        "recipe, no probes", "recipe", {"total_timesteps": 2048 if quick else 8192, **CUDA}
    )
    atari = dict(atari_params(quick, total_timesteps=4096), **CUDA)
    bare_atari = Side("no probes", "ours", atari)
    name = "Atari recipe (NatureCNN)"
    comps = {
        "recipe": adding(
            "cartpole recipe, default (GPU)", recipe, "recipe", probes=True, **DEFAULT
        ),
        "recipe_every": adding(
            "cartpole recipe, every pass (GPU)", recipe, "recipe", probes=True, **EVERY
        ),
        "atari": adding(f"{name}, default (GPU)", bare_atari, "probes", probes=True, **DEFAULT),
        "atari_every": adding(
            f"{name}, every pass (GPU)", bare_atari, "probes", probes=True, **EVERY
        ),
        "cleanrl": Comparison(
            "trainer vs CleanRL ppo_atari-style loop, no probes (GPU)",
            Side("cleanrl-style", "cleanrl_atari", atari),
            Side("trainer", "ours", atari),
        ),
    }
    return [comps[k] for k in (only or KEYS)]


def gpu() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_overhead needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 3, "gpu_overhead.json", argv, KEYS)
    device = gpu()
    print(device)
    measure_and_record(args, comparisons(args.quick, args.only), f"GPU ({device['gpu']})")


if __name__ == "__main__":
    main()
