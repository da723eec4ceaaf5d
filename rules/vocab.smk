rule vocab:
    input:
        target=TARGET,
        tokens=rules.tokenize.output[0],
    output:
        "results/vocab_map.pt",
    log:
        "logs/vocab.log",
    benchmark:
        "benchmarks/vocab.tsv"
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    params:
        settings=settings_json(VocabSettings),
    shell:
        "draftsmith vocab --tokens {input.tokens:q} --target {input.target:q} --settings {params.settings:q}"
        " --out {output:q} 2>&1 | tee {log:q}"
