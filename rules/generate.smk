rule generate:
    input:
        target=TARGET,
        prompts=rules.prompts.output.train,
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
        gpu=config["resources"]["generate"]["gpus"],
        runtime=config["resources"]["generate"]["runtime"],
        mem_mb=config["resources"]["generate"]["mem_mb"],
        # how requests are made, not what they return: a resource, so changing one reruns nothing
        ops=ops_json(GenerateSettings),
        gpu_memory_gib=gpu_memory_gib(),
    params:
        # The whole section: backend, sampling, endpoint, batching, server args (see the schema).
        settings=settings_json(GenerateSettings),
        dtype=config["target"]["dtype"],
        # Not an output: Snakemake deletes the outputs of a failed job, and this file says why it failed.
        errors="results/generate_errors.jsonl",
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith generate --target {input.target:q} --prompts {input.prompts:q}"
        " --out {output.traces:q} --summary {output.summary:q} --errors {params.errors:q}"
        " --settings {params.settings:q} --dtype {params.dtype:q} --server-log logs/vllm-server.log"
        " --ops {resources.ops:q}"
        # one server on all the job's GPUs: engines of tensor_parallel GPUs, data parallel
        " --gpus {resources.gpu} --gpu-memory-gib {resources.gpu_memory_gib}"
        " 2>&1 | tee {log:q}"
