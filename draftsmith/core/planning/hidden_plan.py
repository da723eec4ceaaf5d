"""Where training gets the target's hidden states, planned when the workflow starts (train.hidden_states).

Before any job runs, the plan knows an upper bound of the states' bytes and the free disk, not what
extraction will measure: tokens = the tokens file's count once tokenize has written it, else training
prompts x extract.max_seq_len (one sample per prompt, none longer); bytes = tokens x stored layers (aux +
final) x (hidden x the storage dtype's bytes + its per-row scale), uncompressed (the codec only shrinks
it); free = the disk of the results folder, plus the states an earlier run of this plan already wrote
there (they are what would be written again). From these `choose_mode` picks, for `auto`:

    one epoch                            stream   one prefill either way; nothing to write or read back
    needed x 1.1 > free                  stream   the states do not fit (hybrid's cache is the same bytes)
    needed x 1.1 <= free / 2             files    they fit with room: kept, so a retrain (train.lr, ...)
                                                  reuses them and epochs 1.. read instead of prefilling
    otherwise (fit, over half the disk)  hybrid   they fit only for the run: cached, removed after
                                                  training; or stream when the prefills it saves, (epochs
                                                  - 1) x the prefill time, are under 10 minutes

and `files_refusal` refuses a `files` run whose states cannot fit, pointing to hybrid and stream. Where
the train job cannot stream (on GPUs, its engine and trainer do not fit them: memory.stream_train_needs)
files is the only mode: auto picks it, and a bound that does not fit only warns (the bound is loose: prompts x max_seq_len; the extract job checks each shard's
measured size before writing it). Once a mode has written its manifest,
a later start keeps it while it still fits (the exact token count, known after tokenize, must not flip a
finished run into another mode and rerun it). The prefill time is the cost model's compute floor on the
train job's GPUs (resources.gpu_model), unknown on a CPU.

Pure functions first (the rule, unit-tested by table); the readers of the config, files and disk after.
No torch here: the Snakefile imports this at every start.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.core.config.config import is_hub_target, target_folder
from draftsmith.core.evaluation.cost import DEVICES, active_expert_share
from draftsmith.core.io.units import human_bytes, human_seconds
from draftsmith.core.planning.memory import (
    TargetSize,
    captured_layers,
    config_target,
    device_memory,
    plan_config,
    refusal,
)

# per storage dtype: (bytes a value, bytes a row: one token's values in one layer)
STORAGE_BYTES = {"bfloat16": (2, 0), "float8_e4m3fn": (1, 4)}  # float8: a float32 scale per row
MARGIN = 1.1  # the disk must hold the states + 10% (the extract stage checks the same margin per shard)
KEEP_SHARE = 0.5  # files are kept only when they take at most this share of the free disk
CHEAP_REPREFILL_S = 600.0  # below this, re-prefilling every epoch is not worth a disk-filling cache
# tests only: the free bytes the plan sees (a real disk is never filled to test a refusal)
MAY_NOT_FIT = (
    "the states may not fit (a bound): the extract job checks each shard's measured size before writing it"
)
FREE_BYTES_ENV = "DRAFTSMITH_TEST_FREE_DISK_BYTES"
MODES = ("files", "stream", "hybrid")


def raw_state_bytes(num_tokens: int, stored_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes of hidden states for `stored_layers` (aux + final) per token, stored as `storage_dtype`."""
    value, row = STORAGE_BYTES[storage_dtype]
    return int(num_tokens) * stored_layers * (hidden_size * value + row)


@dataclass(frozen=True)
class StatesEstimate:
    """What the plan knows at start about the run's hidden states."""

    tokens: int  # an upper bound, or the exact count (tokens_source says which)
    tokens_source: str  # e.g. "results/tokens.safetensors" or "160 prompts x extract.max_seq_len 768"
    bytes_per_token: int  # stored layers x (hidden x bytes a value + a row's scale)
    free_bytes: int  # free on the results disk + the states already written there
    written_bytes: int  # of free_bytes: the states an earlier run already wrote
    epochs: int
    prefill_seconds: float | None  # one prefill of the data; None = unknown at start (a CPU)

    @property
    def needed_bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def figures(self) -> str:
        written = f" incl. {human_bytes(self.written_bytes)} already written" if self.written_bytes else ""
        prefill = human_seconds(self.prefill_seconds) if self.prefill_seconds is not None else "unknown"
        return (
            f"states up to {human_bytes(self.needed_bytes)} ({self.tokens:,} tokens from "
            f"{self.tokens_source}; +10% margin {human_bytes(self.needed_bytes * MARGIN)}), "
            f"{human_bytes(self.free_bytes)} free{written}, {self.epochs} epoch(s), prefill per epoch {prefill}"
        )


@dataclass(frozen=True)
class ModeChoice:
    mode: str
    why: str


def fits(est: StatesEstimate, share: float = 1.0) -> bool:
    """Whether the states, with the margin, fit `share` of the free disk."""
    return est.needed_bytes * MARGIN <= share * est.free_bytes


def choose_mode(
    est: StatesEstimate,
    stream_blocked: str | None = None,
    kept: str | None = None,
    hybrid_blocked: str | None = None,
) -> ModeChoice:
    """train.hidden_states auto: the rule of the module's docstring. `stream_blocked`: why the train job
    cannot stream here (then files, the only mode); `hybrid_blocked`: why it cannot cache (then stream where
    hybrid would be chosen); `kept`: the mode an earlier start chose and wrote the manifest of, kept
    while it still runs and fits."""
    still_runs = {
        "files": fits(est),
        "stream": not stream_blocked,
        "hybrid": not stream_blocked and not hybrid_blocked and fits(est),
    }
    if kept and still_runs[kept]:
        return ModeChoice(kept, "an earlier start chose it and wrote its manifest, and it still fits")
    if stream_blocked:
        if fits(est):
            return ModeChoice("files", f"the states fit and the train job cannot stream ({stream_blocked})")
        return ModeChoice(
            "files", f"the only mode the train job can run here ({stream_blocked}); {MAY_NOT_FIT}"
        )
    if est.epochs == 1:
        return ModeChoice("stream", "one epoch: one prefill in any mode, and stream writes nothing")
    if not fits(est):
        return ModeChoice("stream", "the states do not fit the disk (hybrid's cache would be as large)")
    if fits(est, KEEP_SHARE):
        return ModeChoice(
            "files", "the states fit in half the free disk: kept, later epochs and retrains read them"
        )
    saved = (est.epochs - 1) * est.prefill_seconds if est.prefill_seconds is not None else None
    if saved is not None and saved < CHEAP_REPREFILL_S:
        return ModeChoice(
            "stream",
            f"the states fit only in over half the free disk, and re-prefilling costs {human_seconds(saved)} "
            f"(under {human_seconds(CHEAP_REPREFILL_S)})",
        )
    if hybrid_blocked:
        return ModeChoice("stream", f"the states fit only in over half the free disk, and {hybrid_blocked}")
    return ModeChoice(
        "hybrid",
        "the states fit only in over half the free disk: cached for this run, removed after training"
        + (f", saving {human_seconds(saved)} of prefill" if saved is not None else ""),
    )


def files_refusal(est: StatesEstimate, stream_blocked: str | None = None) -> tuple[str | None, str | None]:
    """(the refusal, the warning) of a train.hidden_states files run: refused in one line when its
    states cannot fit and hybrid or stream could run instead; only a warning where neither can (files is
    then the only mode, and the extract job checks each shard's measured size before writing it)."""
    if fits(est):
        return None, None
    figures = (
        f"train.hidden_states: files needs up to {human_bytes(est.needed_bytes * MARGIN)} of shards (+10% "
        f"margin; {est.tokens:,} tokens from {est.tokens_source}) but {human_bytes(est.free_bytes)} is free"
    )
    if stream_blocked:
        return None, f"{figures}; hybrid and stream cannot run here ({stream_blocked}): {MAY_NOT_FIT}"
    return (
        f"{figures}: use hybrid (the same bytes, only while training) or stream (0 B on disk, one prefill "
        "per epoch), or free disk",
        None,
    )


def start_line(choice: ModeChoice, est: StatesEstimate) -> str:
    """The one line the workflow prints at start for auto."""
    return f"train.hidden_states auto -> {choice.mode}: {choice.why}; {est.figures()}"


# ------------------------------------------------------------------ what the config and the disk say


def tokens_in_file(path: str | Path) -> int:
    """The token count of a tokens file, from its header alone (input_ids' shape)."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return int(json.loads(fh.read(length))["input_ids"]["shape"][0])


def token_bound(config: dict[str, Any], results: Path) -> tuple[int, str] | None:
    """(tokens, where from): the tokens file's count, else the training prompts x extract.max_seq_len
    (from results/prompts/train.jsonl once written, else the config); None when the config does not bound
    the prompts (prompts.max_prompts 0 = all of a source not read yet)."""
    tokens = results / "tokens.safetensors"
    if tokens.is_file():
        return tokens_in_file(tokens), str(tokens)
    longest = int(config["extract"]["max_seq_len"])
    prompts_file = results / "prompts" / "train.jsonl"
    if prompts_file.is_file():
        with open(prompts_file, "rb") as fh:
            count = sum(1 for line in fh if line.strip())
        where = str(prompts_file)
    else:
        p = config["prompts"]
        if not p["max_prompts"]:
            return None
        count = int(p["max_prompts"]) - (0 if p["heldout_path"] else int(p["num_heldout"]))
        count = max(count, 0) + int(p["code_prompts"])
        where = "prompts.max_prompts - num_heldout + code_prompts"
    return count * longest, f"{count:,} prompts ({where}) x extract.max_seq_len {longest}"


def written_states(results: Path) -> int:
    """Bytes of states an earlier run wrote: the extract stage's shards and hybrid's cache."""
    paths = [*results.glob("hidden/shard-*.safetensors"), *results.glob("train/checkpoints/*/hidden/shard-*")]
    return sum(p.stat().st_size for p in paths if p.is_file())


def free_disk(results: Path) -> int:
    """Free bytes on the disk that holds `results` (its nearest existing folder)."""
    if os.environ.get(FREE_BYTES_ENV):
        return int(float(os.environ[FREE_BYTES_ENV]))
    folder = results.absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def prefill_seconds(
    config: dict[str, Any], size: TargetSize, target_config: dict[str, Any], tokens: int
) -> float | None:
    """One prefill of `tokens` on the train job's GPUs (where stream and hybrid run it): the cost model's
    compute floor, 2 x active parameters x tokens / (GPUs x peak x efficiency); None without GPUs or a
    resources.gpu_model to price."""
    gpus, model = int(config["resources"]["train"]["gpus"]), config["resources"].get("gpu_model")
    if not gpus or model not in DEVICES:
        return None
    device = DEVICES[model]
    dense = (size.weight_bytes - size.expert_bytes) / size.dtype_bytes
    active = dense + size.expert_bytes / size.dtype_bytes * active_expert_share(target_config)
    return 2 * active * tokens / (gpus * device.tflops * 1e12 * device.flops_efficiency)


def stream_blocked(config: dict[str, Any]) -> str | None:
    """Why the train job cannot capture the states itself here, or None: on GPUs, when its engine and its
    trainer do not fit them as resources.train.engine_gpus places them (memory.stream_train_needs, the
    figure the plan would refuse with); an unknown device or target config blocks nothing (the plan and
    the job check again)."""
    if int(config["resources"]["train"]["gpus"]) <= 0:
        return None
    try:
        memory, device = device_memory(config["resources"])
        needs = plan_config({**config, "train": {**config["train"], "hidden_states": "stream"}}, memory)
    except (ValueError, OSError):
        return None
    streamed = [n for n in needs if n.stage.startswith("train:")]
    if stop := refusal(streamed, device):
        return f"the train job's engine and trainer do not fit its GPUs: {stop}"
    return None


def hybrid_blocked(config: dict[str, Any]) -> str | None:
    """Why the train job cannot cache epoch 0's states here, or None (stages/train.py refuses it)."""
    res = config["resources"]["train"]
    processes = int(res["gpus"]) - int(res["engine_gpus"]) if int(res["engine_gpus"]) else int(res["gpus"])
    if processes > 1:
        return "hybrid with more than one training process (resources.train.gpus > 1) is not built yet"
    return None


def kept_mode(results: Path) -> str | None:
    """The mode whose manifest an earlier start wrote (the newer one if both exist), or None."""
    files, stream = results / "data_config.json", results / "stream_config.json"
    found = [p for p in (files, stream) if p.is_file()]
    if not found:
        return None
    newest = max(found, key=lambda p: p.stat().st_mtime)
    if newest == files:
        return "files"
    try:
        mode = json.loads(stream.read_text(encoding="utf-8")).get("hidden_states")
    except (OSError, ValueError):
        return None
    return mode if mode in ("stream", "hybrid") else None


def states_estimate(config: dict[str, Any], results: Path, fetch: bool) -> StatesEstimate | str:
    """The estimate for a validated config, or why none can be made at start. `fetch`: a Hub target's
    config.json may be fetched (memory.config_target) when not on disk yet."""
    local = (Path(target_folder(config["target"])) / "config.json").is_file()
    if is_hub_target(config["target"]) and not fetch and not local:
        return "the target's config.json is not here yet"
    try:
        size, target_config = config_target(config)
    except (ValueError, OSError) as err:
        return str(err)
    bound = token_bound(config, results)
    if bound is None:
        return "prompts.max_prompts is 0 (all): the training tokens are not bounded before the prompts stage"
    tokens, source = bound
    value, row = STORAGE_BYTES[config["extract"]["storage_dtype"]]
    written = written_states(results)
    return StatesEstimate(
        tokens=tokens,
        tokens_source=source,
        bytes_per_token=captured_layers(config["extract"], size) * (size.hidden_size * value + row),
        free_bytes=free_disk(results) + written,
        written_bytes=written,
        epochs=int(config["train"]["epochs"]),
        prefill_seconds=prefill_seconds(config, size, target_config, tokens),
    )


def plan_hidden_states(
    config: dict[str, Any], results: str | Path = "results"
) -> tuple[str, str | None, str | None]:
    """(the mode the workflow runs, the line to print at start or None, the refusal or None) for
    train.hidden_states on a validated config."""
    mode, results = config["train"]["hidden_states"], Path(results)
    if mode in ("stream", "hybrid"):
        return mode, None, None
    est = states_estimate(config, results, fetch=mode == "auto")
    if mode == "files":
        if isinstance(est, str):
            return mode, None, None
        refusal, warning = files_refusal(est, stream_blocked(config))
        return mode, warning and f"warning: {warning}", refusal
    if isinstance(est, str):
        if blocked := stream_blocked(config):
            return "files", f"train.hidden_states auto -> files: the only mode here ({blocked}); {est}", None
        return (
            mode,
            None,
            f"train.hidden_states: auto cannot size the states at start ({est}); set files, stream or hybrid",
        )
    choice = choose_mode(est, stream_blocked(config), kept_mode(results), hybrid_blocked(config))
    return choice.mode, start_line(choice, est), None
