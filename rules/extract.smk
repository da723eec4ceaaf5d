rule tokenize:
    input:
        target=TARGET,
        traces="results/traces.jsonl",
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
        num_shards=config["extract"]["num_shards"],
        max_seq_len=config["extract"]["max_seq_len"],
    shell:
        "draftsmith tokenize --target {input.target} --traces {input.traces} --out {output}"
        " --num-shards {params.num_shards} --max-seq-len {params.max_seq_len} 2>&1 | tee {log}"


rule extract:
    input:
        target=TARGET,
        tokens="results/tokens.safetensors",
    output:
        "results/hidden/shard-{shard}.safetensors",
    log:
        "logs/extract/shard-{shard}.log",
    benchmark:
        "benchmarks/extract/shard-{shard}.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["extract"]["threads"]
    resources:
        gpu=config["extract"]["gpus"],
        runtime=config["resources"]["extract"]["runtime"],
        mem_mb=config["resources"]["extract"]["mem_mb"],
    params:
        aux_layers=aux_layers_option(),
        dtype=config["target"]["dtype"],
        batch_tokens=config["extract"]["batch_tokens"],
        codec=config["extract"]["codec"],
        zstd_level=config["extract"]["zstd_level"],
        engine=config["extract"]["engine"],
        # YAML reads a bare on/off as a boolean
        compile={True: "on", False: "off"}.get(config["extract"]["compile"], config["extract"]["compile"]),
        vllm_eager="--vllm-eager" if config["extract"]["vllm_eager"] else "--vllm-compiled",
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith extract --target {input.target} --tokens {input.tokens} --shard {wildcards.shard}"
        " --out {output} {params.aux_layers} --dtype {params.dtype} --batch-tokens {params.batch_tokens}"
        " --codec {params.codec} --zstd-level {params.zstd_level} --threads {threads}"
        " --engine {params.engine} --compile {params.compile} --gpus {resources.gpu} {params.vllm_eager}"
        " 2>&1 | tee {log}"


rule manifest:
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
        min_teacher_agreement=config["extract"]["min_teacher_agreement"],
    shell:
        "draftsmith manifest --target {input.target} --out {output}"
        " --min-teacher-agreement {params.min_teacher_agreement} {input.shards} 2>&1 | tee {log}"
