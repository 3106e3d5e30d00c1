"""ConsoleSink: the SNAPSHOT table and the live view show the real values with trend
arrows, hide vectors and deep keys, and share a console with a progress bar."""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress
from sinks_support import emit_probe_run, tiny_cartpole

from policy_probes.records import Record, read_jsonl
from policy_probes.sinks import ConsoleSink, SinksConfig
from policy_probes.sinks.console import DOWN, FLAT, UP, format_value, sparkline, trend_arrow


def expected_arrow(prev: float, cur: float) -> str:
    if abs(cur - prev) <= 1e-12 + 1e-3 * abs(prev):
        return FLAT
    return UP if cur > prev else DOWN


def test_snapshot_table_shows_real_values_and_trends(tmp_path):
    console = Console(record=True, width=160)
    sink = ConsoleSink(console=console, live=False)
    emitted = emit_probe_run(sink, epochs=3, snapshot_every=3)
    sink.emit(
        Record.of({"hessian/top_eigenvalue": 3.25, "hessian/per_layer/deep": 1.0}, 2, "SNAPSHOT")
    )
    text = console.export_text()
    snapshot = text[text.index("snapshot, epoch 2") :]
    (_, _, prev), (_, step, last) = emitted[-2], emitted[-1]
    for key in (
        "probes/relu/actor_mlp.layer_0/dead_fraction",
        "probes/fisher/actor_mlp/trace",
        "probes/saturation_tanh/critic_mlp/saturated_fraction",
        "train/policy_loss",
        "rollout/episode_return",
    ):
        line = next(ln for ln in snapshot.splitlines() if ln.lstrip().startswith(key + " "))
        assert format_value(last[key]) in line, (key, line)
        assert line.rstrip().endswith(expected_arrow(prev[key], last[key])), line
    assert f"agent_step {step:,}" in snapshot
    assert "hessian/top_eigenvalue" in snapshot and "3.25" in snapshot
    # vectors, per-parameter Fisher and deep keys are hidden
    for hidden in (
        "active_rate",
        "layer_1.linear.weight.trace",
        "hessian/per_layer/deep",
        "samples",
    ):
        assert hidden not in snapshot
    sink.close()
    assert "final, epoch 2" in console.export_text()


def test_live_view_beside_a_progress_bar_on_one_console():
    console = Console(record=True, width=140, force_terminal=True, color_system=None)
    with Progress(console=console, auto_refresh=False) as progress:
        task = progress.add_task("training", total=3)
        sink = ConsoleSink(
            console=console, metrics=["train/policy_loss", "probes/relu/*/dead_fraction"]
        )
        emitted = emit_probe_run(sink, epochs=3)
        progress.update(task, completed=3)
        progress.refresh()
        assert sink._live is not None and sink._live.is_started
        view = Console(width=140, record=True, color_system=None)
        view.print(sink)
        live_text = view.export_text()
        sink.close()
    losses = [m["train/policy_loss"] for _, _, m in emitted]
    line = next(ln for ln in live_text.splitlines() if ln.startswith("train/policy_loss"))
    assert format_value(losses[-1]) in line
    assert expected_arrow(losses[-2], losses[-1]) in line
    assert sparkline(losses) in line
    assert "epoch 2" in live_text
    assert "probes/fisher" not in live_text  # not chosen
    out = console.export_text()
    assert "training" in out and "final, epoch 2" in out


def test_trend_and_sparkline_helpers():
    assert trend_arrow(None, 1.0) == " "
    assert (
        trend_arrow(1.0, 1.0005) == FLAT
        and trend_arrow(1.0, 1.1) == UP
        and trend_arrow(1.0, 0.5) == DOWN
    )
    assert sparkline([0.0, 1.0, 0.5]) == "▁█▅"
    assert sparkline([2.0, 2.0]) == "▅▅"
    assert (
        format_value(12345) == "12,345"
        and format_value(0.5) == "0.5"
        and format_value(1e-5) == "1.000e-05"
    )


def test_console_output_of_a_short_training_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    tool = tiny_cartpole(tmp_path, epochs=2, sinks=SinksConfig(console=True, wandb=False))
    tool.invoke()
    text = capsys.readouterr().err
    last = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["hook_point"] == "POST_EPOCH"][
        -1
    ]
    final = text[text.index(f"final, epoch {last['epoch']}") :]
    for key in (
        "train/value_loss",
        "probes/relu/critic_mlp/dead_fraction",
        "probes/fisher/actor_mlp/trace",
    ):
        line = next(ln for ln in final.splitlines() if ln.lstrip().startswith(key + " "))
        assert format_value(last[key]) in line, (key, line)
    assert f"agent_step {last['agent_step']:,}" in final


def test_the_live_view_is_drawn_again_at_most_every_refresh_seconds(monkeypatch):
    """Epochs shorter than ``refresh_seconds`` do not each lay the live view out again: it
    is drawn for the first epoch, then only when ``refresh_seconds`` have passed and newer
    values came, and then it shows the latest epoch's. Refreshes in between (a progress bar
    redraws ten times a second) show the last drawing."""
    from policy_probes.sinks import console as console_module

    clock = [100.0]
    monkeypatch.setattr(console_module.time, "monotonic", lambda: clock[0])
    console = Console(record=True, width=140, force_terminal=True, color_system=None)
    sink = ConsoleSink(console=console, metrics=["train/policy_loss"], refresh_seconds=0.5)
    draws: list[int] = []
    view = sink.live_view
    sink.live_view = lambda: draws.append(sink.epoch) or view()
    for epoch, seconds in enumerate([0.0, 0.1, 0.2, 0.3, 0.6, 0.7, 1.0, 1.15]):
        clock[0] = 100.0 + seconds
        sink.emit(Record.of({"train/policy_loss": float(epoch)}, epoch, "POST_EPOCH"))
        sink._live.refresh()  # as a progress bar's own refresh would
    assert draws == [0, 4, 7]
    clock[0] = 105.0  # long after, but nothing new: the drawing stands
    sink._live.refresh()
    assert draws == [0, 4, 7]
    shown = Console(width=140, record=True, color_system=None)
    shown.print(sink._live.renderable)
    line = next(ln for ln in shown.export_text().splitlines() if "train/policy_loss" in ln)
    assert format_value(7.0) in line and sparkline([float(e) for e in range(8)]) in line
    sink.close()
    assert "final, epoch 7" in console.export_text()
