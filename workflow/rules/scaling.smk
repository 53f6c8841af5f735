# Data scaling (not part of `all`): the drafters retrained on the first N captured train
# samples, evaluated step-wise, MAT plotted against N. The same stages with an overlay.


# Training: train_drafter's launcher, threads, env and resources, on the first N samples with
# max_steps scaled by N / max(N) so that every N sees the same number of epochs as the largest
# N does at drafters.train.max_steps (paper: 15k, 30k, 60k steps for 70k, 140k, 280k; 1.71
# epochs each at a global batch of 8).
SCALING_GROUPS = TrainGroups(VARIANTS, among=config["scaling"]["variants"])   # drafters.group_training in the sweep


use rule train_drafter as scaling_train with:
    output:
        directory("results/scaling/n{n}/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        n=r"\d+",
        variant=SCALING_GROUPS.alone_pattern(),
        seed=r"\d+",
    params:
        cfg=variant_params("drafters"),
        overlay=scaling_overlay,
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
    log:
        log_path("scaling_train", "_n{n}_{variant}_seed{seed}"),
    benchmark:
        bench_path("scaling_train", "_n{n}_{variant}_seed{seed}")


# drafters.group_training: scaling's groups side by side (train.smk's train_drafter_group)
use rule train_drafter_group as scaling_train_group with:
    output:
        directory("results/scaling/n{n}/drafters/.groups/{group}/seed{seed}"),
    wildcard_constraints:
        n=r"\d+",
        group=SCALING_GROUPS.group_pattern(),
        seed=r"\d+",
    params:
        cfg=group_params("drafters"),
        overlay=scaling_overlay,
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
        variants=group_variants,
        checkpoints=group_checkpoints,
    log:
        log_path("scaling_train_group", "_n{n}_{group}_seed{seed}"),
    benchmark:
        bench_path("scaling_train_group", "_n{n}_{group}_seed{seed}")


localrules:
    scaling_drafter_from_group,


use rule drafter_from_group as scaling_drafter_from_group with:
    input:
        SCALING_GROUPS.folder("results/scaling/n{n}/drafters"),
    output:
        directory("results/scaling/n{n}/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        n=r"\d+",
        variant=SCALING_GROUPS.grouped_pattern(),
        seed=r"\d+",
    log:
        log_path("scaling_drafter_from_group", "_n{n}_{variant}_seed{seed}"),
    benchmark:
        bench_path("scaling_drafter_from_group", "_n{n}_{variant}_seed{seed}")


# Evaluation: eval_stepwise on the sweep's drafters (scaling.seeds; default the first of
# drafters.seeds), both protocols.
use rule eval_stepwise as scaling_stepwise with:
    input:
        **stepwise_inputs(drafter_seeds("results/scaling/n{n}/drafters/{variant}", SCALING_SEEDS)),
    output:
        stepwise="results/scaling/n{n}/eval/{variant}/stepwise.json",
        natural="results/scaling/n{n}/eval/{variant}/stepwise_natural.json",
    wildcard_constraints:
        n=r"\d+",
        variant="|".join(VARIANTS),
    params:
        cfg=stage_params("target", "drafters", "eval"),
    log:
        log_path("scaling_stepwise", "_n{n}_{variant}"),
    benchmark:
        bench_path("scaling_stepwise", "_n{n}_{variant}")


rule scaling_report:
    input:
        expand(
            "results/scaling/n{n}/eval/{variant}/stepwise.json",
            n=config["scaling"]["train_samples"],
            variant=config["scaling"]["variants"],
        ),
    output:
        figure=report("figures/scaling.pdf", caption="../report/scaling.rst", category="Figures"),
        table="results/scaling/scaling.csv",
    params:
        cfg=stage_params("drafters", "scaling"),
    log:
        log_path("scaling_report"),
    benchmark:
        bench_path("scaling_report")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
    shell:
        "python -m kvshot scaling-report --config {params.cfg:q} --threads {threads} --results results/scaling"
        " --figure {output.figure} --table {output.table} > {log} 2>&1"
