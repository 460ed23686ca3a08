"""Helpers shared by the test suite and the benchmarks (no test framework imports here)."""
