# Block-wise drafting and the hybrid's gate remedies (not part of `all`: the default
# run's time budget is full):
# `snakemake --cores all figures/blockwise.pdf`. The block variants (config `blockwise.variants`,
# paradigm block) are trained, evaluated step-wise and decoded by the same stages as the drafters,
# under results/blockwise/, then judged against the default run's KV-only chains (results/eval).
# Their jobs get the variant's own entry as drafters.variants (common.smk `variant_params`).

BLOCK_VARIANTS = [v["name"] for v in (config.get("blockwise") or {}).get("variants", [])]
REMEDIES = [v["name"] for v in (config.get("blockwise") or {}).get("remedies") or []]   # gate remedies (hybrids)
BLOCK_NAMES = "|".join(BLOCK_VARIANTS + REMEDIES) or "(?!)"   # none: the rules match nothing
BLOCK_GROUPS = TrainGroups(BLOCK_VARIANTS + REMEDIES)   # drafters.group_training among them
CHAIN_VARIANTS = [v["name"] for v in config["drafters"]["variants"] if v["paradigm"] == "kv"]
HYBRIDS = [v["name"] for v in config["drafters"]["variants"] if v["paradigm"] == "hybrid"] if REMEDIES else []
OTHERS = [v["name"] for v in config["drafters"]["variants"] if v["name"] not in CHAIN_VARIANTS + HYBRIDS]   # redrawn beside them


use rule train_drafter as blockwise_train with:
    output:
        directory("results/blockwise/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        variant=BLOCK_GROUPS.alone_pattern(),
        seed=r"\d+",
    params:
        cfg=variant_params("drafters"),
        overlay="",
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
    log:
        log_path("blockwise_train", "_{variant}_seed{seed}"),
    benchmark:
        bench_path("blockwise_train", "_{variant}_seed{seed}")


# drafters.group_training: blockwise's groups side by side (train.smk's train_drafter_group)
use rule train_drafter_group as blockwise_train_group with:
    output:
        directory("results/blockwise/drafters/.groups/{group}/seed{seed}"),
    wildcard_constraints:
        group=BLOCK_GROUPS.group_pattern(),
        seed=r"\d+",
    params:
        cfg=group_params("drafters"),
        overlay="",
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
        variants=group_variants,
        checkpoints=group_checkpoints,
    log:
        log_path("blockwise_train_group", "_{group}_seed{seed}"),
    benchmark:
        bench_path("blockwise_train_group", "_{group}_seed{seed}")


localrules:
    blockwise_drafter_from_group,


use rule drafter_from_group as blockwise_drafter_from_group with:
    input:
        BLOCK_GROUPS.folder("results/blockwise/drafters"),
    output:
        directory("results/blockwise/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        variant=BLOCK_GROUPS.grouped_pattern(),
        seed=r"\d+",
    log:
        log_path("blockwise_drafter_from_group", "_{variant}_seed{seed}"),
    benchmark:
        bench_path("blockwise_drafter_from_group", "_{variant}_seed{seed}")


use rule eval_stepwise as blockwise_stepwise with:
    input:
        **stepwise_inputs(drafter_seeds("results/blockwise/drafters/{variant}", SEEDS)),
    output:
        stepwise="results/blockwise/eval/{variant}/stepwise.json",
        natural="results/blockwise/eval/{variant}/stepwise_natural.json",
    wildcard_constraints:
        variant=BLOCK_NAMES,
    params:
        cfg=variant_params("target", "drafters", "eval"),
    log:
        log_path("blockwise_stepwise", "_{variant}"),
    benchmark:
        bench_path("blockwise_stepwise", "_{variant}")


use rule eval_e2e as blockwise_e2e with:
    input:
        **decode_inputs(drafters=drafter_seeds("results/blockwise/drafters/{variant}", SEEDS)),
    output:
        "results/blockwise/eval/{variant}/e2e.json",
    wildcard_constraints:
        variant=BLOCK_NAMES,
    params:
        cfg=variant_params("target", "drafters", "eval"),
    log:
        log_path("blockwise_e2e", "_{variant}"),
    benchmark:
        bench_path("blockwise_e2e", "_{variant}")


rule blockwise_report:
    input:
        block=expand("results/blockwise/eval/{variant}/{file}", variant=BLOCK_VARIANTS + REMEDIES,
                     file=["stepwise.json", "stepwise_natural.json", "e2e.json"]),
        block_drafters=expand("results/blockwise/drafters/{variant}/seed{seed}", variant=BLOCK_VARIANTS + REMEDIES,
                              seed=SEEDS),
        chain=expand("results/eval/{variant}/{file}", variant=CHAIN_VARIANTS + HYBRIDS,
                     file=["stepwise.json", "stepwise_natural.json", "e2e.json"]),
        chain_drafters=expand("results/drafters/{variant}/seed{seed}", variant=CHAIN_VARIANTS + HYBRIDS, seed=SEEDS),
        others=expand("results/eval/{variant}/{file}", variant=OTHERS, file=["stepwise.json", "stepwise_natural.json"]),
        other_drafters=expand("results/drafters/{variant}/seed{seed}", variant=OTHERS, seed=SEEDS),
    output:
        figure=report("figures/blockwise.pdf", caption="../report/blockwise.rst", category="Figures"),
        decay=report("figures/blockwise_decay.pdf", caption="../report/blockwise.rst", category="Figures"),
        depth=report("figures/blockwise_depth.pdf", caption="../report/blockwise.rst", category="Figures"),
        table="results/blockwise/blockwise.csv",
        remedies=["results/blockwise/remedies.csv"] if REMEDIES else [],
        claims_md="results/blockwise/claims.md",
        claims_json="results/blockwise/claims.json",
    params:
        cfg=stage_params("drafters", "blockwise"),
    log:
        log_path("blockwise_report"),
    benchmark:
        bench_path("blockwise_report")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
    shell:
        "python -m kvshot blockwise-report --config {params.cfg:q} --threads {threads} --results results"
        " --figure {output.figure} --table {output.table} --claims-md {output.claims_md}"
        " --claims-json {output.claims_json} --decay-figure {output.decay} --depth-figure {output.depth} > {log} 2>&1"
