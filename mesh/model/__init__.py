"""The staged model: a model family (gpt) and its cut into pipeline stage modules.

Imports mesh.algo and the config, never the engine, the runtime or the benchmarks.
"""
