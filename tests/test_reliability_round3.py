"""Reliability, third round (issue 26): no silent wrong runs, no dead ends. Each case as
a user meets it (``policy-probes`` in-process or as a subprocess, ``TrainTool``, the SB3
callback, a ``ProbeSession`` script); ``docs/reliability.md`` lists them."""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_error_line
from run_control_support import write_recipe

from policy_probes import ProbeSettings, Run
from policy_probes.cli import main
from policy_probes.records import read_jsonl
from trainers import TrainTool

torch.set_num_threads(1)


def files_under(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_recipe(tmp_path_factory.mktemp("recipe"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny: str) -> Path:
    """A finished tiny run (6 epochs of 64 agent steps, checkpoints at 2, 4, 6)."""
    run_dir = tmp_path_factory.mktemp("runs") / "done"
    assert main(["run", tiny, f"run_dir={run_dir}", "--no-progress"]) == 0
    return run_dir


# ------------------------------------------------ items 1, 2, 6: values that ran silently
BAD_VALUES = {
    "adam_eps_inf": (["trainer.adam_eps=Infinity"], "trainer.adam_eps: got inf; give a finite"),
    "lr_inf": (["trainer.learning_rate=Infinity"], "trainer.learning_rate: got inf"),
    "ent_coef_nan": (["trainer.ent_coef=NaN"], "trainer.ent_coef: got nan; give a finite"),
    "empty_run_dir": (["run_dir="], "run_dir: Value error, is empty"),
    "seed_twice": (["seed=1", "seed=2"], "seed is given twice (seed=1 and seed=2)"),
    "seed_bool": (["seed=true"], "seed: Value error, expected a number, got true"),
    "atari_on_cartpole": (
        ["env.atari.frame_skip=8"],
        "env.atari.frame_skip applies to Atari (ALE/...) ids only",
    ),
    "remedy_key_twice": (
        ["remedies=redo@actor_mlp:every_epochs=2,every_epochs=3"],
        "every_epochs is given twice; give each key once",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_values_that_ran_silently_exit_2_in_one_line_and_write_nothing(
    case: str, tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    overrides, fragment = BAD_VALUES[case]
    monkeypatch.chdir(tmp_path)  # an empty run_dir would have written here
    run_dir = [] if case == "empty_run_dir" else [f"run_dir={tmp_path / 'run'}"]
    line = cli_error_line(capsys, "run", tiny, *overrides, *run_dir, "--no-progress")
    assert fragment in line
    assert files_under(tmp_path) == set()


def test_a_name_in_any_script_names_the_run_directory() -> None:
    """``name=ラン`` gave ``runs/--1-<time>``."""
    assert TrainTool(name="ラン").default_run_dir().name.startswith("ラン-1-")
    assert TrainTool(name="a b/c").default_run_dir().name.startswith("a-b-c-1-")


# ------------------------------------------------------------ item 6: report --compare
def test_report_compare_with_a_missing_run_exits_2_and_writes_nothing(
    finished_run: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "r.html"
    line = cli_error_line(
        capsys, "report", str(finished_run), "--compare", str(tmp_path / "typo"), "--out", str(out)
    )
    assert "--compare" in line and "typo" in line and "no metrics.jsonl" in line
    assert not out.exists()


# ------------------------------------------------------------ item 3: misspelled `when=`
@pytest.mark.parametrize(
    ("threshold", "hints"),
    [
        ("dormant_fractoin>0.0", ["did you mean 'probes/relu/actor_mlp/dormant_fraction'"]),
        ("dormant_fraction>2.0", []),
    ],
)
def test_a_misspelled_remedy_threshold_key_is_warned_about_once_a_correct_one_not(
    tiny: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, threshold: str, hints: list[str]
) -> None:
    spec = f"redo@actor_mlp:when=probes/relu/actor_mlp/{threshold}"
    with caplog.at_level(logging.WARNING, logger="policy_probes"):
        assert main(["run", tiny, f"run_dir={tmp_path / 'r'}", f"remedies={spec}"]) == 0
    warnings = [r.getMessage() for r in caplog.records if "never fires" in r.getMessage()]
    assert len(warnings) == len(hints), warnings
    for warning, hint in zip(warnings, hints, strict=True):
        assert hint in warning


# ------------------------------------------------------- item 5: resume to a lower total
def test_resume_to_fewer_steps_than_done_exits_2_and_leaves_the_run_as_it_was(
    finished_run: Path, capsys
) -> None:
    before = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}
    line = cli_error_line(capsys, "resume", str(finished_run), "trainer.total_timesteps=128")
    assert "epoch 6 (384 agent steps)" in line
    assert "raise trainer.total_timesteps above 384" in line
    after = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}
    assert after.keys() == before.keys()
    for path, data in before.items():
        if path.name != "run.lock":
            assert after[path] == data, path


# ------------------------------------------------------------------- item 4: disk full
def _can_mount_tmpfs() -> bool:
    """Whether this user may mount a tmpfs in a user namespace of its own."""
    probe = ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=8k none /mnt || exit 1"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _file_size_limit(limit: int) -> None:
    """A kernel limit on every file this process writes (writes past it fail with
    EFBIG), the stand-in for a full disk where no tmpfs can be mounted."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_full_disk_ends_the_run_non_zero_and_says_what_was_lost(
    tiny: str, tmp_path: Path
) -> None:
    """A real full file system: the run directory on a 300 KiB tmpfs (an unprivileged
    mount in a user namespace; where that is not allowed, a 60 KB per-file size limit).
    Training goes on to its end (faults never kill it), then the run exits 1 and says
    which sinks stopped at which epoch and which checkpoints are missing."""
    cli = [sys.executable, "-m", "policy_probes.cli", "run", tiny, "--no-progress"]
    cli += ["trainer.total_timesteps=1536"]  # 24 epochs; checkpoints every 2
    env = {**os.environ, "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    if _can_mount_tmpfs():
        script = (
            f'mount -t tmpfs -o size=300k none "{disk}" && "$@" run_dir="{disk}/run"; '
            f'rc=$?; cp -r "{disk}/run" "{kept}"; exit $rc'
        )
        proc = subprocess.run(
            ["unshare", "-rm", "sh", "-c", script, "sh", *cli],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        errno_text = "No space left on device"
    else:
        proc = subprocess.run(
            [*cli, f"run_dir={kept}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=lambda: _file_size_limit(60_000),
        )
        errno_text = "File too large"
    assert proc.returncode == 1, proc.stderr
    lost = [ln for ln in proc.stderr.splitlines() if ln.startswith("policy-probes: lost:")]
    assert (
        proc.stderr.rstrip()
        .splitlines()[-1]
        .startswith("policy-probes: error: the run trained to its end but could not write all")
    )
    jsonl = next(ln for ln in lost if "metric sink jsonl" in ln)
    assert errno_text in jsonl
    found = re.search(r"the (\S+) record of epoch (\d+) and every later record", jsonl)
    point, first_lost = found.group(1), int(found.group(2))
    records = read_jsonl(kept / "metrics.jsonl")
    assert first_lost < 24 and max(r["epoch"] for r in records) <= first_lost
    assert (first_lost, point) not in {(r["epoch"], r["hook_point"]) for r in records}
    assert (first_lost - 1, point) in {(r["epoch"], r["hook_point"]) for r in records}
    checkpoints = next(ln for ln in lost if ln.startswith("policy-probes: lost: checkpoints:"))
    saved = sorted((kept / "checkpoints").glob("epoch_*.pt"))
    newest = f"epoch {int(saved[-1].stem.split('_')[1])}" if saved else "none"
    assert f"the newest checkpoint is {newest}" in checkpoints
    assert "epochs" in checkpoints and "-24;" in checkpoints


# ------------------------------------------------ item 9: killed in the start-up window
STARTED_SINKS = """
import os, sys
from pathlib import Path
from policy_probes.run_lock import RunDirLock
from policy_probes.sinks import SinksConfig, WandbConfig, build_sink_group
run_dir = Path(sys.argv[1])
run_dir.mkdir(parents=True)
RunDirLock(run_dir).acquire()
build_sink_group(run_dir, SinksConfig(console=False), WandbConfig(mode="disabled"), {})
os.kill(os.getpid(), 9)  # what a run killed before config.json leaves behind
"""


def test_a_run_killed_while_starting_is_run_again_from_its_beginning(
    tiny: str, tmp_path: Path, capsys, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-c", STARTED_SINKS, str(run_dir)], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert {"metrics.jsonl", "metrics.csv", "run.lock"} <= files_under(run_dir)
    line = cli_error_line(capsys, "resume", str(run_dir))
    assert "stopped while it started" in line and "policy-probes run RECIPE" in line
    with caplog.at_level(logging.WARNING):
        assert main(["run", tiny, f"run_dir={run_dir}", "--no-progress"]) == 0
    assert any("starts again from its beginning" in r.getMessage() for r in caplog.records)
    epochs = sorted({r["epoch"] for r in read_jsonl(run_dir / "metrics.jsonl")})
    assert epochs == [1, 2, 3, 4, 5, 6]


def test_a_run_with_epochs_but_no_config_is_still_refused(
    tiny: str, tmp_path: Path, capsys
) -> None:
    """The restart applies only to a run with no epoch record (in metrics.jsonl or
    metrics.csv): anything else is kept."""
    for name, text in (
        ("metrics.jsonl", '{"epoch": 1, "hook_point": "POST_EPOCH"}\n'),
        ("metrics.csv", "epoch,hook_point\n1,POST_EPOCH\n"),
    ):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / name).write_text(text)
        line = cli_error_line(capsys, "run", tiny, f"run_dir={run_dir}", "--no-progress")
        assert "already holds a run" in line
        assert (run_dir / name).read_text() == text


# ------------------------------------------- item 10: SB3 callback with a wrong component
def test_sb3_callback_with_a_misspelled_component_leaves_nothing_that_blocks_the_fix(
    tmp_path: Path,
) -> None:
    from stable_baselines3 import PPO

    from policy_probes import attach_relu_activation_hooks
    from policy_probes.integrations.sb3 import ProbeCallback
    from policy_probes.sinks import SinksConfig, WandbConfig

    def learn(component: str) -> None:
        model = PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=32, n_epochs=1, seed=0)
        callback = ProbeCallback(
            probes=[(component, attach_relu_activation_hooks())],
            run_dir=tmp_path / "sb3",
            probing=ProbeSettings(
                sinks=SinksConfig(console=False), wandb=WandbConfig(mode="disabled")
            ),
        )
        model.learn(32, callback=callback)

    with pytest.raises(KeyError, match="actor_mpl"):
        learn("actor_mpl")
    assert not (tmp_path / "sb3" / "config.json").exists()
    assert not (tmp_path / "sb3" / "metrics.jsonl").exists()
    learn("actor_mlp")  # the corrected script into the same run_dir
    assert (tmp_path / "sb3" / "config.json").is_file()
    assert read_jsonl(tmp_path / "sb3" / "metrics.jsonl")


# -------------------------------------------------------------- item 11: dead ends
@pytest.mark.parametrize("epoch", ["5", "-1"])
def test_a_refused_fork_leaves_no_child_directory(
    finished_run: Path, tmp_path: Path, epoch: str, capsys
) -> None:
    child = tmp_path / "child"
    line = cli_error_line(capsys, "fork", str(finished_run), "--epoch", epoch, str(child))
    assert "epoch" in line
    assert not child.exists()


def test_report_out_a_directory_writes_into_it_and_a_failed_report_leaves_no_temp_file(
    finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert main(["report", str(finished_run), "--out", f"{out_dir}/"]) == 0
    assert files_under(tmp_path) == {"out", "out/report.html"}
    blocked = tmp_path / "blocked"
    blocked.write_text("a file")  # --out blocked/r.html: its directory is a file
    line = cli_error_line(capsys, "report", str(finished_run), "--out", str(blocked / "r.html"))
    assert "cannot write the report" in line
    assert files_under(tmp_path) == {"out", "out/report.html", "blocked"}


def test_a_run_dir_name_over_255_bytes_is_one_line_like_the_dry_run(
    tiny: str, tmp_path: Path, capsys
) -> None:
    run_dir = tmp_path / ("x" * 300)
    for extra in ([], ["--dry-run"]):
        line = cli_error_line(capsys, "run", tiny, f"run_dir={run_dir}", "--no-progress", *extra)
        assert "has a name of 300 bytes" in line and "choose a shorter run_dir" in line
    assert files_under(tmp_path) == set()


RECIPE_BUGS = {
    "raises": (
        "def train():\n    return helper()\n\n\ndef helper():\n    raise RuntimeError('boom')\n",
        "raised: RuntimeError: boom at {path}:6 in helper: raise RuntimeError('boom')",
    ),
    "import_fails": (
        "import no_such_package_26\n\n\ndef train():\n    pass\n",
        "failed to import: ModuleNotFoundError: No module named 'no_such_package_26'"
        " at {path}:1 in <module>",
    ),
    "syntax": ("def train(:\n    pass\n", "failed to import: SyntaxError"),
}


@pytest.mark.parametrize("case", list(RECIPE_BUGS))
def test_a_recipe_that_raises_or_fails_to_import_names_its_own_line(
    case: str, tmp_path: Path
) -> None:
    source, expected = RECIPE_BUGS[case]
    path = tmp_path / "my_recipe.py"
    path.write_text(source)
    proc = subprocess.run(
        [sys.executable, "-m", "policy_probes.cli", "run", f"{path}:train"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("policy-probes: error: recipe")
    assert expected.format(path=path) in lines[0]
    assert "policy_probes/cli.py" not in lines[0]


# ------------------------------------------ item 8: a component wrapping a time-major LSTM
def test_a_batch_time_mask_on_a_time_major_wrapper_reads_the_real_steps(tmp_path: Path) -> None:
    """A ProbeSession script: the component wraps an ``nn.LSTM`` without ``batch_first``
    and returns its (T, B, H) output; the loop states a (B, T) mask with padded tails
    (B=3, T=5). The saturation probe must count the real steps only (it read the mask in
    the wrong order, and T x B = B x T hid it)."""
    from torch import nn

    from policy_probes import ProbeSession, attach_saturated_activation_hooks
    from policy_probes.sinks import SinksConfig, WandbConfig

    class Core(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, F)
            return torch.tanh(8 * self.lstm(x.transpose(0, 1))[0])  # (T, B, H)

    class Agent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.core, self.head = Core(), nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.core(x))

    torch.manual_seed(0)
    agent = Agent()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 4, generator=g) * 3
    x[:, 3:] = 40.0  # padded steps: saturate the LSTM, and the loss leaves them out
    mask = torch.ones(3, 5)
    mask[:, 3:] = 0.0
    mask[0, 2:] = 0.0
    with ProbeSession(
        agent,
        run=Run(tmp_path / "s"),
        probing=ProbeSettings(
            sinks=SinksConfig(console=False, csv=False), wandb=WandbConfig(mode="disabled")
        ),
    ) as session:
        builder = attach_saturated_activation_hooks("tanh", threshold=0.6)
        session.add_training_hook("core", builder, per_layer=False)
        session.set_phase("train")
        with session.row_mask(mask):
            out = agent(x)
            ((out.square().sum(-1).T * mask).sum() / mask.sum()).backward()
        metrics = session.epoch_end(step=0)
    h = agent.core(x).detach().transpose(0, 1)  # (B, T, H)
    real = h[mask.bool()]
    expected = (real.abs() > 0.6).double().mean().item()
    got = metrics["probes/saturation_tanh/core/saturated_fraction"]
    assert got == pytest.approx(expected, rel=1e-6)
    assert metrics["probes/saturation_tanh/core/samples"] == pytest.approx(mask.sum().item())


# -------------------------------------------- item 15: a dry run of every shipped recipe
def test_every_shipped_recipe_passes_its_dry_run(capsys) -> None:
    """``policy-probes run <recipe> --dry-run`` for every recipe ``--list`` shows: the
    Atari recipe's probes are checked against the NatureCNN policy it builds."""
    from policy_probes.cli import find_recipes

    targets = [t for t, _ in find_recipes("recipes")]
    assert "recipes.atari.train" in targets and "recipes.cartpole.train" in targets
    for target in targets:
        capsys.readouterr()
        assert main(["run", target, "--dry-run"]) == 0, capsys.readouterr().err
        attached = json.loads(capsys.readouterr().out)["attached"]
        assert attached and all(attached.values()), target


# ------------------------------------------------------------- item 14: friction
def test_next_steps_name_commands_the_shell_can_run_and_quote_paths_with_spaces(
    tiny: str, tmp_path: Path
) -> None:
    """After ``make demo`` without an activated environment ``policy-probes`` is not on
    PATH: the summary names the environment's script; a run_dir with a space is quoted,
    and the printed command runs through a shell. (The W&B line, quoted the same way:
    ``test_reliability_new_user.py::test_end_of_run_summary_names_report_and_wandb_sync``.)"""
    run_dir = tmp_path / "my runs" / "r 1"
    env = {**os.environ, "PATH": "/usr/bin:/bin", "WANDB_MODE": "disabled"}
    ran = subprocess.run(
        [sys.executable, "-m", "policy_probes.cli", "run", tiny, f"run_dir={run_dir}"]
        + ["--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    script = Path(sys.executable).parent / "policy-probes"
    program = str(script) if script.is_file() else f"{sys.executable} -m policy_probes.cli"
    assert f"  {program} report '{run_dir}'" in ran.stdout
    line = next(ln for ln in ran.stdout.splitlines() if " report " in ln)
    command = line.split("#")[0].strip()
    done = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (run_dir / "report.html").is_file()


def test_list_run_module_verbose_after_the_subcommand_and_a_target_without_run(
    tmp_path: Path, capsys
) -> None:
    capsys.readouterr()
    assert main(["run", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "recipes.atari.train" in listed and "add_probes" not in listed
    line = cli_error_line(capsys, "run", "recipes.cartpole")
    assert "'recipes.cartpole' is a module" in line and "recipes.cartpole.train" in line
    line = cli_error_line(capsys, "recipes.cartpole.train")
    assert "is not a command; to train a recipe: policy-probes run recipes.cartpole.train" in line
    # -v after the subcommand: the error comes with its traceback
    path = tmp_path / "r.py"
    path.write_text("def train():\n    raise RuntimeError('boom')\n")
    capsys.readouterr()
    assert main(["run", f"{path}:train", "-v"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: boom" in err


def test_sigterm_says_stopped_once_and_titles_the_last_table_stopped(
    tiny: str, tmp_path: Path
) -> None:
    from run_control_support import start_run, wait_for_epoch

    run_dir = tmp_path / "run"
    proc = start_run(tiny, run_dir, "sinks.console=true")
    wait_for_epoch(run_dir, 1, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.count("stopped by SIGTERM") == 2, err  # the message, and the table's title
    assert len([ln for ln in err.splitlines() if "; checkpoint " in ln]) == 1, err
    assert "final, epoch" not in err
    assert re.search(r"stopped by SIGTERM, epoch \d+", err), err


def test_the_console_table_shows_the_relu_gradient_pass_rate(tmp_path: Path, capsys) -> None:
    """A ProbeSession with the console sink and the relu_gradient_flow probe: its mean
    pass rate is in the final table, with the value of an independent count."""
    from torch import nn

    from policy_probes import ProbeSession, attach_relu_gradient_flow_hooks
    from policy_probes.sinks import SinksConfig, WandbConfig

    torch.manual_seed(0)
    agent = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(32, 4)
    with ProbeSession(
        agent,
        run=Run(tmp_path / "s"),
        probing=ProbeSettings(
            sinks=SinksConfig(csv=False, jsonl=False), wandb=WandbConfig(mode="disabled")
        ),
    ) as session:
        session.add_training_backward_hook("1", attach_relu_gradient_flow_hooks())
        session.set_phase("train")
        agent(x).square().mean().backward()
        metrics = session.epoch_end(step=0)
    pass_rate = (agent[0](x) > 0).double().mean().item()  # the gradient passes where h > 0
    key = "probes/relu_gradient_flow/1/mean_pass_rate"
    assert metrics[key] == pytest.approx(pass_rate)
    final = capsys.readouterr().err.split("final, epoch 0")[-1]
    assert key in final  # a row of the table printed when the session closed


def test_the_docs_count_the_probes_the_cartpole_recipe_attaches() -> None:
    """``docs/trainer.md`` and ``recipes/cartpole.py`` said "five probes", the README
    four; the recipe attaches four kinds."""
    from recipes.cartpole import train

    kinds = {p["builder"] for p in train().resolved_config()["probes"]}
    assert len(kinds) == 4
    root = Path(__file__).resolve().parents[1]
    for doc in ("README.md", "docs/trainer.md", "recipes/cartpole.py"):
        text = " ".join((root / doc).read_text().split())
        assert "five probes" not in text, doc
        assert "four ReLU-network probes" in text, doc


def test_a_refused_start_leaves_no_empty_default_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make test`` left an empty ``runs/CartPole-v1-1-<time>/``: a TrainTool without
    run_dir whose start is refused (an unknown component) created its default directory
    and left it behind."""
    from policy_probes import attach_relu_activation_hooks

    monkeypatch.chdir(tmp_path)
    tool = TrainTool(wandb={"mode": "disabled"}).add_training_hook(
        "actor_mpl", attach_relu_activation_hooks()
    )
    with pytest.raises(KeyError, match="actor_mpl"):
        tool.invoke()
    assert files_under(tmp_path) == set()


# ------------------------------------- item 13: the final evaluation of a short run
ENDLESS_RECIPE = """
import gymnasium as gym
from gymnasium.wrappers import TimeLimit

from trainers import EnvConfig, EvalConfig, PPOConfig, TrainTool


class Endless(gym.Wrapper):
    '''CartPole that never ends an episode (an ALE game of 27,000 steps, in short).'''

    def step(self, action):
        obs, reward, _, _, info = self.env.step(action)
        return obs, reward, False, False, info


gym.register("Endless-v0", entry_point=lambda: Endless(gym.make("CartPole-v1").unwrapped))


def train() -> TrainTool:
    return TrainTool(
        env=EnvConfig(id="Endless-v0", num_envs=2),
        trainer=PPOConfig(total_timesteps=128, num_steps=32, num_minibatches=2, update_epochs=1),
        evaluation=EvalConfig(every_epochs=0, at_end=True, episodes=4, num_envs=4),
        checkpoint={"every_epochs": 0, "at_end": False},
        sinks={"console": False, "csv": False},
        wandb={"mode": "disabled"},
    )
"""


def test_a_short_runs_final_evaluation_is_bounded_and_says_so(tmp_path: Path, caplog) -> None:
    """Episodes that never end, evaluation.max_steps=100000 on 4 envs (400,000 agent
    steps) after 128 training steps (2 epochs): the run says at its start that the final
    evaluation stops at 500 steps per env (2,000 agent steps), and afterwards that it
    stopped there with 0 of 4 episodes; eval/episodes is 0 in the metrics."""
    path = tmp_path / "endless.py"
    path.write_text(ENDLESS_RECIPE)
    run_dir = tmp_path / "r"
    with caplog.at_level(logging.INFO, logger="trainers"):
        assert main(["run", f"{path}:train", f"run_dir={run_dir}", "--no-progress"]) == 0
    messages = [r.getMessage() for r in caplog.records]
    start = next(m for m in messages if m.startswith("the final evaluation"))
    assert "up to evaluation.max_steps=100000 steps per env" in start
    assert "it stops at 500 steps per env" in start and "evaluation.at_end=false" in start
    end = next(m for m in messages if m.startswith("evaluation after epoch 2 stopped"))
    assert "at 500 steps per env with 0 of 4 episodes finished" in end
    last = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["epoch"] == 2]
    assert any(r.get("eval/episodes") == 0.0 for r in last)
    # switched off: the evaluation runs to max_steps (here lowered to keep the test short)
    caplog.clear()
    other = tmp_path / "r2"
    overrides = ["evaluation.short_run_bound=false", "evaluation.max_steps=300"]
    assert main(["run", f"{path}:train", f"run_dir={other}", "--no-progress", *overrides]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert not any(m.startswith("the final evaluation") for m in messages)
    assert any("stopped at 300 steps per env" in m for m in messages)
