"""Probe overhead by design (issue 13): the five probes under the default overhead budget,
at every pass, and with a probe batch; widths 64/256/1024; SB3 + ProbeCallback.

Probe-free (A) against probed (B), B sampled as in :data:`SAMPLING`. ``--only`` keys:
``default``, ``every``, ``probe_batch`` (the five probes x 2 on the CartPole ReLU MLPs),
``widths`` (default and every pass at 256 and 1024), ``sb3`` (SB3 PPO + ProbeCallback;
``sb3_default``: its default row alone), ``recipe`` (``recipes.cartpole`` as it ships,
51,200 steps), and at the default only, longer runs: ``sb3_long`` (131,072 steps) and
``recipe_full`` (200,000 steps).

    python -m benchmarks.sampling_overhead [--quick] [--repeats N] [--out PATH] [--only KEYS]
"""

from __future__ import annotations

from typing import Any

from benchmarks.ab import Comparison, Side, adding, measure_and_record, parse_args

KEYS = ["default", "every", "probe_batch", "widths", "sb3", "recipe", "sb3_long", "recipe_full"]
#: keys that repeat a comparison of KEYS (not run by default)
EXTRA_KEYS = ["sb3_default"]
SAMPLING = {
    "default": {"probe_budget": 0.05},
    "every": {"probe_budget": None, "probe_schedule": "every"},
    "probe_batch": {"probe_budget": 0.05, "probe_schedule": "probe_batch:256"},
}


def sampled(
    name: str, a: Side, b_label: str, labels: tuple[str, ...] = ("default", "every"), **switch: Any
) -> list[Comparison]:
    """``a`` against its case with ``switch`` and each sampling of ``labels`` on top."""
    return [
        adding(
            f"{name}, {label}",
            a,
            f"{b_label}, {label}",
            target="<= 1.05" if label == "default" else "reported",
            **switch,
            **SAMPLING[label],
        )
        for label in labels
    ]


def comparisons(quick: bool, only: list[str] | None = None) -> list[Comparison]:
    steps = 512 if quick else 20_480
    plain = Side("no probes", "ours", {"total_timesteps": steps, "activation": "relu"})
    out = {
        label: sampled("five probes x 2", plain, "probes", (label,), probes=True)
        for label in SAMPLING
    }
    out["widths"] = []
    for width in (256, 1024):
        wide = {"activation": "relu", "hidden": width, "total_timesteps": 512 if quick else 8192}
        out["widths"] += sampled(
            f"width {width}", Side("no probes", "ours", wide), "probes", probes=True
        )
    sb3 = {"total_timesteps": 1024 if quick else 32_768, "activation": "relu"}
    out["sb3"] = sampled(
        "SB3 + ProbeCallback", Side("sb3", "sb3", sb3), "+ ProbeCallback", probe_callback=True
    )
    out["sb3_default"] = out["sb3"][:1]  # the target's comparison alone, for more pairs
    shipped = {"total_timesteps": 4096 if quick else 51_200}
    out["recipe"] = sampled(
        "cartpole recipe", Side("recipe, no probes", "recipe", shipped), "recipe", probes=True
    )
    # at the default only, longer runs
    sb3_long = Side("sb3", "sb3", dict(sb3, total_timesteps=2048 if quick else 131_072))
    out["sb3_long"] = sampled(
        "SB3 + ProbeCallback, 131072 steps",
        sb3_long,
        "+ ProbeCallback",
        ("default",),
        probe_callback=True,
    )
    full = Side("recipe, no probes", "recipe", {"total_timesteps": 4096 if quick else 200_000})
    out["recipe_full"] = sampled(
        "cartpole recipe, 200000 steps", full, "recipe", ("default",), probes=True
    )
    return [c for key in (only or KEYS) for c in out[key]]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(
        __doc__.splitlines()[0], 3, "sampling_overhead.json", argv, KEYS + EXTRA_KEYS, KEYS
    )
    measure_and_record(args, comparisons(args.quick, args.only), "sampling overhead")


if __name__ == "__main__":
    main()
