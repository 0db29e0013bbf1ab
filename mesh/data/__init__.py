"""Data: tokenizers, `data prepare` (sources -> shards + manifest), the corpus a run reads and
its batches, a pure function of (seed, replica, index)."""
