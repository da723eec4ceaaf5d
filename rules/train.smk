rule train:
    input:
        data="results/data_config.json",
        vocab="results/vocab_map.pt",
    output:
        drafter=directory("results/drafter"),
        metrics="results/train/metrics.jsonl",
    log:
        "logs/train.log",
    benchmark:
        "benchmarks/train.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["train"]["threads"]
    resources:
        gpu=config["train"]["gpus"],
        runtime=config["resources"]["train"]["runtime"],
        mem_mb=config["resources"]["train"]["mem_mb"],
    params:
        settings=section_json("train"),
        # more than one GPU: one data-parallel process per GPU (torchrun); else one process
        nproc=max(1, config["train"]["gpus"]),
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith train --data {input.data} --vocab {input.vocab} --out {output.drafter}"
        " --checkpoints results/train/checkpoints --metrics {output.metrics}"
        " --settings {params.settings:q} --nproc {params.nproc} 2>&1 | tee {log}"
