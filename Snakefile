# draftsmith: train an EAGLE-3 drafter for a target LLM and measure its acceptance before deploying.
# Stages: target -> prompts -> generate -> tokenize -> extract (every shard) -> manifest -> vocab -> train -> evaluate, export


from snakemake.utils import min_version

from draftsmith.core.config.config import config_file_error, stop_at_start

min_version("9.20")

# config.yaml is the demo's configuration (`make run` = `snakemake --cores all`), read only when no
# --configfile is given: a shipped config (configs/*.yaml), tests/config.tiny.yaml or yours gets the
# schema's defaults plus what it sets, never the demo's choices (`--configfile config.yaml mine.yaml`
# builds on the demo on purpose). Jobs on a cluster re-parse this file with the same --configfile list.
if not workflow.overwrite_configfiles:
    # Snakemake's own reader says only "not valid JSON or YAML"; this names the file and line (files
    # given with --configfile are read by Snakemake before this file is).
    if error := config_file_error("config.yaml"):
        stop_at_start("invalid configuration", [error])

    configfile: "config.yaml"


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/prompts.smk"
include: "rules/generate.smk"
include: "rules/extract.smk"
include: "rules/vocab.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/export.smk"


# every rule is known now: the unsealed intermediates they write are parsed (rules/common.smk)
stop_if_unreadable()


rule all:
    default_target: True
    input:
        rules.export.output.card,
        rules.export.output.sglang,
        rules.export.output.speculators,
        rules.eval_summary.output.summary,
        rules.eval_summary.output.acceptance,
        rules.gate.output[0],
        # asked for, so that a deleted manifest is made again (checkpoint manifest, rules/extract.smk; in
        # stream mode the stream manifest: nothing is extracted)
        rules.stream_manifest.output[0] if STREAM else rules.manifest.output[0],
