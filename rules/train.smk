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
    threads: workflow.cores
    resources:
        gpu=config["train"]["gpus"],
    params:
        settings=section_json("train"),
    shell:
        "draftsmith train --data {input.data} --vocab {input.vocab} --out {output.drafter}"
        " --checkpoints results/train/checkpoints --metrics {output.metrics}"
        " --settings {params.settings:q} 2>&1 | tee {log}"
