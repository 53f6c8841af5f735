# Published Qwen3-8B EAGLE-3 heads (config `published.heads`, paper config) through the same
# eval-stepwise and eval-e2e as the trained drafters, with each publisher's decoding (its chain or
# tree), beside the publisher's figures (docs/published-heads.md). Not part of `all`; ask for it:
#   snakemake --cores all --configfile config/paper.yaml results/published/table.md
# The head is read from the HF cache at its pinned revision (scripts/predownload_hub.py lists it;
# offline runs set HF_HUB_OFFLINE=1) and imported by train-drafter's `weights:` path (kvshot.interop.published).
# PUBLISHED and published_params: common.smk.

rule import_published:
    input:
        train="results/features/train",   # the aux layers the features hold: the head must fuse the same
        eval="results/features/eval",
        target="results/target/model",
    output:
        directory("results/published/{variant}/drafter"),
    wildcard_constraints:
        variant=PUBLISHED_NAMES,
    params:
        cfg=published_params("drafters"),
    log:
        log_path("import_published", "_{variant}"),
    benchmark:
        bench_path("import_published", "_{variant}")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=16000,   # the fp32 head and a copy of the target's embedding (Qwen3-8B: ~3 GB)
        runtime=30,
    shell:
        "python -m kvshot train-drafter --config {params.cfg:q} --threads {threads} --variant {wildcards.variant}"
        " --train-features {input.train} --eval-features {input.eval} --target {input.target} --out {output}"
        " > {log} 2>&1"


use rule eval_stepwise as published_stepwise with:
    input:
        **stepwise_inputs("results/published/{variant}/drafter"),
    output:
        stepwise="results/published/{variant}/stepwise.json",
        natural="results/published/{variant}/stepwise_natural.json",
    wildcard_constraints:
        variant=PUBLISHED_NAMES,
    params:
        cfg=published_params("target", "drafters", "eval"),
    log:
        log_path("published_stepwise", "_{variant}"),
    benchmark:
        bench_path("published_stepwise", "_{variant}")


use rule eval_e2e as published_e2e with:
    input:
        **decode_inputs(drafters="results/published/{variant}/drafter"),
    output:
        "results/published/{variant}/e2e.json",
    wildcard_constraints:
        variant=PUBLISHED_NAMES,
    params:
        cfg=published_params("target", "drafters", "eval"),
    log:
        log_path("published_e2e", "_{variant}"),
    benchmark:
        bench_path("published_e2e", "_{variant}")


use rule eval_benchmarks as published_benchmarks with:
    input:
        drafters="results/published/{variant}/drafter",
        target="results/target/model",
        eval="results/data/eval.jsonl",
        features="results/features/eval",
    output:
        "results/published/{variant}/benchmarks.json",
    wildcard_constraints:
        variant=PUBLISHED_NAMES,
    params:
        cfg=published_params("target", "drafters", "eval", "benchmarks"),   # (config.BENCHMARKS_AXIS)
    log:
        log_path("published_benchmarks", "_{variant}"),
    benchmark:
        bench_path("published_benchmarks", "_{variant}")


rule published_table:
    input:
        e2e=expand("results/published/{variant}/e2e.json", variant=list(PUBLISHED)),
        stepwise=expand("results/published/{variant}/stepwise.json", variant=list(PUBLISHED)),
        benchmarks=expand("results/published/{variant}/benchmarks.json", variant=list(PUBLISHED))
        if config["eval"]["e2e"].get("benchmarks")
        else [],
    output:
        "results/published/table.md",
    params:
        cfg=stage_params("published"),
    log:
        log_path("published_table"),
    benchmark:
        bench_path("published_table")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "python -m kvshot published-table --config {params.cfg:q} --threads {threads}"
        " --results results/published --table {output} > {log} 2>&1"
