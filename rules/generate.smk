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
    threads: config["resources"]["generate"]["threads"]
    resources:
        gpu=config["generate"]["gpus"],
        runtime=config["resources"]["generate"]["runtime"],
        mem_mb=config["resources"]["generate"]["mem_mb"],
    params:
        # The whole section: engine, sampling, endpoint, concurrency, server args (see the schema).
        settings=section_json("generate"),
        dtype=config["target"]["dtype"],
        # Not an output: Snakemake deletes the outputs of a failed job, and this file says why it failed.
        errors="results/generate_errors.jsonl",
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith generate --target {input.target} --prompts {input.prompts}"
        " --out {output.traces} --summary {output.summary} --errors {params.errors}"
        " --settings {params.settings:q} --dtype {params.dtype} --server-log logs/vllm-server.log"
        " 2>&1 | tee {log}"
