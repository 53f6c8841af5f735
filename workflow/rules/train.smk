# One drafter per job: a variant and a training seed (drafters.seeds). With drafters.train.num_processes > 1 the job is DDP through
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
        variant="|".join(VARIANTS),
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
