"""The model card in every export folder: README.md rendered from summary.json (draftsmith.core.export.model_card)."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.core.export.model_card import CARD_NAME, render_card, serve_target
from draftsmith.core.io.atomic import write_text


class SummaryError(ValueError):
    """A summary.json that renders no model card (the message names the file)."""


def render_cards(
    summary_path: str | Path, folders: dict[str, str | Path], target: str | Path
) -> dict[Path, str]:
    """README.md of each export folder (`folders`: engine -> folder), rendered from summary.json; a
    summary that is no JSON or no evaluation summary is a SummaryError naming it. Pure: the export
    stage renders before it writes any export, so a junk summary costs none."""
    fix = "rerun with `snakemake --forcerun eval_summary`"
    try:
        summary = json.loads(Path(summary_path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise SummaryError(f"{summary_path}: not valid JSON ({type(err).__name__}); {fix}") from None
    names = {engine: str(folder) for engine, folder in folders.items()}
    try:
        serve = serve_target(summary, target)
        return {
            Path(f) / CARD_NAME: render_card(summary, engine, names, serve) for engine, f in folders.items()
        }
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as err:
        raise SummaryError(
            f"{summary_path}: not an evaluation summary ({type(err).__name__}: {err}); {fix}"
        ) from None


def write_cards(summary_path: str | Path, folders: dict[str, str | Path], target: str | Path) -> list[Path]:
    """README.md into each export folder (`folders`: engine -> folder), rendered from summary.json;
    returns the cards written."""
    cards = render_cards(summary_path, folders, target)
    for path, text in cards.items():
        write_text(path, text)
    return list(cards)
