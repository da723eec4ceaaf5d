# Evaluation: the drafter and two baselines (untrained drafter, n-gram lookup) measured offline and in
# real vLLM on the same prompts of each held-out set; a summary with intervals and plots; the gate.

EVAL = config["evaluate"]
HELDOUT = EVAL["heldout_sets"]


wildcard_constraints:
    heldout=r"[A-Za-z0-9_-]+",


# The measurement settings both engines share: the same prompts, lengths and draft count.
EVAL_OPTIONS = (
    f"--num-prompts {EVAL['num_prompts']} --max-new-tokens {EVAL['max_new_tokens']}"
    f" --num-draft-tokens {EVAL['num_draft_tokens']} --temperature {EVAL['temperature']}"
)
# n-gram lookup is measured where the gate reads it: in vLLM when vLLM runs (offline it would only repeat
# vLLM's numbers at the cost of another decode of every prompt), else offline.
NGRAM = "--ngram" if EVAL["ngram"] else "--no-ngram"
OFFLINE_NGRAM = "--no-ngram" if EVAL["vllm"] else NGRAM
# vllm.json joins the summary only when evaluate.vllm is on.
VLLM_EVAL = {f"vllm_{name}": f"results/eval/{name}/vllm.json" for name in HELDOUT} if EVAL["vllm"] else {}
OFFLINE_EVAL = {f"offline_{name}": f"results/eval/{name}/offline.json" for name in HELDOUT}
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
        gpu=config["evaluate"]["gpus"],
        runtime=config["resources"]["evaluate"]["runtime"],
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
    params:
        options=EVAL_OPTIONS,
        ngram=OFFLINE_NGRAM,
        seed=config["evaluate"]["seed"],
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith evaluate --target {input.target} --drafter {input.drafter} --untrained {input.untrained}"
        " --prompts {input.prompts} --out {output} {params.options} {params.ngram} --seed {params.seed}"
        " --threads {threads} 2>&1 | tee {log}"


rule evaluate_vllm:
    input:
        **VLLM_UNTRAINED,
        target=TARGET,
        drafter="results/drafter",
        prompts=heldout_prompts,
    output:
        "results/eval/{heldout}/vllm.json",
    log:
        "logs/evaluate_vllm/{heldout}.log",
    benchmark:
        "benchmarks/evaluate_vllm/{heldout}.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["evaluate"]["threads"]
    resources:
        gpu=config["evaluate"]["gpus"],
        runtime=config["resources"]["evaluate"]["runtime"],
        mem_mb=config["resources"]["evaluate"]["mem_mb"],
    params:
        options=EVAL_OPTIONS,
        ngram=NGRAM,
        untrained=untrained_option,
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith evaluate-vllm --target {input.target} --drafter {input.drafter}"
        " {params.untrained} --prompts {input.prompts} --out {output} {params.options} {params.ngram}"
        " --log-dir logs/vllm/{wildcards.heldout} 2>&1 | tee {log}"


rule eval_summary:
    input:
        **OFFLINE_EVAL,
        **VLLM_EVAL,
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
        sets=eval_summary_sets(),
        gate=gate_modes(),
        max_tau_gap=(f"--max-tau-gap {EVAL['max_tau_gap']}" if EVAL["max_tau_gap"] is not None else ""),
        max_acc_gap=EVAL["max_acc_gap"],
        min_val_gain=EVAL["min_val_gain"],
        level=EVAL["interval_level"],
        resamples=EVAL["bootstrap_resamples"],
        tensorboard=f"results/tensorboard/{tensorboard_run()}",
    shell:
        "draftsmith eval-summary {params.sets} --data {input.data} --drafter {input.drafter}"
        " --target {input.target} --metrics {input.metrics} --out $(dirname {output.summary})"
        " {params.gate} {params.max_tau_gap} --max-acc-gap {params.max_acc_gap}"
        " --min-val-gain {params.min_val_gain} --level {params.level} --resamples {params.resamples}"
        " --tensorboard {params.tensorboard} 2>&1 | tee {log}"


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
