"""The cost of per-layer reporting alone: the per_layer row of benchmarks.probe_overhead.

python -m benchmarks.per_layer_overhead [--quick] [--repeats N] [--out PATH]
"""

from __future__ import annotations

from benchmarks.ab import measure_and_record, parse_args
from benchmarks.probe_overhead import per_layer_comparison


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], 3, "per_layer_overhead.json", argv)
    measure_and_record(
        args,
        [per_layer_comparison(args.quick)],
        "per-layer overhead",
        table_title="per-layer reporting (wall time on / off)",
        results_title="per-layer overhead: t(per_layer=True)/t(per_layer=False)",
    )


if __name__ == "__main__":
    main()
