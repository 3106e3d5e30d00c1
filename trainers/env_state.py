"""Exact save and restore of a vector environment's state, for bit-identical resume.

Gymnasium has no state API, but the classic-control envs, their vector implementations
and the standard wrappers keep their whole state in plain attributes (numpy arrays,
numbers, ``np.random.Generator`` objects, deques). :func:`capture_env_state` records those
of every object in the wrapper stack (sub-envs of a ``SyncVectorEnv`` included) as tensors
and plain containers; :func:`restore_env_state` writes them back into a freshly built env
of the same configuration. An ale-py ``AtariEnv``'s emulator state is saved with ALE's
``cloneState`` (it lacks the action sticky actions repeat, so only games with
``repeat_action_probability=0`` are captured). An env whose state lives elsewhere (a
physics engine, another process as in ``AsyncVectorEnv``, EnvPool's C++ engine) raises
:class:`EnvStateError`, and the trainer then falls back to re-seeding.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
import torch

PLAIN = (bool, int, float, str, type(None))
# Attributes that are configuration, caches of spaces or rendering handles, not state.
SKIPPED = {"spec", "metadata", "render_mode", "env_fns", "_saved_kwargs", "_cached_spec"}
# Env classes known to keep state outside plain attributes, and where it is.
OPAQUE = {
    "AsyncVectorEnv": "keeps its environments in other processes; exact resume needs "
    "env.vectorization=sync or the env's own vector implementation",
    "EnvPoolVectorEnv": "keeps its games in EnvPool's C++ engine, which cannot save them; "
    "exact resume needs env.backend=gymnasium",
}


class EnvStateError(RuntimeError):
    """The env's state cannot be captured exactly."""


def _nodes(env: Any, path: str = "env") -> list[tuple[str, Any]]:
    """Every env object of the stack, outermost first, with a stable path."""
    out: list[tuple[str, Any]] = []
    while env is not None:
        name = type(env).__name__
        if name in OPAQUE:
            raise EnvStateError(f"{name} {OPAQUE[name]}")
        out.append((path, env))
        subs = getattr(env, "envs", None)
        if isinstance(subs, list | tuple):
            for i, sub in enumerate(subs):
                out.extend(_nodes(sub, f"{path}.envs[{i}]"))
        env, path = getattr(env, "env", None), f"{path}.env"
    return out


def _encode(value: Any) -> dict[str, Any] | None:
    """``value`` encoded as plain state, or None for values that are not plain state."""
    if type(value) in PLAIN:  # exact types: np.float64 subclasses float but pickles as numpy
        return {"plain": value}
    if isinstance(value, np.random.Generator):
        bit_generator = value.bit_generator
        return {"generator": type(bit_generator).__name__, "state": bit_generator.state}
    if isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)
        if arr.dtype.kind not in "biuf":
            return None
        return {
            "array": torch.from_numpy(arr.copy()),
            "dtype": arr.dtype.str,
            "scalar": isinstance(value, np.generic),
        }
    if isinstance(value, deque | tuple | list):
        items = [_encode(v) for v in value]
        if any(e is None for e in items):
            return None
        if isinstance(value, deque):
            return {"deque": items, "maxlen": value.maxlen}
        return {"seq": items, "tuple": isinstance(value, tuple)}
    return None


def _decode(enc: dict[str, Any]) -> Any:
    if "plain" in enc:
        return enc["plain"]
    if "generator" in enc:
        bit_generator = getattr(np.random, enc["generator"])()
        bit_generator.state = enc["state"]
        return np.random.Generator(bit_generator)
    if "array" in enc:
        arr = enc["array"].numpy().astype(np.dtype(enc["dtype"]))
        return arr[()] if enc["scalar"] else arr
    if "deque" in enc:
        return deque((_decode(e) for e in enc["deque"]), maxlen=enc["maxlen"])
    items = [_decode(e) for e in enc["seq"]]
    return tuple(items) if enc["tuple"] else items


def _is_ale(obj: Any) -> bool:
    """An ale-py ``AtariEnv`` (by module and name: ale-py need not be installed)."""
    return type(obj).__name__ == "AtariEnv" and type(obj).__module__.startswith("ale_py")


def _capture_emulator(obj: Any) -> torch.Tensor:
    """The ALE emulator's state (RAM, frame counters, system RNG) as uint8 bytes."""
    sticky = obj.ale.getFloat("repeat_action_probability")
    if sticky > 0:
        raise EnvStateError(
            f"AtariEnv uses sticky actions (repeat_action_probability={sticky:g}) and ALE's "
            f"saved state does not hold the action being repeated; exact resume needs "
            f"env.kwargs.repeat_action_probability=0.0"
        )
    state = obj.ale.cloneState(include_rng=True)
    return torch.from_numpy(np.frombuffer(state.__getstate__(), dtype=np.uint8).copy())


def _restore_emulator(obj: Any, data: torch.Tensor) -> None:
    from ale_py import ALEState

    obj.ale.restoreState(ALEState(data.numpy().tobytes()))


def capture_env_state(env: gym.vector.VectorEnv) -> dict[str, Any]:
    """The plain-attribute state of every object in ``env``'s stack (and the emulator
    state of ALE games)."""
    nodes = {}
    for path, obj in _nodes(env):
        attrs = {}
        for key, value in vars(obj).items():
            if key in SKIPPED or isinstance(value, gym.Space):
                continue
            enc = _encode(value)
            if enc is not None:
                attrs[key] = enc
        nodes[path] = {"class": type(obj).__name__, "attrs": attrs}
        if _is_ale(obj):
            nodes[path]["emulator"] = _capture_emulator(obj)
    return nodes


def restore_env_state(env: gym.vector.VectorEnv, state: dict[str, Any]) -> None:
    """Write a :func:`capture_env_state` result into an env built the same way."""
    nodes = dict(_nodes(env))
    if set(nodes) != set(state):
        raise EnvStateError(
            f"the environment stack differs from the checkpoint's: {sorted(nodes)} vs "
            f"{sorted(state)}; build it with the same env settings"
        )
    for path, saved in state.items():
        obj = nodes[path]
        if type(obj).__name__ != saved["class"]:
            raise EnvStateError(
                f"{path} is a {type(obj).__name__}, the checkpoint holds a {saved['class']}"
            )
        for key, enc in saved["attrs"].items():
            setattr(obj, key, _decode(enc))
        if "emulator" in saved:
            _restore_emulator(obj, saved["emulator"])
