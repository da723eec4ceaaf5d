"""The model card in every export folder: README.md rendered from summary.json (draftsmith.core.model_card)."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.core.atomic import write_text
from draftsmith.core.model_card import CARD_NAME, render_card, serve_target


def write_cards(summary_path: str | Path, folders: dict[str, str | Path], target: str | Path) -> list[Path]:
    """README.md into each export folder (`folders`: engine -> folder), rendered from summary.json;
    returns the cards written."""
    summary = json.loads(Path(summary_path).read_text(encoding="utf-8"))
    names = {engine: str(folder) for engine, folder in folders.items()}
    serve = serve_target(summary, target)
    written = []
    for engine, folder in folders.items():
        path = Path(folder) / CARD_NAME
        write_text(path, render_card(summary, engine, names, serve))
        written.append(path)
    return written
