# Evaluation: the drafter and two baselines (untrained drafter, n-gram lookup) measured offline and in
# real vLLM on the same held-out prompts; a summary with plots; the gate with its diagnosis.


EVAL = config["evaluate"]
# The measurement settings both engines share: the same prompts, lengths and draft count.
EVAL_OPTIONS = (
    f"--num-prompts {EVAL['num_prompts']} --max-new-tokens {EVAL['max_new_tokens']}"
    f" --num-draft-tokens {EVAL['num_draft_tokens']} --temperature {EVAL['temperature']}"
    f" {'--ngram' if EVAL['ngram'] else '--no-ngram'}"
)
# vllm.json joins the summary only when evaluate.vllm is on.
VLLM_EVAL = {"vllm": "results/eval/vllm.json"} if EVAL["vllm"] else {}
# evaluate.offline: false keeps a huge target out of the workflow's processes: vLLM's measurement
# stands in for the offline one.
if not (EVAL["offline"] or EVAL["vllm"]):
    raise ValueError("evaluate.offline: false needs evaluate.vllm: true (the drafter must be measured)")
OFFLINE_EVAL = "results/eval/offline.json" if EVAL["offline"] else "results/eval/vllm.json"
# The untrained baseline is served by vLLM too only when evaluate.vllm_untrained is on.
VLLM_UNTRAINED = {"untrained": "results/eval/untrained_drafter"} if EVAL["vllm_untrained"] else {}


rule untrained_drafter:
    input:
        data="results/data_config.json",
        vocab="results/vocab_map.pt",
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
        seed=config["train"]["seed"],
    shell:
        "draftsmith untrained-drafter --data {input.data} --vocab {input.vocab} --out {output}"
        " --seed {params.seed} --threads {threads} 2>&1 | tee {log}"


rule evaluate_offline:
    input:
        target=TARGET,
        drafter="results/drafter",
        untrained="results/eval/untrained_drafter",
        prompts="results/prompts/heldout.jsonl",
    output:
        "results/eval/offline.json",
    log:
        "logs/evaluate_offline.log",
    benchmark:
        "benchmarks/evaluate_offline.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["evaluate"]["threads"]
    resources:
        gpu=config["resources"]["evaluate"]["gpus"],
        runtime=config["resources"]["evaluate"]["runtime"],
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
    params:
        options=EVAL_OPTIONS,
        seed=config["evaluate"]["seed"],
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith evaluate --target {input.target} --drafter {input.drafter} --untrained {input.untrained}"
        " --prompts {input.prompts} --out {output} {params.options} --seed {params.seed}"
        " --threads {threads} 2>&1 | tee {log}"


rule evaluate_vllm:
    input:
        **VLLM_UNTRAINED,
        target=TARGET,
        drafter="results/drafter",
        prompts="results/prompts/heldout.jsonl",
    output:
        "results/eval/vllm.json",
    log:
        "logs/evaluate_vllm.log",
    benchmark:
        "benchmarks/evaluate_vllm.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["evaluate"]["threads"]
    resources:
        gpu=config["resources"]["evaluate"]["gpus"],
        runtime=config["resources"]["evaluate"]["runtime"],
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
    params:
        options=EVAL_OPTIONS,
        untrained=untrained_option,
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith evaluate-vllm --target {input.target} --drafter {input.drafter}"
        " {params.untrained} --prompts {input.prompts} --out {output} {params.options}"
        " --log-dir logs/vllm 2>&1 | tee {log}"


rule eval_summary:
    input:
        **VLLM_EVAL,
        offline=OFFLINE_EVAL,
        data="results/data_config.json",
        drafter="results/drafter",
        target=TARGET,
        metrics="results/train/metrics.jsonl",
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
        tau_speedup=report(
            "results/eval/tau_speedup.png",
            caption="../report/tau_speedup.rst",
            category="Evaluation",
            labels={"figure": "tau and speedup"},
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
        vllm=" ".join(f"--vllm {path}" for path in VLLM_EVAL.values()),
        min_tau=config["evaluate"]["min_tau"],
        min_speedup=config["evaluate"]["min_speedup"],
        max_tau_gap=(
            f"--max-tau-gap {config['evaluate']['max_tau_gap']}"
            if config["evaluate"]["max_tau_gap"] is not None
            else ""
        ),
        max_acc_gap=config["evaluate"]["max_acc_gap"],
    shell:
        "draftsmith eval-summary --offline {input.offline} {params.vllm} --data {input.data}"
        " --drafter {input.drafter} --target {input.target} --metrics {input.metrics} --out $(dirname {output.summary})"
        " --min-tau {params.min_tau} --min-speedup {params.min_speedup} {params.max_tau_gap}"
        " --max-acc-gap {params.max_acc_gap} 2>&1 | tee {log}"


# Last, and apart from the summary: when the gate fails, Snakemake deletes only gate.json; the table,
# the diagnosis and the plots stay for `snakemake --report`.
rule gate:
    input:
        "results/eval/summary.json",
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
        "draftsmith gate {input} --out {output} 2>&1 | tee {log}"
