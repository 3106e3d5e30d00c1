"""ProbeState: the common machinery of every tracker.

A tracker holds, per registered component, accumulator tensors (sums and counts, which
:meth:`ProbeState.all_reduce` adds across processes) on the data's device. Hooks hand
their rows to a :class:`~policy_probes.probes.row_buffer.RowBuffer` by reference; a full
buffer, or reading the window, reduces them with one set of kernels for all held rows.
:meth:`ProbeState.to_metrics` moves the accumulators to the host once per window.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from policy_probes.context import ComponentContext
from policy_probes.probes.row_buffer import InPlaceModified, RowBuffer, Scales, block_rows
from policy_probes.probes.rows import COUNT as COUNT  # re-exported for custom trackers
from policy_probes.probes.rows import DrainRound, Rows
from policy_probes.processes import multi_process
from policy_probes.torch_internals import is_functorch_wrapped_tensor

log = logging.getLogger("policy_probes")

# Accumulator dtype of sums (counts are int64: rows.COUNT).
SUM = torch.float64
#: storage and scratch tensors this large are released at the end of a window
#: (:meth:`ProbeState.reset`) instead of being kept for the next one
RELEASED_BYTES = 1 << 20
#: the component and stream name of alike streams reduced as one (:attr:`ProbeState.batch_units`);
#: in a key written per stream, each stream gets its own name in its place
ALIKE = "<alike>"
#: a (component, stream) pair: one row buffer
Member = tuple[str, str]
#: where loaded accumulators go (None: where they were saved)
Device = torch.device | str | None
#: how an accumulator is combined across processes (:meth:`ProbeState.reduced_tensors`)
BY_SUM, BY_MEAN, BY_MAX = "sum", "mean", "max"


@dataclass(frozen=True)
class Drained:
    """One stream's held rows for :meth:`ProbeState.consume`: one **read-only** :class:`Rows`
    per block column (probes share them), every push's row count and scales, and under a
    row mask each row's 0/1 ``weight`` (:class:`~policy_probes.probes.weighted.Weighted`)."""

    component: str
    stream: str
    cols: tuple[Rows, ...]
    segments: list[int]
    scales: list[Scales]
    weight: torch.Tensor | None = None


class ProbeState:
    """Base of the trackers: subclasses set :attr:`probe`, push rows (:meth:`_push`) and
    implement :meth:`consume` and ``summarize(component, state, settings)``, which gets the
    accumulators on the CPU and returns ``metric -> float | list[float]``."""

    probe: str = "probe"
    #: accumulators that are averaged (not summed) across processes
    mean_reduced: frozenset[str] = frozenset()
    #: capacity of each row buffer: ``buffer_rows`` rows, ``buffer_elements`` elements
    buffer_rows: int = 2048
    buffer_elements: int = 1 << 20
    #: seconds spent draining since the sampler (:mod:`policy_probes.sampling`) last looked
    seconds: float = 0.0
    #: whether rows from inside a ``torch.func`` transform were refused (warned once)
    _warned_transformed: bool = False
    #: whether :meth:`consume` writes nothing but the component's accumulators, so a
    #: component holding the very rows of another (its output is its last layer's) can
    #: share that one's accumulators instead of reducing the same rows twice (:meth:`_mirrored`)
    mirrors_identical_rows: bool = False
    #: whether :meth:`consume` writes per-unit accumulators only (units last) from column
    #: reductions, so alike streams (:meth:`RowBuffer.alike_signature`, equal settings) are
    #: reduced as one, side by side (:meth:`_consume_alike`, :meth:`summarize_alike`)
    batch_units: bool = False
    #: attributes (tensors in nested dicts) saved beside the window, as copies
    saved_attributes: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.settings: dict[str, dict[str, Any]] = {}
        #: component -> the hook that claimed it as a layer of its own (:meth:`claim_component`)
        self.claimed: dict[str, Any] = {}
        self.buffers: dict[tuple[str, str], RowBuffer] = {}
        self._scratch: dict[tuple[Any, ...], torch.Tensor] = {}
        #: component -> reason, for reductions that failed (reported by StatsReporter)
        self.errors: dict[str, str] = {}
        #: the context whose trackers drain together
        self.context: ComponentContext | None = None
        #: component -> the component whose accumulators it shares this window (:meth:`_mirrored`)
        self.mirrors: dict[str, str] = {}
        #: alike streams reduced as one in this window -> their shared accumulators
        self.alike: dict[tuple[Member, ...], dict[str, torch.Tensor]] = {}
        #: streams that accumulated in this window; components loaded (:meth:`load_state_dict`)
        self._fed: set[Member] = set()
        self._loaded: set[str] = set()
        #: stream -> the shared accumulators its own are views of
        self._viewing: dict[Member, dict[str, torch.Tensor]] = {}

    # ----------------------------------------------------------- components
    def register_component(self, name: str, **settings: Any) -> bool:
        """Register ``name``; False (nothing changed) if it already is, unless a per-layer
        probe only claimed it (:meth:`claim_component`): this registration replaces that."""
        if name in self.settings:
            owner = self.claimed.pop(name, None)
            if owner is None:
                return False
            self.unregister_component(name)
            self.release(owner, name)  # the claimer stops reading it
        self.settings[name] = dict(settings)
        self.state[name] = {}
        return True

    def claim_component(self, name: str, owner: Any, **settings: Any) -> bool:
        """Register ``name`` for ``owner``, which reads it as a layer inside its own
        component, until a builder registers it; False if registered already."""
        if name in self.settings:
            return False
        self.settings[name] = dict(settings)
        self.state[name] = {}
        self.claimed[name] = owner
        return True

    def release(self, owner: Any, name: str) -> None:
        """``owner`` stops reading ``name``, which another registration took over."""

    def owns(self, name: str, owner: Any) -> bool:
        """Whether ``owner`` still holds its claim on ``name``."""
        return self.claimed.get(name) is owner

    def unregister_component(self, name: str) -> None:
        """Forget ``name`` (used when attaching its hook failed)."""
        self._unmirror_all()
        self.alike = {k: v for k, v in self.alike.items() if all(c != name for c, _ in k)}
        self._fed = {m for m in self._fed if m[0] != name}
        self._viewing = {m: v for m, v in self._viewing.items() if m[0] != name}
        self.settings.pop(name, None)
        self.claimed.pop(name, None)
        self.state.pop(name, None)
        for key in [k for k in self.buffers if k[0] == name]:
            del self.buffers[key]

    def has_component(self, name: str) -> bool:
        return name in self.settings

    @property
    def components(self) -> list[str]:
        return list(self.settings)

    # ----------------------------------------------------------- accumulation
    def _acc(
        self, component: str, key: str, like: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The accumulator ``key`` of ``component``, allocated (zeros) on first use."""
        st = self.state[component]
        t = st.get(key)
        if t is None:
            t = st[key] = torch.zeros(like.shape, dtype=dtype, device=like.device)
        return t

    def _add(self, component: str, key: str, value: torch.Tensor, dtype: torch.dtype = SUM) -> None:
        """Add ``value`` to the accumulator ``key`` of ``component`` (of ``dtype``); later
        adds rely on exact type promotion instead of a conversion op."""
        st = self.state[component]
        acc = st.get(key)
        if acc is None:  # first use in the window: a copy (one op, not zeros + add)
            st[key] = value.to(dtype=dtype, copy=True)
            return
        if acc.shape != value.shape:
            raise ValueError(
                f"probe {self.probe!r} on component {component!r}: the output changed shape "
                f"within a window ({tuple(acc.shape)} -> {tuple(value.shape)} for {key!r}); "
                f"a probed component must keep its number of units"
            )
        acc.add_(value)

    # ----------------------------------------------------------- buffering
    def _push(
        self,
        component: str,
        stream: str,
        blocks: tuple[torch.Tensor, ...],
        scales: Scales = None,
        weight: torch.Tensor | None = None,
    ) -> None:
        """Hold aligned row blocks for :meth:`consume`, with ``scales`` (None = as is) and
        ``weight`` (row-mask rows); a full buffer drains every tracker of the context first.
        Rows from inside a ``torch.func`` transform (``vmap``, ``grad``) are not held
        (:meth:`Observation.transformed <policy_probes.probes.observation.Observation.transformed>`)."""
        if any(map(is_functorch_wrapped_tensor, blocks)):
            if not self._warned_transformed:
                self._warned_transformed = True
                log.warning(
                    "probe %r on component %r: rows from inside a torch.func transform "
                    "(vmap, grad) are not recorded",
                    self.probe,
                    component,
                )
            return
        if weight is not None and weight.numel() != block_rows(blocks[0]):
            raise ValueError(
                f"probe {self.probe!r} on component {component!r}: the row mask bound to this "
                f"pass has {weight.numel()} rows, the pushed tensor {block_rows(blocks[0])}; "
                f"pass a row mask with one entry per row of the minibatch"
            )
        buf = self.buffers.get((component, stream))
        if buf is None:
            buf = self.buffers[(component, stream)] = RowBuffer(
                self.buffer_elements, self.buffer_rows
            )
        if not buf.accepts(blocks):
            # inside a hook, whose timing already counts this drain as the probe's cost
            self.drain(timed=False)
            buf.reserve(blocks)
        buf.append(blocks, scales, weight)

    def scratch(self, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """A reusable tensor shaped like ``like`` (contents undefined, half precision
        widened) for the temporaries of :meth:`consume`; ``slot`` tells several apart."""
        dtype = like.dtype if like.element_size() >= 4 else torch.float32
        rows, tail = like.shape[0], tuple(like.shape[1:])
        key = (slot, tail, dtype, like.device)
        t = self._scratch.get(key)
        if t is None or t.shape[0] < rows:
            width = max(math.prod(tail), 1)
            full = min(self.buffer_rows, max(self.buffer_elements // width, 1))
            t = self._scratch[key] = torch.empty(
                (max(rows, full), *tail), dtype=dtype, device=like.device
            )
        return t[:rows]

    def drain(self, *, timed: bool = True) -> None:
        """Reduce every held row of every tracker of the context (or of this one, without
        a context) in one :class:`~policy_probes.probes.rows.DrainRound`, reading nothing
        back from a device. With ``timed`` each tracker's share is added to its
        ``seconds``; a drain inside a hook (``timed=False``) is the hook's cost. A component
        whose rows cannot be reduced (width changed, a held tensor changed in place) loses
        the window, the reason kept in :attr:`errors`; the others are unaffected."""
        drain_round = DrainRound()
        peers = [self]
        if self.context is not None:
            peers = [t for t in self.context.model_metrics.values() if isinstance(t, ProbeState)]
            if self not in peers:  # taken out of the context: it still drains itself
                peers.append(self)
        for tracker in peers:
            start = time.perf_counter()
            tracker._drain_buffers(drain_round)
            if timed:
                tracker.seconds += time.perf_counter() - start

    def _drain_buffers(self, drain_round: DrainRound) -> None:
        held = [(key, buf) for key, buf in self.buffers.items() if buf.rows]
        if self.mirrors_identical_rows and held:
            mirrored = self._mirrored(held)
            for (component, _), buf in held:
                if component in mirrored:
                    buf.clear()  # the rows its source holds: reduced there
            held = [(key, buf) for key, buf in held if key[0] not in mirrored]
        taken: list[tuple[list[Member], tuple[Any, ...]]] = []
        lost: set[str] = set()
        for group in self._alike_groups(held):
            if len(group) > 1:
                try:
                    keys = [k for k, _ in group]
                    taken.append((keys, RowBuffer.take_alike([b for _, b in group], drain_round)))
                    continue
                except InPlaceModified:
                    pass  # each alone: the buffer that holds the changed rows loses them
            for key, buf in group:
                try:
                    taken.append(([key], buf.take(drain_round)))
                except Exception as exc:  # a reduction must never take training down
                    self._lose_window(key[0], exc)  # its other buffers are emptied too
                    lost.add(key[0])
        for members, (cols, segments, scales, weight) in taken:
            components = {c for c, _ in members}
            if components & lost:
                continue
            try:
                if len(members) == 1:
                    ((component, stream),) = members
                    self.consume(Drained(component, stream, cols, segments, scales, weight))
                    self._fed.add((component, stream))
                else:
                    self._consume_alike(members, Drained(ALIKE, ALIKE, cols, segments, scales))
            except Exception as exc:  # a reduction must never take training down
                for component in components:
                    self._lose_window(component, exc)
                lost |= components

    def batches(self, stream: str) -> bool:
        """Whether ``stream`` may be reduced with alike streams (:attr:`batch_units`)."""
        return self.batch_units

    def _alike_groups(
        self, held: list[tuple[Member, RowBuffer]]
    ) -> list[list[tuple[Member, RowBuffer]]]:
        """``held`` in groups of alike streams (:attr:`batch_units`), in order."""
        groups: list[list[tuple[Member, RowBuffer]]] = []
        signatures: list[Any] = []
        for key, buf in held:
            signature = buf.alike_signature() if self.batches(key[1]) else None
            for i, other in enumerate(signatures):
                if (
                    signature is not None
                    and other == signature
                    and self.settings[groups[i][0][0][0]] == self.settings[key[0]]
                ):
                    groups[i].append((key, buf))
                    break
            else:
                signatures.append(signature)
                groups.append([(key, buf)])
        return groups

    def _consume_alike(self, members: list[Member], batch: Drained) -> None:
        """Reduce alike streams, side by side in ``batch``, in one :meth:`consume` under
        :data:`ALIKE`: streams that start a window together get views of the shared sums,
        others (a loaded checkpoint, a lost window) their share added to their own."""
        names = tuple(members)
        shared = self.alike.get(names)
        together = shared is not None and all(self._viewing.get(m) is shared for m in members)
        if not together and not any(m in self._fed or m[0] in self._loaded for m in members):
            shared, together = {}, True
        target = shared if together and shared is not None else {}
        before = dict(target)
        self.state[ALIKE], self.settings[ALIKE] = target, self.settings[members[0][0]]
        try:
            self.consume(batch)
        finally:
            del self.state[ALIKE], self.settings[ALIKE]
        for key, t in target.items():
            if together and before.get(key) is t:
                continue  # added to in place: the views see it
            for (component, stream), part in zip(members, unit_parts(t, len(members)), strict=True):
                own = key.replace(ALIKE, stream)
                acc = self.state[component].get(own)
                if together:
                    self.state[component][own] = part
                elif acc is None:
                    self.state[component][own] = part.clone()
                else:
                    acc.add_(part)
        if together:
            self.alike[names] = target
            self._viewing.update((m, target) for m in members)
        self._fed.update(members)

    def _mirrored(self, held: list[tuple[Member, RowBuffer]]) -> set[str]:
        """The components of this drain that share another's accumulators instead of
        reducing: the same tensors in the same pushes, equal settings, no row mask, both
        empty when the sharing began; a sharing that ends first copies the accumulators."""
        streams: dict[str, list[Any]] = {}
        masked: set[str] = set()
        for (component, stream), buf in held:
            if any(w is not None for w in buf.weights):
                masked.add(component)
            streams.setdefault(component, []).append(
                (stream, tuple(map(_view_key, buf.pending)), tuple(buf.segments), tuple(buf.scales))
            )
        first: dict[tuple[Any, ...], str] = {}
        mirrored: dict[str, str] = {}
        for component, held_streams in streams.items():
            if component in masked:
                continue
            source = first.setdefault(tuple(held_streams), component)
            if source == component or self.settings[component] != self.settings[source]:
                continue
            if self.mirrors.get(component) == source or (
                component not in self.mirrors
                and not self.state[component]
                and not self.state[source]
            ):
                mirrored[component] = source
        ended = [
            c
            for c, source in self.mirrors.items()
            if mirrored.get(c) != source and (c in streams or source in streams)
        ]
        for component in ended:
            self._unmirror(component)
        for component, source in mirrored.items():
            self.mirrors[component] = source
            self.state[component] = self.state[source]
        return set(mirrored)

    def _unmirror(self, component: str) -> None:
        """Give ``component`` its own copy of the accumulators it shares."""
        source = self.mirrors.pop(component)
        self.state[component] = {k: v.clone() for k, v in self.state[source].items()}

    def _unmirror_all(self) -> None:
        for component in list(self.mirrors):
            self._unmirror(component)

    def _lose_window(self, component: str, exc: Exception) -> None:
        """Drop ``component``'s window (accumulators, held rows), keeping the reason."""
        self._unmirror_all()
        for (comp, _), buf in self.buffers.items():
            if comp == component:
                buf.clear()
        self.state[component].clear()
        self._fed = {m for m in self._fed if m[0] != component}
        self._viewing = {m: v for m, v in self._viewing.items() if m[0] != component}
        self._loaded.discard(component)
        self.errors[component] = f"{type(exc).__name__}: {exc}"

    def flush(self) -> None:
        """Reduce every held row into the accumulators (see :meth:`drain`)."""
        self.drain()

    def consume(self, batch: Drained) -> None:
        """Reduce one stream's rows (:class:`Drained`) with :meth:`_add`, under a row mask
        over the rows of weight 1 only (:class:`~policy_probes.probes.weighted.Weighted`),
        temporaries in :meth:`scratch`."""
        raise NotImplementedError

    # ----------------------------------------------------------- window
    def reset(self) -> None:
        """Start a new window: drop every accumulator and held row; keep storage and scratch
        below :data:`RELEASED_BYTES` (larger ones make the step's own allocations fault)."""
        for component in self.mirrors:
            self.state[component] = {}
        for table in (self.mirrors, self.alike, self._fed, self._loaded, self._viewing):
            table.clear()
        for st in self.state.values():
            st.clear()
        for buf in self.buffers.values():
            buf.clear()
            buf.release(RELEASED_BYTES)
        self._scratch = {k: t for k, t in self._scratch.items() if t.nbytes < RELEASED_BYTES}

    def all_reduce(self, group: Any = None) -> None:
        """Add every accumulator across the processes of ``group`` (zeros for a key a rank
        lacks; no-op when not distributed); see :func:`all_reduce_trackers`."""
        all_reduce_trackers({self.probe: self}, group)

    def reduced_tensors(self) -> dict[tuple[str, ...], tuple[torch.Tensor, str]]:
        """Every accumulator to combine across processes, held rows reduced first:
        ``(component, key) -> (tensor, BY_SUM or BY_MEAN)``; :meth:`set_reduced` takes them back."""
        self.flush()
        self._unmirror_all()  # each component's accumulators are reduced once
        return {
            (c, k): (t, BY_MEAN if k in self.mean_reduced else BY_SUM)
            for c, st in self.state.items()
            for k, t in st.items()
        }

    def set_reduced(self, slot: tuple[str, ...], value: torch.Tensor) -> None:
        """Store the combined ``value`` of one :meth:`reduced_tensors` slot."""
        component, key = slot
        self.state.setdefault(component, {})[key] = value

    # ----------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The window so far: accumulators (held rows reduced first), failures and
        :attr:`saved_attributes`."""
        self.flush()
        out = {
            # a shared window is saved as two (a copy), so a resumed run's components
            # accumulate apart until they share again
            "state": {
                c: {k: v.clone() for k, v in st.items()} if c in self.mirrors else dict(st)
                for c, st in self.state.items()
            },
            "errors": dict(self.errors),
        }
        out.update((name, _copied(getattr(self, name))) for name in self.saved_attributes)
        return out

    def load_state_dict(self, state: dict[str, Any], device: Device = None) -> None:
        """Replace the window with a saved one, the accumulators moved to ``device``. A
        saved component this tracker does not probe is skipped with a warning."""
        self.reset()
        for component, accumulators in state["state"].items():
            if component not in self.state:
                log.warning(
                    "%s: the saved state holds component %r, which this run does not probe; "
                    "skipped",
                    type(self).__name__,
                    component,
                )
                continue
            self.state[component] = {
                k: v if device is None else v.to(device) for k, v in accumulators.items()
            }
            self._loaded.add(component)
        self.errors.update(state.get("errors") or {})
        for name in self.saved_attributes:
            setattr(self, name, _copied(state.get(name) or {}))

    # ----------------------------------------------------------- reporting
    def key(self, component: str, metric: str) -> str:
        return f"probes/{self.probe}/{component}/{metric}"

    def to_metrics(self) -> dict[str, float | list[float]]:
        """``probes/<probe>/<component>/<metric>`` of the window; a ``summarize`` key
        ``(layer, metric)`` becomes ``probes/<probe>/<component>.<layer>/<metric>``."""
        self.flush()
        summaries = self._summarize_alike()
        for comp, st in self.state.items():
            if st and comp not in self.mirrors and comp not in summaries:
                summaries[comp] = self.summarize(comp, to_host(st), self.settings[comp])
        for comp, source in self.mirrors.items():
            shared = summaries.get(source)
            if shared is not None:  # the same accumulators and settings: the same summary
                summaries[comp] = self._mirror_summary(comp, source, shared)
            elif self.state[comp]:
                summaries[comp] = self.summarize(
                    comp, to_host(self.state[comp]), self.settings[comp]
                )
        out: dict[str, float | list[float]] = {}
        root = f"probes/{self.probe}/"
        for comp in self.state:
            prefix = f"{root}{comp}/"
            for metric, value in summaries.get(comp, {}).items():
                if isinstance(metric, tuple):
                    out[f"{root}{comp}.{metric[0]}/{metric[1]}"] = value
                else:
                    out[prefix + metric] = value
        return out

    def summarize(
        self, component: str, state: dict[str, torch.Tensor], settings: dict[str, Any]
    ) -> dict[str, float | list[float]]:
        """The metrics of one component's accumulators (default: :meth:`summarize_alike`
        of it alone)."""
        summaries = self.summarize_alike([component], state, settings)
        if summaries is None:
            raise NotImplementedError
        return summaries[0]

    def summarize_alike(
        self, components: list[str], state: dict[str, torch.Tensor], settings: dict[str, Any]
    ) -> list[dict[str, Any]] | None:
        """Each of ``components``' :meth:`summarize` at once, from their shared accumulators
        (units side by side on the last axis); None (default): one call per component."""
        return None

    def _summarize_alike(self) -> dict[str, dict[Any, Any]]:
        """:meth:`summarize_alike` for each group whose accumulators are views of one set."""
        out: dict[str, dict[Any, Any]] = {}
        for members, shared in self.alike.items():
            components = [c for c, _ in members]
            settings = self.settings[components[0]]
            if len(set(components)) != len(components) or not all(
                self._viewing.get(m) is shared
                and len(self.state[m[0]]) == len(shared)
                and self.settings[m[0]] == settings
                for m in members
            ):
                continue
            summaries = self.summarize_alike(components, to_host(shared), settings)
            if summaries is not None:
                out.update(zip(components, summaries, strict=True))
        return out

    def _mirror_summary(
        self, component: str, source: str, summary: dict[Any, Any]
    ) -> dict[Any, Any]:
        """The summary of ``component``, which shares ``source``'s accumulators:
        ``source``'s, its lists copied (a sink may hold one). Trackers that keep
        per-component results in ``summarize`` override this."""
        return {k: list(v) if isinstance(v, list) else v for k, v in summary.items()}

    def nbytes(self) -> int:
        """Device memory held by accumulators, row buffers and reduction scratch space."""
        acc = sum(t.nbytes for st in self.state.values() for t in st.values())
        scratch = sum(t.nbytes for t in self._scratch.values())
        return acc + scratch + sum(b.nbytes for b in self.buffers.values())

    def holds_graph(self) -> bool:
        """True if any accumulator requires grad (it never should)."""
        return any(
            t.requires_grad or t.grad_fn is not None
            for st in self.state.values()
            for t in st.values()
        )


def to_host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One device-to-host transfer per dtype of a component's accumulators (none on the CPU)."""
    if all(t.device.type == "cpu" for t in state.values()):
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for k, t in state.items():
        by_dtype.setdefault(t.dtype, []).append((k, t))
    for items in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for _, t in items]).cpu()
        offset = 0
        for k, t in items:
            n = t.numel()
            out[k] = flat[offset : offset + n].reshape(t.shape)
            offset += n
    return out


def _copied(tree: Any) -> Any:
    """``tree`` (tensors in nested dicts) with every tensor cloned."""
    return {k: _copied(v) for k, v in tree.items()} if isinstance(tree, dict) else tree.clone()


def rates(count: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """count/total elementwise, 0 where total is 0 (never NaN)."""
    total = total.to(torch.float64)
    return torch.where(
        total > 0, count.to(torch.float64) / total.clamp(min=1), torch.zeros_like(total)
    )


def unit_rates(count: np.ndarray, total: np.ndarray) -> np.ndarray:
    """:func:`rates` on host arrays (float64): count/total, 0 where total is 0."""
    out = np.zeros(total.shape, dtype=np.float64)
    np.divide(count, total, out=out, where=total > 0)
    return out


def row_means(values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Per row of ``values``, ``values[i][keep[i]].mean()`` (0.0 for a row with none); one
    reduction for the rows that keep every entry."""
    out = np.zeros(len(values))
    full = keep.all(axis=1)
    if full.any():
        out[full] = values[full].mean(axis=1)
    for i in np.flatnonzero(~full):
        if keep[i].any():
            out[i] = values[i][keep[i]].mean()
    return out


def unit_share(mask: np.ndarray) -> float:
    """The share of units where ``mask`` holds (NaN for no units, as a mean over none)."""
    return int(np.count_nonzero(mask)) / mask.size if mask.size else math.nan


def indicator_(x: torch.Tensor) -> torch.Tensor:
    """1.0 where the finite ``x > 0``, else 0.0, **in place** (float ops)."""
    return x.sign_().clamp_(min=0.0)


def as_floats(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.reshape(-1).tolist()]


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, as (samples, units): leading dimensions are samples, the last is
    units (a 2-D tensor that needs no grad as is)."""
    if t.requires_grad:
        t = t.detach()
    if t.dim() == 2:
        return t
    if t.dim() == 0:
        return t.reshape(1, 1)
    return t.reshape(-1, t.shape[-1])


def unit_parts(t: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    """``t``'s last axis cut into ``parts`` equal views (:meth:`ProbeState._consume_alike`)."""
    if t.dim() == 0 or t.shape[-1] % parts:
        raise ValueError(
            f"a tracker with batch_units=True wrote an accumulator of shape "
            f"{tuple(t.shape)}, which does not hold {parts} streams' units on its last axis"
        )
    return t.unflatten(-1, (parts, -1)).unbind(-2)


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What tells a held tensor's rows apart from another's (the same memory viewed alike)."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def all_reduce_trackers(trackers: dict[str, Any], group: Any = None) -> None:
    """Combine the accumulators of every tracker (``name -> tracker`` with
    ``reduced_tensors``/``set_reduced``, the same names on every rank) across the processes
    of ``group``: one ``all_gather_object`` of their layouts, then one ``all_reduce`` of one
    flat buffer per dtype and way of combining (zeros for a slot a rank lacks; on the
    current CUDA device for NCCL, else the CPU). A no-op but the held rows' reduction when
    not distributed."""
    slots = {
        (name, *slot): entry
        for name, tracker in trackers.items()
        for slot, entry in tracker.reduced_tensors().items()
    }
    if not multi_process(group):
        return
    world = dist.get_world_size(group)
    layout = sorted((key, tuple(t.shape), str(t.dtype), how) for key, (t, how) in slots.items())
    layouts: list[Any] = [None] * world
    dist.all_gather_object(layouts, layout, group=group)
    union = sorted({entry for lay in layouts for entry in lay})
    nccl = dist.get_backend(group) == "nccl" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    buffers: dict[tuple[str, str], list[tuple[tuple[str, ...], tuple[int, ...]]]] = {}
    for key, shape, dtype_name, how in union:
        buffers.setdefault((dtype_name, how), []).append((key, shape))
    for (dtype_name, how), entries in buffers.items():
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        parts = [
            slots[key][0].reshape(-1)
            if key in slots
            else torch.zeros(math.prod(shape), dtype=dtype)
            for key, shape in entries
        ]
        flat = torch.cat([part.to(device) for part in parts])
        dist.all_reduce(
            flat, op=dist.ReduceOp.MAX if how == BY_MAX else dist.ReduceOp.SUM, group=group
        )
        if how == BY_MEAN:
            flat /= world
        offset = 0
        for key, shape in entries:
            size = math.prod(shape)
            value = flat[offset : offset + size].view(shape)
            offset += size
            home = slots[key][0].device if key in slots else device
            trackers[key[0]].set_reduced(key[1:], value.to(home))
