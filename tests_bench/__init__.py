"""Tests of the benchmarks and the load generator (`benchmarks/`, installed as
`tiering.benchmarks`): kept apart from `tests/`, which tests the engine and imports nothing
from the benchmarks. `python -m pytest` runs both folders (pyproject's testpaths)."""
