"""Harness code shared by the tests and the benchmarks (never used by the runtime)."""
