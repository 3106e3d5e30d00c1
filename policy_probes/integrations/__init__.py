"""Integrations with other training libraries (:mod:`.sb3`: Stable-Baselines3's
``ProbeCallback``; :mod:`.torchrl`: TorchRL's ``ProbeTrainerHook``); each imports its
library only when its own module is imported."""
