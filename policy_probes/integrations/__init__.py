"""Integrations with other training libraries.

* :mod:`policy_probes.integrations.sb3`: ``ProbeCallback`` for Stable-Baselines3
  (``pip install policy-probes[sb3]``).

Each integration imports its library only when its own module is imported, so
``import policy_probes`` never needs them.
"""
