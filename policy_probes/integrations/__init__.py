"""Integrations with other training libraries (:mod:`.sb3`: Stable-Baselines3's
``ProbeCallback``); each imports its library only when its own module is imported."""
