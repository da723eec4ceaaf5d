"""Finished engine runs kept by what they measured, so that a rerun reuses them.

An evaluation of a large target makes several engine loads (plain, each drafter, each free method), at
minutes to half an hour each. Snakemake deletes a failed or killed job's outputs, so a job that wrote its
results only at the end lost every finished run; and a rerun planned behind an input rebuilt to the same
bytes (a deleted manifest made again) measured everything again. Each run's result is kept here as it
finishes, named by a digest of everything that decides it: the request (prompt token ids, lengths,
method, settings, engine options), the target's identity (its config.json and weight files' names and
sizes: a copied or moved target is the same target), the drafter's bytes, and the engine's version.
Content decides, never a path or an mtime. A result that does not parse is measured again.

The folder is no Snakemake output (results/eval/.runs by default): deleting it forgets the runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from draftsmith.core.io.atomic import write_json
from draftsmith.core.io.digests import file_sha256

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def target_identity(folder: str | Path) -> dict[str, Any]:
    """What makes a target folder the same model without reading its weights (hundreds of GB for a
    large target): config.json's content and each weight file's name and size."""
    folder = Path(folder)
    config = folder / "config.json"
    weights = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    return {
        "config": file_sha256(config) if config.is_file() else None,
        "weights": [[p.name, p.stat().st_size] for p in weights],
    }


def export_identity(folder: str | Path) -> dict[str, str]:
    """A drafter export's bytes (megabytes): config.json and its weights; the model card the export stage
    adds later (README.md) changes nothing measured."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.name == "config.json" or p.suffix in WEIGHT_SUFFIXES)
    return {p.name: file_sha256(p) for p in files if p.is_file()}


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed versions of the packages a run depends on (None where absent)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def run_key(request: dict[str, Any]) -> str:
    """A stable digest of a JSON-able description of a run."""
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:32]


class RunCache:
    """Results by run key in a folder; `None` folder: nothing kept (every run measured)."""

    def __init__(self, folder: str | Path | None) -> None:
        self.folder = Path(folder) if folder else None
        self.reused = 0
        self.measured = 0

    def path(self, key: str) -> Path | None:
        return self.folder / f"{key}.json" if self.folder else None

    def get(self, key: str) -> dict[str, Any] | None:
        path = self.path(key)
        if path is None or not path.is_file():
            return None
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            log.warning("%s: a kept run that does not parse; measuring it again", path)
            return None
        return result if isinstance(result, dict) else None

    def run(self, key: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The kept result of `key`, else `measure()`'s, kept as soon as it returns."""
        kept = self.get(key)
        if kept is not None:
            self.reused += 1
            return kept
        result = measure()
        self.measured += 1
        path = self.path(key)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, result)
        return result
