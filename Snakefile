# draftsmith: train an EAGLE-3 drafter for a target LLM and measure its acceptance before deploying.
# Stages: target -> prompts -> generate -> tokenize -> extract (per shard) -> manifest -> vocab -> train -> evaluate, export


from snakemake.utils import min_version

min_version("9.20")


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


rule all:
    default_target: True
    input:
        "results/drafter",
        "results/drafter-sglang",
        "results/drafter-speculators",
        "results/eval/summary.json",
        "results/eval/acceptance.png",
        "results/eval/gate.json",
