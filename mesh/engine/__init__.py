"""The one-process engine: a cell (one stage's state and math) and the grid simulator.

Imports algo, model and data; never the runtime or the benchmarks.
"""
