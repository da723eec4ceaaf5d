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
        # how requests are made, not what they return: resources, so changing them reruns nothing
        # (Snakemake keeps integer resources only; the fractional ones travel as strings)
        concurrency=config["resources"]["generate"]["concurrency"],
        timeout_s=str(config["resources"]["generate"]["timeout_s"]),
        max_retries=config["resources"]["generate"]["max_retries"],
        backoff_s=str(config["resources"]["generate"]["backoff_s"]),
        max_consecutive_failures=config["resources"]["generate"]["max_consecutive_failures"],
        max_failed_fraction=str(config["resources"]["generate"]["max_failed_fraction"]),
        server_startup_timeout_s=str(config["resources"]["generate"]["server_startup_timeout_s"]),
        gpu_memory_utilization=str(config["resources"]["generate"]["gpu_memory_utilization"]),
        tensor_parallel=config["resources"]["generate"]["tensor_parallel"],
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
        " --concurrency {resources.concurrency:q} --timeout-s {resources.timeout_s:q}"
        " --max-retries {resources.max_retries:q} --backoff-s {resources.backoff_s:q}"
        " --max-consecutive-failures {resources.max_consecutive_failures:q}"
        " --max-failed-fraction {resources.max_failed_fraction:q}"
        " --server-startup-timeout-s {resources.server_startup_timeout_s:q}"
        # one server on all the job's GPUs: engines of --tensor-parallel GPUs, data parallel
        " --gpus {resources.gpu} --gpu-memory-utilization {resources.gpu_memory_utilization}"
        " --tensor-parallel {resources.tensor_parallel} --gpu-memory-gib {resources.gpu_memory_gib}"
        " 2>&1 | tee {log:q}"
