# Only for the embedded default's path: any other target.model must exist already (checked at start).
if MATERIALISE_TARGET:

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
            settings=section_json("target", ["gguf_wheel", "gguf_file"]),
        shell:
            "draftsmith target --out {output:q} --settings {params.settings:q} 2>&1 | tee {log:q}"
