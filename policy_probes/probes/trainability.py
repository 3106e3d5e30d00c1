"""Trainability probe: how well a copy of the component still fits new targets.

Lyle, Rowland and Dabney (ICLR 2022, "Understanding and Preventing Capacity Loss in
Reinforcement Learning") measure a network's capacity as its ability to fit new target
functions: starting from the current parameters θ, train for k steps to regress the
outputs f(x) of a freshly initialised random network on a fixed set of states, and read
the final loss. Here, per component g_θ, on its inputs X (n rows) on the run's reference
states (:mod:`policy_probes.reference_states`):

* targets Y = standardise(f(X)): f = a fresh initialisation of the component followed by
  a random linear map to ``targets`` outputs; each column standardised over the rows
  (zero mean, unit variance), so a constant predictor scores 1.0
* ``loss`` = (1/(n·t)) Σ_i ‖h_k(g_k(x_i)) − y_i‖², after ``steps`` full-batch Adam steps
  (``lr``) from (g_0, h_0) = (a copy of g_θ, a fresh linear head to ``targets`` outputs)
* ``fresh_loss`` = the mean of that loss over ``fresh`` fresh initialisations of the
  component (each with a fresh head) trained the same way on the same Y
* ``ratio`` = loss / fresh_loss: above 1, the component fits new targets worse than a
  fresh network of its architecture does

Targets, heads and fresh initialisations are seeded from ``seed`` and a stable hash of
the component's name, never from the global generators: the fresh baseline is fixed for a
run and component, computed once and cached (checkpoints carry it). Everything runs on
copies, under :func:`~policy_probes.lifecycle.rng.preserved_rng`, with an optimizer of
its own: the component, its optimizer state and the loop's generators are untouched.
"""

from __future__ import annotations

import copy
import logging
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from policy_probes.lifecycle.rng import preserved_rng
from policy_probes.plugins import Rule, register
from policy_probes.probes.probe import Probe
from policy_probes.probes.rows import COUNT
from policy_probes.probes.state import Device
from policy_probes.reference_states import evenly_spaced

if TYPE_CHECKING:
    from policy_probes.probes.observation import Observation

log = logging.getLogger("policy_probes")

#: the settings and their defaults (docs/probes/trainability.md says why these)
DEFAULTS: dict[str, Any] = {
    "steps": 30,
    "lr": 3e-3,
    "targets": 16,
    "fresh": 3,
    "reference_rows": 256,
    "every_epochs": 50,
    "seed": 0,
}
NO_SET = (
    "no reference states: attach it through a ProbeSession (or TrainTool) whose loop calls "
    "session.rollout_end(observations=...), or fix them with session.fix_reference_states()"
)
#: lists a nested PolicyAutoBuilder keeps its probe handles and contexts in (not copied)
HOLDERS = ("_handles", "_contexts")
#: seed offsets of the draws of one component: the targets, the copy's head, fresh net i
TARGET_DRAW, HEAD_DRAW, FRESH_DRAW = 0, 1, 2


def check_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings with defaults filled in; a ``ValueError`` naming a bad one."""
    out = {**DEFAULTS, **settings}
    unknown = sorted(set(out) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"trainability takes {sorted(DEFAULTS)}, not {unknown}")
    for key in ("steps", "targets", "fresh", "reference_rows", "every_epochs"):
        v = out[key]
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"trainability: {key} must be an integer >= 1, got {v!r}")
    if not (isinstance(out["seed"], int) and not isinstance(out["seed"], bool)):
        raise ValueError(f"trainability: seed must be an integer, got {out['seed']!r}")
    lr = out["lr"]
    if not (isinstance(lr, int | float) and not isinstance(lr, bool) and lr > 0):
        raise ValueError(f"trainability: lr must be a number > 0, got {lr!r}")
    out["lr"] = float(lr)
    return out


# ---------------------------------------------------------------- the measurement
def hook_free_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` without any of its torch hooks (every ``*_hooks*`` dict
    of every submodule replaced by an empty one), so probes and remedies neither fire on
    the copy nor are copied with it."""
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for name, value in vars(sub).items():
            if "_hooks" in name and isinstance(value, dict):
                memo[id(value)] = type(value)()
            elif name in HOLDERS and isinstance(value, list):
                memo[id(value)] = []
    return copy.deepcopy(module, memo)


def fresh_initialisation(module: nn.Module) -> nn.Module:
    """A hook-free copy of ``module`` re-initialised with ``reset_parameters()``: the
    module's own if it defines one, else that of every submodule that does (the global
    generator draws: seed it first)."""
    device = next((t.device for t in module.parameters()), torch.device("cpu"))
    fresh = hook_free_copy(module).to("cpu")  # the CPU generator draws: any device alike
    if callable(getattr(fresh, "reset_parameters", None)):
        fresh.reset_parameters()
        return fresh.to(device)
    reset = 0
    for sub in fresh.modules():
        if callable(getattr(sub, "reset_parameters", None)):
            sub.reset_parameters()
            reset += 1
    if reset == 0 and any(True for _ in fresh.parameters()):
        raise ValueError(
            f"{type(module).__name__} has parameters but neither it nor any submodule "
            f"defines reset_parameters(), so it cannot be freshly initialised"
        )
    return fresh.to(device)


def flat(out: Any) -> torch.Tensor:
    """A component's output as ``(rows, features)``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the component returned {type(out).__name__}, not a tensor")
    return out.reshape(out.shape[0], -1) if out.dim() != 1 else out.reshape(-1, 1)


def standardised(y: torch.Tensor) -> torch.Tensor:
    """Each column of ``y`` minus its mean over the rows, over its standard deviation
    (population; a constant column becomes 0)."""
    centred = y - y.mean(0, keepdim=True)
    std = centred.square().mean(0, keepdim=True).sqrt()
    return torch.where(std > 0, centred / std.clamp(min=torch.finfo(y.dtype).tiny), 0.0)


def component_seed(seed: int, component: str, draw: int) -> int:
    """The seed of one draw for ``component``: ``seed``, a stable hash (CRC-32) of the
    name and the draw's index, never the global generator."""
    return (seed * 1_000_003 + zlib.crc32(component.encode()) * 101 + draw) % (2**63)


@contextmanager
def isolated_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Global generators seeded with ``seed`` inside, restored after (CPU, ``device``)."""
    devices = [device] if device.type == "cuda" else []
    with preserved_rng(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def fit_loss(
    body: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, head_seed: int
) -> torch.Tensor:
    """The MSE of ``head(body(x))`` on ``y`` after ``steps`` full-batch Adam steps on
    every parameter of ``body`` (trained in place: pass a copy) and of a fresh linear head
    (seeded with ``head_seed``); a float64 0-dim tensor on ``x``'s device."""
    with isolated_rng(x.device, head_seed), torch.inference_mode(False), torch.enable_grad():
        width = flat(body(x)).shape[1]
        head = nn.Linear(width, y.shape[1]).to(device=x.device, dtype=y.dtype)
        params = [*body.parameters(), *head.parameters()]
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        optimizer = torch.optim.Adam(params, lr=lr)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(head(flat(body(x))), y)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            return nn.functional.mse_loss(head(flat(body(x))), y).to(torch.float64)


def new_targets(module: nn.Module, x: torch.Tensor, settings: dict[str, Any], name: str) -> Any:
    """Standardised outputs of a freshly initialised random network (a fresh
    initialisation of ``module`` and a random linear map to ``targets`` outputs) on ``x``."""
    with isolated_rng(x.device, component_seed(settings["seed"], name, TARGET_DRAW)):
        net = fresh_initialisation(module)
        with torch.no_grad():
            features = flat(net(x))
            out = nn.Linear(features.shape[1], settings["targets"]).to(x.device, features.dtype)
            return standardised(out(features).detach())


def fresh_loss(
    module: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: dict[str, Any], name: str
) -> torch.Tensor:
    """The mean :func:`fit_loss` of ``fresh`` fresh initialisations of ``module``."""
    losses = []
    for i in range(settings["fresh"]):
        draw = component_seed(settings["seed"], name, FRESH_DRAW + 2 * i)
        with isolated_rng(x.device, draw):
            net = fresh_initialisation(module)
        head_seed = component_seed(settings["seed"], name, FRESH_DRAW + 2 * i + 1)
        losses.append(fit_loss(net, x, y, settings["steps"], settings["lr"], head_seed))
    return torch.stack(losses).mean()


def trained_loss(
    module: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: dict[str, Any], name: str
) -> torch.Tensor:
    """:func:`fit_loss` of a hook-free copy of ``module`` as it is now."""
    head_seed = component_seed(settings["seed"], name, HEAD_DRAW)
    return fit_loss(hook_free_copy(module), x, y, settings["steps"], settings["lr"], head_seed)


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """What tells one input set from another: shape-weighted float64 sums (host)."""
    v = x.detach().reshape(-1).to(torch.float64)
    w = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device) / max(v.numel(), 1)
    shape = torch.tensor(list(x.shape), dtype=torch.float64, device=v.device)
    return torch.cat([shape, torch.stack([v.sum(), v.square().sum(), (v * w).sum()])]).cpu()


def measure_module(
    name: str, module: nn.Module, x: torch.Tensor, settings: dict[str, Any], fresh: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, fresh_loss)`` of component ``name`` (``module``) on its inputs ``x``
    (float64 0-dim tensors on ``x``'s device); ``fresh``: the fresh baseline already
    computed for these inputs and settings (None: computed here)."""
    y = new_targets(module, x, settings, name)
    if fresh is None:
        fresh = fresh_loss(module, x, y, settings, name)
    return trained_loss(module, x, y, settings, name), fresh.to(x.device)


def check_input(x: Any, rows: int, name: str) -> torch.Tensor:
    """``x`` if it is one batch-first tensor of the reference set's ``rows`` rows."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"component {name!r} did not receive one tensor as its first argument on the "
            f"reference states; the trainability probe needs a module whose input is one "
            f"batch-first tensor"
        )
    if x.dim() == 0 or x.shape[0] != rows:
        raise ValueError(
            f"component {name!r} received shape {tuple(x.shape)} on the {rows} reference "
            f"states: its input is not batch-first over them (a recurrent or sequence "
            f"component); the trainability probe needs one row per state"
        )
    if not x.is_floating_point():
        x = x.float()
    return x.detach().clone()


@register
class Trainability(Probe):
    """Per component: at its scheduled reports, the fit loss of a copy of the component
    on new random targets over the reference states, and the cached fresh baseline; the
    sums and counts (``loss_sum``, ``fresh_sum``, ``count``) are added across processes."""

    name = "trainability"
    maker = "attach_trainability_hooks()"
    events = ("epoch_end",)
    placements = ()
    component_hook = False
    docs = "docs/probes/trainability.md"
    metrics = {
        "loss": "MSE of a copy of the component fitting new random targets after k steps",
        "fresh_loss": "the same fit's mean MSE from fresh initialisations of the component",
        "ratio": "loss / fresh_loss (> 1: fits new targets worse than a fresh network)",
    }
    console = ("ratio",)
    rules = (
        Rule(
            name="plasticity_lost",
            title="plasticity is lost: it fits new targets much worse than before",
            metric="ratio",
            direction="rising",
            kind="ratio",
            threshold=2.0,
            release=1.4,
            level=1.5,
            floor=1e-6,
            window=1,
            lag=1,
            skip=1,
            tier="finding",
            threshold_source="policy-probes default, not from a paper, set above the healthy "
            "runs of the labelled benchmark (docs/findings.md); the test is the target-fitting "
            "capacity of Lyle, Rowland & Dabney (ICLR 2022)",
            docs="docs/probes/trainability.md",
            remedies=("reset_layers", "shrink_and_perturb", "plasticity_injection", "redo"),
            meaning="a copy of the component, trained on new random targets over the run's "
            "reference states, ends with a loss at least 1.5 times that of fresh "
            "initialisations of the same architecture and (when first found) at least twice "
            "its own ratio at the previous measurement: it lost much of its ability to fit "
            "new functions between the two, faster than healthy training does",
        ),
    )

    def __init__(
        self,
        *,
        steps: int = DEFAULTS["steps"],
        lr: float = DEFAULTS["lr"],
        targets: int = DEFAULTS["targets"],
        fresh: int = DEFAULTS["fresh"],
        reference_rows: int = DEFAULTS["reference_rows"],
        every_epochs: int = DEFAULTS["every_epochs"],
        seed: int = DEFAULTS["seed"],
    ) -> None:
        settings = {
            "steps": steps,
            "lr": lr,
            "targets": targets,
            "fresh": fresh,
            "reference_rows": reference_rows,
            "every_epochs": every_epochs,
            "seed": seed,
        }
        super().__init__(**check_settings(settings))
        self.modules: dict[str, nn.Module] = {}
        #: component -> cached fresh baseline (float64 0-dim) for the run's reference states
        self.fresh: dict[str, torch.Tensor] = {}
        #: component -> :func:`fingerprint` of the inputs the cached baseline was fitted on
        self.fresh_inputs: dict[str, torch.Tensor] = {}
        #: components measured at least once (the first report after the set exists)
        self.measured: set[str] = set()
        #: component -> why it is not measured (reported once in probes/errors)
        self.disabled: dict[str, str] = {}
        #: reports so far (the epoch without a session's sampler)
        self.reports = 0
        self._told: set[str] = set()  # components told that the set is missing
        self._done = False  # this report measured already (all-reduce, then to_metrics)

    def register_component(self, name: str, **settings: Any) -> bool:
        return super().register_component(name, **check_settings({**self.options, **settings}))

    def attach(self, obs: Observation, module: nn.Module) -> list[RemovableHandle]:
        known = self.modules.get(obs.component) is module
        self.modules[obs.component] = module
        reference = getattr(obs.context, "reference_states", None)
        if reference is not None and not known:  # attach runs at every re-arming
            reference.want(self.settings[obs.component]["reference_rows"])
        return []

    def unregister_component(self, name: str) -> None:
        super().unregister_component(name)
        self.modules.pop(name, None)
        self.fresh.pop(name, None)
        self.fresh_inputs.pop(name, None)
        self.measured.discard(name)

    # ----------------------------------------------------------- schedule
    def epoch(self) -> int:
        """The epoch of this report, from 1: the session's (its sampler counts the epochs
        ended, checkpoints carry it), else this tracker's reports."""
        sampler = getattr(self.context, "sampler", None)
        epochs = getattr(sampler, "epochs", None)
        return (epochs if isinstance(epochs, int) else self.reports) + 1

    def due(self, component: str, epoch: int) -> bool:
        """Measured at the first report with reference states, then every ``every_epochs``."""
        every = self.settings[component]["every_epochs"]
        return component not in self.measured or epoch % every == 0

    # ----------------------------------------------------------- measuring
    def measure(self) -> None:
        """Measure the components due at this report (once per report)."""
        if self._done:
            return
        self._done = True
        epoch = self.epoch()
        due = [c for c in self.modules if c not in self.disabled and self.due(c, epoch)]
        if not due:
            return
        reference = getattr(self.context, "reference_states", None)
        if reference is None or not reference.ready:
            for c in due:
                if reference is None:
                    self._disable(c, NO_SET)
                elif c not in self._told:
                    self._told.add(c)
                    self.errors[c] = f"not measured yet: {NO_SET}"
            return
        rows = int(reference.observations.shape[0])
        try:
            inputs = reference.capture({c: self.modules[c] for c in due}, self.context, inputs=True)
        except Exception as exc:  # a probe must never take training down
            if self.context is not None and self.context.strict:
                raise
            self.errors["reference states"] = f"{type(exc).__name__}: {exc}"
            return
        for c in due:
            try:
                x = check_input(inputs.get(c), rows, c)
                x = evenly_spaced(x, self.settings[c]["reference_rows"])
                loss, fresh = self.measure_component(c, self.modules[c], x)
            except Exception as exc:  # a probe must never take training down
                if self.context is not None and self.context.strict:
                    raise
                self._disable(c, f"{type(exc).__name__}: {exc}")
                continue
            self.measured.add(c)
            self._add(c, "loss_sum", loss)
            self._add(c, "fresh_sum", fresh)
            self._add(c, "count", torch.ones((), dtype=COUNT, device=loss.device), COUNT)

    def measure_component(
        self, name: str, module: nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, fresh_loss)`` of ``module`` on inputs ``x`` (float64 0-dim tensors);
        the fresh baseline from the cache while the inputs are those it was computed on
        (always for a component fed the observations; a component fed by trained layers
        gets a new baseline whenever its inputs moved)."""
        key = fingerprint(x)
        cached = self.fresh.get(name)
        same = cached is not None and torch.equal(self.fresh_inputs.get(name, key[:0]), key)
        loss, fresh = measure_module(name, module, x, self.settings[name], cached if same else None)
        self.fresh[name], self.fresh_inputs[name] = fresh.detach().cpu(), key
        return loss, fresh

    def _disable(self, component: str, reason: str) -> None:
        self.disabled[component] = reason
        self.errors[component] = f"disabled, training goes on: {reason}"
        log.error("probe trainability on %r is disabled: %s", component, reason)

    # ----------------------------------------------------------- window
    def reset(self) -> None:
        super().reset()
        if self._done:
            self.reports += 1
        self._done = False

    def reduced_tensors(self) -> dict[tuple[str, ...], tuple[torch.Tensor, str]]:
        self.measure()
        return super().reduced_tensors()

    def to_metrics(self) -> dict[str, float | list[float]]:
        self.measure()
        return super().to_metrics()

    def summarize(self, component: str, s: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict:
        n = int(s["count"]) if "count" in s else 0
        if not n:
            return {}
        loss, fresh = float(s["loss_sum"]) / n, float(s["fresh_sum"]) / n
        return {"loss": loss, "fresh_loss": fresh, "ratio": loss / fresh if fresh > 0 else 0.0}

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["fresh"] = {c: t.detach().cpu().clone() for c, t in self.fresh.items()}
        out["fresh_inputs"] = {c: t.clone() for c, t in self.fresh_inputs.items()}
        out["measured"] = sorted(self.measured)
        out["reports"] = self.reports
        out["settings"] = {c: dict(s) for c, s in self.settings.items()}
        return out

    def load_state_dict(self, state: dict[str, Any], device: Device = None) -> None:
        super().load_state_dict(state, device)
        saved = state.get("settings") or {}
        for c, t in (state.get("fresh") or {}).items():
            # a baseline of other settings is not this run's: recomputed at the next report
            inputs = (state.get("fresh_inputs") or {}).get(c)
            if c in self.settings and saved.get(c) == self.settings[c] and inputs is not None:
                self.fresh[c], self.fresh_inputs[c] = t.clone(), inputs.clone()
        self.measured = {c for c in state.get("measured") or () if c in self.settings}
        self.reports = int(state.get("reports", self.reports))


def attach_trainability_hooks(
    *,
    steps: int = DEFAULTS["steps"],
    lr: float = DEFAULTS["lr"],
    targets: int = DEFAULTS["targets"],
    fresh: int = DEFAULTS["fresh"],
    reference_rows: int = DEFAULTS["reference_rows"],
    every_epochs: int = DEFAULTS["every_epochs"],
    seed: int = DEFAULTS["seed"],
) -> Trainability:
    """The ``trainability`` probe (:class:`Trainability`, docs/probes/trainability.md):
    every ``every_epochs`` epochs (and at the first report with reference states), a copy
    of the component and a fresh head fit ``targets`` standardised outputs of a random
    network on ``reference_rows`` reference states with ``steps`` Adam steps (``lr``),
    against ``fresh`` fresh initialisations. It takes no placement."""
    return Trainability(
        steps=steps,
        lr=lr,
        targets=targets,
        fresh=fresh,
        reference_rows=reference_rows,
        every_epochs=every_epochs,
        seed=seed,
    )
