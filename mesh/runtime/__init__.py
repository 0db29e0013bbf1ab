"""The peer processes: stage worker, trainer, sessions, registry, state download, checkpoints,
emulated compute, metrics files, and the local launcher of a grid's cell processes.

Never imports the benchmarks. Kept light: cli/join.py imports mesh.runtime.registry before torch.
"""
