"""What the numbers mean: config, model, schedules, optimizers, the grid and its engines.

Imports comms, never cli.
"""
