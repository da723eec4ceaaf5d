rule train:
    input:
        manifest=data_config,
        vocab=rules.vocab.output[0],
        # read through the manifest; listed so executors without a shared filesystem stage them. Ancient:
        # their content reaches train through the manifest's content digests (a rewritten shard of other
        # content makes another manifest), so shards rewritten to the same bytes retrain nothing
        shards=ancient(train_shards()),
    output:
        **DRAFTER_FILES,
        metrics="results/train/metrics.jsonl",
    # the checkpoints folder is no output: Snakemake deletes a failed job's outputs, wiping what resume needs
    log:
        "logs/train.log",
    benchmark:
        "benchmarks/train.tsv"
    conda:
        "../envs/draftsmith.yaml"
    threads: config["resources"]["train"]["threads"]
    resources:
        gpu=config["resources"]["train"]["gpus"],
        runtime=config["resources"]["train"]["runtime"],
        mem_mb=config["resources"]["train"]["mem_mb"],
        # operational: checkpoints and loading change neither the batches nor their order
        checkpoint_every=config["resources"]["train"]["checkpoint_every"],
        loader_threads=config["resources"]["train"]["loader_threads"],
        # operational: the same optimizer steps in smaller passes, or with activations recomputed
        micro_batch_tokens=config["resources"]["train"]["micro_batch_tokens"],
        checkpoint_ttt=(
            "--checkpoint-ttt" if config["resources"]["train"]["checkpoint_ttt"] else "--no-checkpoint-ttt"
        ),
        report_to=",".join(config["resources"]["train"]["report_to"]),
        keep_hidden_cache=(
            "--keep-hidden-cache"
            if config["resources"]["train"]["keep_hidden_cache"]
            else "--no-keep-hidden-cache"
        ),
    params:
        settings=settings_json(TrainSettings),
        drafter=trained_drafter_dir,
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith train --manifest {input.manifest:q} --vocab {input.vocab:q} --out {params.drafter:q}"
        " --checkpoints results/train/checkpoints --metrics {output.metrics:q}"
        # one data-parallel process per GPU the job was granted (torchrun); on CPU one process
        " --settings {params.settings:q} --threads {threads} --checkpoint-every {resources.checkpoint_every}"
        " --loader-threads {resources.loader_threads} --micro-batch-tokens {resources.micro_batch_tokens}"
        " {resources.checkpoint_ttt} {resources.keep_hidden_cache} --report-to={resources.report_to:q} --nproc $(( {resources.gpu} > 1 ? {resources.gpu} : 1 )) 2>&1 | tee {log:q}"
