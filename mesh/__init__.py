"""What the numbers mean: the run's vocabulary (config, errors, methods) at the top, then the
rooms algo (pure math), model, data, engine (cell, sim), runtime (peer processes) and bench.

Imports comms, never cli; inside, arrows point down (tests/unit/test_layering.py).
"""
