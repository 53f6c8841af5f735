CORE_GROUPS = TrainGroups(VARIANTS)   # drafters.group_training among the core variants


# One drafter per job: a variant and a training seed (drafters.seeds); with drafters.group_training
# a group of variants per job (train_drafter_group, below). With drafters.train.num_processes > 1 the job is DDP through
# `accelerate launch` on a port picked at run time (kvshot.train.launch); the scaling sweep's
# training (scaling.smk) is this rule with an overlay, so it books and runs the same way.


rule train_drafter:
    input:
        train="results/features/train",
        eval="results/features/eval",   # the final teacher-forced metrics only
        val="results/features/val",     # the held-out curve and plateau stop
        target="results/target/model",
    output:
        directory("results/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        variant=CORE_GROUPS.alone_pattern(),   # a grouped variant: drafter_from_group
        seed=r"\d+",
    params:
        cfg=variant_params("drafters"),
        overlay="",   # scaling_train: ` --config <its train_samples and max_steps>`
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
    log:
        log_path("train_drafter", "_{variant}_seed{seed}"),
    benchmark:
        bench_path("train_drafter", "_{variant}_seed{seed}")
    conda:
        DEVICE_ENV
    priority: 1   # before the evaluations of finished variants: with eval.shared_target_pass every drafter gates one job
    threads: train_threads()
    resources:
        gpu=train_gpus(),   # SLURM books these (profiles/slurm); a workstation caps them (--resources gpu=1)
        mem_mb=train_mem_mb(),
        runtime=240,
    # --runtime-minutes: the trainer saves and stops gracefully well before the job's time
    # limit; the retry (profile `retries`) resumes from results/drafters/<variant>/seed<N>.ckpt/.
    shell:
        "{params.launcher} train-drafter --config {params.cfg:q}{params.overlay} --threads {params.rank_threads}"
        " --seed {wildcards.seed} --variant {wildcards.variant} --train-features {input.train} --eval-features {input.eval}"
        " --val-features {input.val}"
        " --target {input.target} --runtime-minutes {resources.runtime} --out {output} > {log} 2>&1"


# drafters.group_training: the members of a group trained side by side in one job, on one stream
# of batches with one target forward (online features) or feature read (offline) per batch; each
# member is the drafter train_drafter trains alone (kvshot.train.group). Its checkpoint is where
# train_drafter keeps it (results/drafters/<variant>/seed<N>.ckpt), so one resumes the other's.
rule train_drafter_group:
    input:
        train="results/features/train",
        eval="results/features/eval",
        val="results/features/val",
        target="results/target/model",
    output:
        directory("results/drafters/.groups/{group}/seed{seed}"),
    wildcard_constraints:
        group=CORE_GROUPS.group_pattern(),
        seed=r"\d+",
    params:
        cfg=group_params("drafters"),
        overlay="",   # scaling_train_group: ` --config <its train_samples and max_steps>`
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
        variants=group_variants,
        checkpoints=group_checkpoints,
    log:
        log_path("train_drafter_group", "_{group}_seed{seed}"),
    benchmark:
        bench_path("train_drafter_group", "_{group}_seed{seed}")
    conda:
        DEVICE_ENV
    priority: 1
    threads: train_threads()
    resources:
        gpu=train_gpus(),
        mem_mb=train_mem_mb(),
        runtime=240,
    shell:
        "{params.launcher} train-drafter --config {params.cfg:q}{params.overlay} --threads {params.rank_threads}"
        " --seed {wildcards.seed} --variant {params.variants} --train-features {input.train} --eval-features {input.eval}"
        " --val-features {input.val} --checkpoints {params.checkpoints}"
        " --target {input.target} --runtime-minutes {resources.runtime} --out {output} > {log} 2>&1"


localrules:
    drafter_from_group,


# A grouped drafter at its usual path (hard links into its group's folder): what every rule reads.
rule drafter_from_group:
    input:
        CORE_GROUPS.folder("results/drafters"),
    output:
        directory("results/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        variant=CORE_GROUPS.grouped_pattern(),
        seed=r"\d+",
    log:
        log_path("drafter_from_group", "_{variant}_seed{seed}"),
    benchmark:
        bench_path("drafter_from_group", "_{variant}_seed{seed}")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=500,
        runtime=10,
    shell:
        "python -c 'import sys; from kvshot.core.io import link_tree; link_tree(*sys.argv[1:])'"
        " {input}/{wildcards.variant} {output} > {log} 2>&1"
