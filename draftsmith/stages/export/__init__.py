"""The export stage (`draftsmith export`): from the trained vLLM export, the SGLang and speculators forms,
each checked against what its engine reads, and the model card in every export folder.

    stage.py   the SGLang and speculators forms from the trained vLLM export
    card.py    README.md (the model card) into every export folder

The formats themselves, their reader and their checks: draftsmith.core.export_formats.
"""

from draftsmith.stages.export.stage import ExportError, export_engines, export_stage

__all__ = ["ExportError", "export_engines", "export_stage"]
