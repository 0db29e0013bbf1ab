"""The harness of local process grids, shared by the benchmarks and the tests: start `meshtrain`
peers on 127.0.0.1 (preforked), read their progress and their processes, stop them. No product
module imports it (tests/unit/test_layering.py)."""
