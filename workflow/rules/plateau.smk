# Training to plateau (not part of `all`: the default run's time budget is full):
# `snakemake --cores all results/plateau/claims.md`. The drafters.variants are retrained by the
# same stage with drafters.train.max_steps raised to plateau.max_steps and the plateau rule
# (plateau.rule: held-out loss and acc_0 on the validation split) on, evaluated on the default
# run's anchors and E2E prompts (results/eval/continuations.json, natural.json) and judged by the same report,
# under results/plateau/. Each drafter records how it stopped (metrics.json `stopped_by`).

PLATEAU_SEEDS = [int(s) for s in (config.get("plateau") or {}).get("seeds") or SEEDS]


use rule train_drafter as plateau_train with:
    output:
        directory("results/plateau/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        variant=CORE_GROUPS.alone_pattern(),
        seed=r"\d+",
    params:
        cfg=variant_params("drafters"),
        overlay=plateau_overlay,   # common.smk
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
    log:
        log_path("plateau_train", "_{variant}_seed{seed}"),
    benchmark:
        bench_path("plateau_train", "_{variant}_seed{seed}")


# drafters.group_training: plateau's groups side by side (train.smk's train_drafter_group)
use rule train_drafter_group as plateau_train_group with:
    output:
        directory("results/plateau/drafters/.groups/{group}/seed{seed}"),
    wildcard_constraints:
        group=CORE_GROUPS.group_pattern(),
        seed=r"\d+",
    params:
        cfg=group_params("drafters"),
        overlay=plateau_overlay,
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
        variants=group_variants,
        checkpoints=group_checkpoints,
    log:
        log_path("plateau_train_group", "_{group}_seed{seed}"),
    benchmark:
        bench_path("plateau_train_group", "_{group}_seed{seed}")


localrules:
    plateau_drafter_from_group,


use rule drafter_from_group as plateau_drafter_from_group with:
    input:
        CORE_GROUPS.folder("results/plateau/drafters"),
    output:
        directory("results/plateau/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        variant=CORE_GROUPS.grouped_pattern(),
        seed=r"\d+",
    log:
        log_path("plateau_drafter_from_group", "_{variant}_seed{seed}"),
    benchmark:
        bench_path("plateau_drafter_from_group", "_{variant}_seed{seed}")


use rule eval_stepwise as plateau_stepwise with:
    input:
        **stepwise_inputs(drafter_seeds("results/plateau/drafters/{variant}", PLATEAU_SEEDS)),
    output:
        stepwise="results/plateau/eval/{variant}/stepwise.json",
        natural="results/plateau/eval/{variant}/stepwise_natural.json",
    wildcard_constraints:
        variant="|".join(VARIANTS),
    params:
        cfg=variant_params("target", "drafters", "eval"),
    log:
        log_path("plateau_stepwise", "_{variant}"),
    benchmark:
        bench_path("plateau_stepwise", "_{variant}")


use rule eval_e2e as plateau_e2e with:
    input:
        **decode_inputs(drafters=drafter_seeds("results/plateau/drafters/{variant}", PLATEAU_SEEDS)),
    output:
        "results/plateau/eval/{variant}/e2e.json",
    wildcard_constraints:
        variant="|".join(VARIANTS),
    params:
        cfg=variant_params("target", "drafters", "eval"),
    log:
        log_path("plateau_e2e", "_{variant}"),
    benchmark:
        bench_path("plateau_e2e", "_{variant}")


use rule e2e_timing as plateau_e2e_timing with:
    input:
        **decode_inputs(
            reference=drafter_seeds(f"results/plateau/drafters/{E2E_TIMED[0] if E2E_TIMED else 'none'}", PLATEAU_SEEDS),
            hybrid=drafter_seeds(f"results/plateau/drafters/{E2E_TIMED[-1] if E2E_TIMED else 'none'}", PLATEAU_SEEDS),
        ),
    output:
        "results/plateau/eval/e2e_timing.json",
    log:
        log_path("plateau_e2e_timing"),
    benchmark:
        bench_path("plateau_e2e_timing")


rule plateau_report:
    input:
        stepwise=expand("results/plateau/eval/{variant}/stepwise.json", variant=VARIANTS),
        natural=expand("results/plateau/eval/{variant}/stepwise_natural.json", variant=VARIANTS),
        e2e=expand("results/plateau/eval/{variant}/e2e.json", variant=VARIANTS),
        e2e_timing=["results/plateau/eval/e2e_timing.json"] if E2E_TIMED else [],   # eval.smk
        drafters=expand("results/plateau/drafters/{variant}/seed{seed}", variant=VARIANTS, seed=PLATEAU_SEEDS),
    output:
        tables=directory("results/plateau/tables"),
        figures=expand("results/plateau/figures/{figure}.pdf", figure=FIGURES),   # report.smk
        claims_md="results/plateau/claims.md",
        claims_json="results/plateau/claims.json",
    params:
        cfg=stage_params("drafters"),
    log:
        log_path("plateau_report"),
    benchmark:
        bench_path("plateau_report")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
    shell:
        "python -m kvshot report --config {params.cfg:q} --threads {threads} --results results/plateau"
        " --tables {output.tables} --figures results/plateau/figures --claims-md {output.claims_md}"
        " --claims-json {output.claims_json} > {log} 2>&1"
