"""Helpers shared by test modules, one module per concept as draftsmith/core/ is split (tests/unit/ mirrors
it too): `workflow` (the checkout's paths, subprocess, Snakemake and CLI runners), `data` (tiny training
data, damaged data, extraction's tokens files and engines compared), `model` (drafters, floating-point
tolerances), `training` (settings builders, runs and what they leave) and `evaluation` (measurements,
summaries, serving points, a twin target through the stage commands and vLLM). Fixtures and hooks stay in
conftest.py (which imports what it needs from here).

`from helpers.data import ...` resolves as `from conftest import ...` does: pytest's default (prepend)
import mode puts tests/, the folder of the rootdir conftest.py, on sys.path, for unit and e2e tests alike
(bench/ imports the same modules as `tests.helpers.<module>`). Test modules import shared code from here,
never from each other (tests/unit/test_layout.py checks).
"""
