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
        # operational: checkpoints, loading, trackers, the same optimizer steps in smaller passes or with
        # activations recomputed change neither the batches nor their order: a resource, rerunning nothing
        ops=ops_json(TrainSettings),
        # training ranks: the job's GPUs but a streamed engine's own (resources.train.engine_gpus)
        nproc=train_processes(),
    params:
        settings=settings_json(TrainSettings),
        drafter=trained_drafter_dir,
    shell:
        "draftsmith run --gpus {resources.gpu} --"
        " draftsmith train --manifest {input.manifest:q} --vocab {input.vocab:q} --out {params.drafter:q}"
        " --checkpoints results/train/checkpoints --metrics {output.metrics:q}"
        # one data-parallel process per GPU the job was granted (torchrun); on CPU one process
        " --settings {params.settings:q} --ops {resources.ops:q} --threads {threads} --nproc {resources.nproc}"
        " 2>&1 | tee {log:q}"
