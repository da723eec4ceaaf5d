# Exports, one per engine: the trained vLLM export (rule train, results/drafter) rewritten for SGLang's
# aux-id convention and in speculators' format, each checked against what its engine reads; and in every
# one the model card, from the evaluation's summary (so it follows the figures).


rule export:
    input:
        **DRAFTER_FILES,
        target=TARGET,
        summary=rules.eval_summary.output.summary,
    output:
        sglang=directory("results/drafter-sglang"),
        speculators=directory("results/drafter-speculators"),
        card=f"{DRAFTER}/README.md",
    log:
        "logs/export.log",
    benchmark:
        "benchmarks/export.tsv"
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    params:
        # speculators' default draft length: what the evaluation measured
        num_draft_tokens=config["evaluate"]["num_draft_tokens"],
        drafter=drafter_dir,
    shell:
        "draftsmith export --drafter {params.drafter:q} --target {input.target:q}"
        " --out-sglang {output.sglang:q} --out-speculators {output.speculators:q}"
        " --num-draft-tokens {params.num_draft_tokens:q} --summary {input.summary:q} 2>&1 | tee {log:q}"
