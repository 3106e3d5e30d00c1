"""Recipes: functions that return a :class:`trainers.TrainTool`.

Run one with ``policy-probes run recipes.cartpole.train [key=value ...]``; list them with
``policy-probes run --list``.
"""
