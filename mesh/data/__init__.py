"""Data: the byte-level corpus and its batches, a pure function of (seed, replica, index)."""
