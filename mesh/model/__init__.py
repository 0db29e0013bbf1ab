"""The staged model: the families (gpt, llama), stage-only construction (build), the Hugging Face
layout (hf) and sampling with a KV cache (generate).

Imports mesh.algo and the config, never the engine, the runtime or the benchmarks.
"""
