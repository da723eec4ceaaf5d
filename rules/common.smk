import hashlib
import json
from pathlib import Path

from snakemake.utils import validate

import draftsmith
from draftsmith.config import coerce_strings, config_errors

# A short message naming each bad key first; then validate() fills in the schema's defaults.
coerce_strings(config)
if config_errors(config):
    raise ValueError("invalid configuration:\n  " + "\n  ".join(config_errors(config)))
validate(config, schema="../draftsmith/config.schema.yaml")


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


# ---- evaluation: held-out sets, gate modes, TensorBoard run name (rules/evaluate.smk)


def heldout_prompts(wildcards):
    return heldout_prompt_file(wildcards.heldout)


def heldout_prompt_file(name):
    """The prompt file of a held-out set: "split" = the prompts stage's held-out split, "handwritten" =
    the packaged hand-written set, anything else = a prompt file of the user's."""
    source = config["evaluate"]["heldout_sets"][name]
    if source == "split":
        return "results/prompts/heldout.jsonl"
    if source == "handwritten":
        return str(Path(draftsmith.__file__).parent / "data" / "heldout_handwritten.jsonl")
    return source


def heldout_prompt_inputs(wildcards):
    """Every held-out set's prompt file, keyed prompts_<set>."""
    return {f"prompts_{name}": heldout_prompt_file(name) for name in config["evaluate"]["heldout_sets"]}


def vllm_set_options():
    """--prompts/--out SET=PATH of every held-out set for the one vLLM job."""
    return " ".join(
        f"--prompts {name}={heldout_prompt_file(name)}" f" --out {name}=results/eval/{name}/vllm.json"
        for name in config["evaluate"]["heldout_sets"]
    )


def eval_summary_sets():
    """--offline/--vllm SET=PATH for every held-out set, in the configured order."""
    options = [
        f"--offline {name}=results/eval/{name}/offline.json" for name in config["evaluate"]["heldout_sets"]
    ]
    if config["evaluate"]["vllm"]:
        options += [
            f"--vllm {name}=results/eval/{name}/vllm.json" for name in config["evaluate"]["heldout_sets"]
        ]
    return " ".join(options)


def offline_num_prompts():
    """The contract check's prompts: never more than vLLM decodes (0 = all)."""
    n, n_offline = config["evaluate"]["num_prompts"], config["evaluate"]["offline_num_prompts"]
    return n if n > 0 and (n_offline == 0 or n_offline > n) else n_offline


def gate_modes():
    return " ".join(f"--check {name}={mode}" for name, mode in config["evaluate"]["gate"].items())


def tensorboard_run():
    """evaluate.tensorboard_run, or a name from a hash of every setting upstream of the drafter, so runs
    that differ in data or training land side by side."""
    if config["evaluate"]["tensorboard_run"]:
        return config["evaluate"]["tensorboard_run"]
    upstream = {k: config[k] for k in ("target", "prompts", "generate", "extract", "vocab", "train")}
    digest = hashlib.sha256(json.dumps(upstream, sort_keys=True).encode()).hexdigest()[:10]
    return f"run-{digest}"
