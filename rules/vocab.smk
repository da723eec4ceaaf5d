rule vocab:
    input:
        target=TARGET,
        tokens="results/tokens.safetensors",
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
        settings=section_json("vocab"),
    shell:
        "draftsmith vocab --tokens {input.tokens} --target {input.target} --settings {params.settings:q}"
        " --out {output} 2>&1 | tee {log}"
