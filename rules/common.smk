import json
import os
import sys

from snakemake.utils import validate

from draftsmith.config import (
    coerce_strings,
    config_errors,
    is_embedded_target,
    target_checks,
)

# A short message naming each bad key first; then validate() fills in the schema's defaults.
coerce_strings(config)
if config_errors(config):
    raise ValueError("invalid configuration:\n  " + "\n  ".join(config_errors(config)))
validate(config, schema="../draftsmith/config.schema.yaml")
# Against the target's config.json, at parse time: before any job runs or any output is deleted.
TARGET_ERRORS, TARGET_WARNINGS = target_checks(config)
if TARGET_ERRORS:
    raise ValueError("invalid configuration:\n  " + "\n  ".join(TARGET_ERRORS))
for warning in TARGET_WARNINGS:
    print(f"warning: {warning}", file=sys.stderr)
# Jobs inherit this process's environment: every transformers / vLLM load of the target honours it
# (draftsmith.target.TRUST_REMOTE_CODE_ENV; not imported here, torch would slow every parse).
TRUST_REMOTE_CODE = "1" if config["target"]["trust_remote_code"] else "0"
os.environ["DRAFTSMITH_TRUST_REMOTE_CODE"] = TRUST_REMOTE_CODE


# declared: Snakemake passes it on to jobs of remote executors (SLURM, Kubernetes) too
envvars:
    "DRAFTSMITH_TRUST_REMOTE_CODE",


wildcard_constraints:
    shard=r"\d+",


TARGET = config["target"]["model"]
# Only the embedded default target is materialised by the workflow (rules/target.smk).
MATERIALISE_TARGET = bool(config["target"]["gguf_wheel"]) and is_embedded_target(TARGET)


def hidden_shards():
    """One extraction output per shard; the count comes from config so a dry-run shows every job."""
    return expand(
        "results/hidden/shard-{shard}.safetensors",
        shard=range(config["extract"]["num_shards"]),
    )


def section_json(section, keys=None):
    """A config section, or the keys of it that a stage uses, as stable JSON for `--settings`. It is a
    param, so changing any of them reruns the stage; operational knobs live in `resources` instead."""
    values = config[section]
    if keys is not None:
        values = {key: values[key] for key in keys}
    return json.dumps(values, sort_keys=True)


def prompt_wheel_option():
    """The downloaded ShareGPT wheel for source sharegpt (a file, not a setting)."""
    if config["prompts"]["source"] == "sharegpt":
        return "--wheel resources/data/sharegpt.whl"
    return ""


def prompt_source_inputs():
    prompts = config["prompts"]
    held = [prompts["heldout_path"]] if prompts["heldout_path"] else []
    if prompts["source"] == "jsonl":
        return [prompts["path"], *held]
    if prompts["source"] == "sharegpt":
        return ["resources/data/sharegpt.whl", *held]
    return held


def untrained_option(wildcards, input):
    """`--untrained DIR` when the rule takes the untrained baseline as an input, else nothing."""
    return f"--untrained {input.untrained}" if "untrained" in input.keys() else ""
