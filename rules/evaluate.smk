rule evaluate:
    input:
        target=TARGET,
        drafter="results/drafter",
        prompts="results/prompts/heldout.jsonl",
    output:
        summary="results/eval/summary.json",
        plot=report("results/eval/acceptance.png", caption="../report/acceptance.rst", category="Evaluation"),
    log:
        "logs/evaluate.log",
    benchmark:
        "benchmarks/evaluate.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: workflow.cores
    resources:
        gpu=config["evaluate"]["gpus"],
    params:
        num_prompts=config["evaluate"]["num_prompts"],
        max_new_tokens=config["evaluate"]["max_new_tokens"],
        num_draft_tokens=config["evaluate"]["num_draft_tokens"],
        min_tau=config["evaluate"]["min_tau"],
    shell:
        "draftsmith evaluate --target {input.target} --drafter {input.drafter} --prompts {input.prompts}"
        " --out results/eval --num-prompts {params.num_prompts} --max-new-tokens {params.max_new_tokens}"
        " --num-draft-tokens {params.num_draft_tokens} --min-tau {params.min_tau} --threads {threads}"
        " 2>&1 | tee {log}"
