"""Benchmarks and the load generator of the tiering engine."""
