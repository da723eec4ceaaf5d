"""Benchmarks: each prints a table and writes JSON (results/bench/<name>.json); speed is measured here, never
asserted in tests. Run from the repository root as `python -m bench.<name>` (README, "Benchmarks"); the
peer benchmark against SpecForge is the sub-package `bench.peer` (`python -m bench.peer`)."""
