rule tokenize:
    input:
        target=TARGET,
        traces=rules.generate.output.traces,
    output:
        "results/tokens.safetensors",
    log:
        "logs/tokenize.log",
    benchmark:
        "benchmarks/tokenize.tsv"
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    params:
        settings=settings_json(TokenizeSettings),
    shell:
        "draftsmith tokenize --target {input.target:q} --traces {input.traces:q} --out {output:q}"
        " --settings {params.settings:q} 2>&1 | tee {log:q}"


# One job for every shard: its GPUs are split into vLLM engines (memory.extract_layout, the layout the
# memory plan printed), each loaded once and fed shards from one queue. Finished shards are kept in a
# stash (results/hidden/.done/) that outlives Snakemake deleting a failed job's outputs: the rerun reuses them.
rule extract:
    input:
        target=TARGET,
        tokens=rules.tokenize.output[0],
    output:
        hidden_shards(),
    log:
        "logs/extract.log",
    benchmark:
        "benchmarks/extract.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["extract"]["threads"]
    resources:
        gpu=config["resources"]["extract"]["gpus"],
        runtime=config["resources"]["extract"]["runtime"],
        mem_mb=config["resources"]["extract"]["mem_mb"],
        gpu_memory_gib=gpu_memory_gib(),
        # operational (engine layout, scratch folder, idle timeout): a resource, so changing one reruns nothing
        ops=ops_json(ExtractSettings),
    params:
        # batch_tokens, backend, compile and vllm_eager change the bf16 rounding, storage_dtype the
        # stored values; codec and zstd_level the shard file's bytes (not its tensors)
        settings=settings_json(ExtractSettings),
        dtype=config["target"]["dtype"],
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith extract --target {input.target:q} --tokens {input.tokens:q}"
        " --settings {params.settings:q} --ops {resources.ops:q} --dtype {params.dtype:q} --threads {threads}"
        " --gpus {resources.gpu} --gpu-memory-gib {resources.gpu_memory_gib} {output:q} 2>&1 | tee {log:q}"


# A checkpoint: the jobs that read the manifest are planned again once it is written, so a manifest
# rebuilt to the same content (Snakemake compares the checksums of small inputs) does not retrain.
# (Jobs behind train keep the plan made before: the evaluation reruns.)
checkpoint manifest:
    input:
        target=TARGET,
        shards=hidden_shards(),
    output:
        "results/data_config.json",
    log:
        "logs/manifest.log",
    benchmark:
        "benchmarks/manifest.tsv"
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    params:
        # the shards record the rest (a stream manifest records them instead)
        settings=settings_json(ManifestSettings, only=["min_teacher_agreement"]),
    shell:
        "draftsmith manifest --target {input.target:q} --out {output:q}"
        " --settings {params.settings:q} {input.shards:q} 2>&1 | tee {log:q}"


# train.hidden_states stream or hybrid: the manifest of the tokens file the train job captures the states
# from (no shards, no extract job); the extract keys that decide the states are recorded in it, so
# changing one retrains.
rule stream_manifest:
    input:
        target=TARGET,
        tokens=rules.tokenize.output[0],
    output:
        "results/stream_config.json",
    log:
        "logs/stream_manifest.log",
    benchmark:
        "benchmarks/stream_manifest.tsv"
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    params:
        # codec and zstd_level: hybrid's cache shards' bytes
        settings=settings_json(ManifestSettings, drop=[] if HYBRID else ["codec", "zstd_level"]),
        dtype=config["target"]["dtype"],
        cache="--cache" if HYBRID else "",
    shell:
        "draftsmith manifest --target {input.target:q} --tokens {input.tokens:q} --out {output:q} {params.cache}"
        " --settings {params.settings:q} --dtype {params.dtype:q} 2>&1 | tee {log:q}"
