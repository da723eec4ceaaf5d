import json
import os

from snakemake.utils import validate

from draftsmith.config import coerce_strings, config_errors

# A short message naming each bad key first; then validate() fills in the schema's defaults.
coerce_strings(config)
if config_errors(config):
    raise ValueError("invalid configuration:\n  " + "\n  ".join(config_errors(config)))
validate(config, schema="../draftsmith/config.schema.yaml")
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


def hidden_shards():
    """One extraction output per shard; the count comes from config so a dry-run shows every job."""
    return expand(
        "results/hidden/shard-{shard}.safetensors",
        shard=range(config["extract"]["num_shards"]),
    )


def section_json(section):
    """A whole config section as stable JSON: any change to it reruns the rule that takes it."""
    return json.dumps(config[section], sort_keys=True)


def aux_layers_option():
    layers = config["extract"]["aux_layers"]
    return "--aux-layers " + ",".join(str(i) for i in layers) if layers else ""


def prompt_source_options():
    """CLI options naming the prompt source."""
    prompts = config["prompts"]
    if prompts["source"] == "jsonl":
        return f"--path {prompts['path']}"
    if prompts["source"] == "sharegpt":
        return "--wheel resources/data/sharegpt.whl"
    return ""


def prompt_source_inputs():
    prompts = config["prompts"]
    if prompts["source"] == "jsonl":
        return [prompts["path"]]
    if prompts["source"] == "sharegpt":
        return ["resources/data/sharegpt.whl"]
    return []


def untrained_option(wildcards, input):
    """`--untrained DIR` when the rule takes the untrained baseline as an input, else nothing."""
    return f"--untrained {input.untrained}" if "untrained" in input.keys() else ""
