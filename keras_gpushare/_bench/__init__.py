"""Benchmarks behind `keras-gpushare bench` and `benchmarks/` (private)."""
