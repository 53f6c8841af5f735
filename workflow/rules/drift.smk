# EAGLE-3.1's attention-drift switches (not part of `all`: the default run's time
# budget is full): `snakemake --cores all figures/drift.pdf`. The drift variants (config
# `drift.variants`: EAGLE-3.1 and its two single-switch ablations, paradigm hidden) are trained,
# evaluated step-wise and decoded by the same stages and seeds as the drafters, under
# results/drift/, then drawn and judged beside the default run's drafters (`drift.compare`,
# results/eval) and the best of `drift.blocks` (results/blockwise/eval, blockwise.smk's rules).

DRIFT_VARIANTS = [v["name"] for v in (config.get("drift") or {}).get("variants") or []]
DRIFT_NAMES = "|".join(re.escape(n) for n in DRIFT_VARIANTS) or "(?!)"   # none: the rules match nothing
DRIFT_GROUPS = TrainGroups(DRIFT_VARIANTS)   # drafters.group_training among them
DRIFT_COMPARE = list((config.get("drift") or {}).get("compare") or [])
DRIFT_BLOCKS = list((config.get("drift") or {}).get("blocks") or [])


use rule train_drafter as drift_train with:
    output:
        directory("results/drift/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        variant=DRIFT_GROUPS.alone_pattern(),
        seed=r"\d+",
    params:
        cfg=variant_params("drafters"),
        overlay="",
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
    log:
        log_path("drift_train", "_{variant}_seed{seed}"),
    benchmark:
        bench_path("drift_train", "_{variant}_seed{seed}")


# drafters.group_training: drift's groups side by side (train.smk's train_drafter_group)
use rule train_drafter_group as drift_train_group with:
    output:
        directory("results/drift/drafters/.groups/{group}/seed{seed}"),
    wildcard_constraints:
        group=DRIFT_GROUPS.group_pattern(),
        seed=r"\d+",
    params:
        cfg=group_params("drafters"),
        overlay="",
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
        variants=group_variants,
        checkpoints=group_checkpoints,
    log:
        log_path("drift_train_group", "_{group}_seed{seed}"),
    benchmark:
        bench_path("drift_train_group", "_{group}_seed{seed}")


localrules:
    drift_drafter_from_group,


use rule drafter_from_group as drift_drafter_from_group with:
    input:
        DRIFT_GROUPS.folder("results/drift/drafters"),
    output:
        directory("results/drift/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        variant=DRIFT_GROUPS.grouped_pattern(),
        seed=r"\d+",
    log:
        log_path("drift_drafter_from_group", "_{variant}_seed{seed}"),
    benchmark:
        bench_path("drift_drafter_from_group", "_{variant}_seed{seed}")


use rule eval_stepwise as drift_stepwise with:
    input:
        **stepwise_inputs(drafter_seeds("results/drift/drafters/{variant}", SEEDS)),
    output:
        stepwise="results/drift/eval/{variant}/stepwise.json",
        natural="results/drift/eval/{variant}/stepwise_natural.json",
    wildcard_constraints:
        variant=DRIFT_NAMES,
    params:
        cfg=variant_params("target", "drafters", "eval"),
    log:
        log_path("drift_stepwise", "_{variant}"),
    benchmark:
        bench_path("drift_stepwise", "_{variant}")


use rule eval_e2e as drift_e2e with:
    input:
        **decode_inputs(drafters=drafter_seeds("results/drift/drafters/{variant}", SEEDS)),
    output:
        "results/drift/eval/{variant}/e2e.json",
    wildcard_constraints:
        variant=DRIFT_NAMES,
    params:
        cfg=variant_params("target", "drafters", "eval"),
    log:
        log_path("drift_e2e", "_{variant}"),
    benchmark:
        bench_path("drift_e2e", "_{variant}")


rule drift_report:
    input:
        drift=expand("results/drift/eval/{variant}/{file}", variant=DRIFT_VARIANTS,
                     file=["stepwise.json", "stepwise_natural.json", "e2e.json"]),
        drift_drafters=expand("results/drift/drafters/{variant}/seed{seed}", variant=DRIFT_VARIANTS, seed=SEEDS),
        compare=expand("results/eval/{variant}/{file}", variant=DRIFT_COMPARE, file=["stepwise.json", "stepwise_natural.json"]),
        compare_drafters=expand("results/drafters/{variant}/seed{seed}", variant=DRIFT_COMPARE, seed=SEEDS),
        blocks=expand("results/blockwise/eval/{variant}/{file}", variant=DRIFT_BLOCKS,
                      file=["stepwise.json", "stepwise_natural.json"]),
        block_drafters=expand("results/blockwise/drafters/{variant}/seed{seed}", variant=DRIFT_BLOCKS, seed=SEEDS),
    output:
        figure=report("figures/drift.pdf", caption="../report/drift.rst", category="Figures"),
        table="results/drift/drift.csv",
        claims_md="results/drift/claims.md",
        claims_json="results/drift/claims.json",
    params:
        cfg=stage_params("drafters", "drift", "blockwise"),
    log:
        log_path("drift_report"),
    benchmark:
        bench_path("drift_report")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
    shell:
        "python -m kvshot drift-report --config {params.cfg:q} --threads {threads} --results results"
        " --figure {output.figure} --table {output.table} --claims-md {output.claims_md}"
        " --claims-json {output.claims_json} > {log} 2>&1"
