rule generate:
    input:
        target=TARGET,
        prompts="results/prompts/train.jsonl",
    output:
        traces="results/traces.jsonl",
        summary="results/generate_summary.json",
    log:
        "logs/generate.log",
    benchmark:
        "benchmarks/generate.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: workflow.cores
    resources:
        gpu=config["generate"]["gpus"],
    params:
        max_new_tokens=config["generate"]["max_new_tokens"],
        temperature=config["generate"]["temperature"],
        top_p=config["generate"]["top_p"],
        batch_size=config["generate"]["batch_size"],
        seed=config["generate"]["seed"],
        dtype=config["target"]["dtype"],
    shell:
        "draftsmith generate --target {input.target} --prompts {input.prompts}"
        " --out {output.traces} --summary {output.summary}"
        " --max-new-tokens {params.max_new_tokens} --temperature {params.temperature} --top-p {params.top_p}"
        " --batch-size {params.batch_size} --dtype {params.dtype} --seed {params.seed} 2>&1 | tee {log}"
