# Data scaling (not part of `all`): the drafters retrained on the first N captured train
# samples, evaluated step-wise, MAT plotted against N. The same stages with an overlay.


rule scaling_train:
    input:
        train="results/features/train",
        eval="results/features/eval",
        target="results/target/model",
    output:
        directory("results/scaling/n{n}/drafters/{variant}"),
    wildcard_constraints:
        n=r"\d+",
        variant="|".join(VARIANTS),
    params:
        cfg=variant_params("drafters"),
        overlay=scaling_overlay,
    log:
        log_path("scaling_train", "_n{n}_{variant}"),
    benchmark:
        bench_path("scaling_train", "_n{n}_{variant}")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=6000,
        runtime=240,
    shell:
        "python -m kvshot train-drafter --config {params.cfg:q} --config {params.overlay:q} --threads 1"
        " --variant {wildcards.variant} --train-features {input.train} --eval-features {input.eval}"
        " --target {input.target} --out {output} > {log} 2>&1"


rule scaling_stepwise:
    input:
        drafter="results/scaling/n{n}/drafters/{variant}",
        target="results/target/model",
        continuations="results/eval/continuations.json",
        features="results/features/eval",
    output:
        "results/scaling/n{n}/eval/{variant}/stepwise.json",
    wildcard_constraints:
        n=r"\d+",
        variant="|".join(VARIANTS),
    params:
        cfg=stage_params("target", "drafters", "eval"),
    log:
        log_path("scaling_stepwise", "_n{n}_{variant}"),
    benchmark:
        bench_path("scaling_stepwise", "_n{n}_{variant}")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
    shell:
        "python -m kvshot eval-stepwise --config {params.cfg:q} --threads {threads} --drafter {input.drafter}"
        " --target {input.target} --continuations {input.continuations}"
        " --features-index {input.features}/index.json --out {output} > {log} 2>&1"


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
