# The learning curve (not part of `all`): `snakemake --cores all results/curve/curve.md`.
# Each of curve.variants is trained alone for curve.tokens batch tokens on curve.train_samples
# captured train samples (results/curve/features/train), with a held-out point on the validation
# split at log-spaced steps (kvshot.train.curve); curve_report writes the table, figures/curve.pdf
# and where each curve flattens. The drafters and their checkpoints resume like train_drafter's.

rule curve_capture:
    input:
        split=split_jsonl(SimpleNamespace(split="train")),
        target="results/target/model",
    output:
        directory("results/curve/features/train"),
    params:
        cfg=stage_params("data", "target", "features"),
        overlay=curve_capture_overlay,
    log:
        log_path("curve_capture"),
    benchmark:
        bench_path("curve_capture")
    conda:
        DEVICE_ENV
    threads: 1
    resources:
        gpu=capture_gpus(),
        mem_mb=8000,
        runtime=120,
    shell:
        "python -m kvshot capture-features --config {params.cfg:q}{params.overlay} --threads {threads}"
        " --split {input.split} --target {input.target} --out {output} > {log} 2>&1"


use rule train_drafter as curve_train with:
    input:
        train="results/curve/features/train",
        eval="results/features/eval",
        val="results/features/val",
        target="results/target/model",
    output:
        directory("results/curve/drafters/{variant}/seed{seed}"),
    wildcard_constraints:
        variant="|".join(map(re.escape, CURVE_VARIANTS)) or NO_MATCH,
        seed=r"\d+",
    params:
        cfg=variant_params("drafters"),
        overlay=curve_overlay,
        launcher=train_launcher(),
        rank_threads=train_rank_threads(),
    log:
        log_path("curve_train", "_{variant}_seed{seed}"),
    benchmark:
        bench_path("curve_train", "_{variant}_seed{seed}")


rule curve_report:
    input:
        expand("results/curve/drafters/{variant}/seed{seed}", variant=CURVE_VARIANTS, seed=CURVE_SEEDS),
    output:
        table="results/curve/curve.md",
        figure="figures/curve.pdf",
    params:
        cfg=stage_params("drafters", "curve"),
    log:
        log_path("curve_report"),
    benchmark:
        bench_path("curve_report")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
    shell:
        "python -m kvshot curve-report --config {params.cfg:q} --results results/curve --figure {output.figure}"
        " --table {output.table} > {log} 2>&1"
