rule train_drafter:
    input:
        train="results/features/train",
        eval="results/features/eval",
        target="results/target/model",
    output:
        directory("results/drafters/{variant}"),
    wildcard_constraints:
        variant="|".join(VARIANTS),
    params:
        cfg=variant_params("drafters"),
        launcher=train_launcher(),
    log:
        log_path("train_drafter", "_{variant}"),
    benchmark:
        bench_path("train_drafter", "_{variant}")
    conda:
        CPU_ENV
    threads: config["drafters"]["train"]["num_processes"]
    resources:
        mem_mb=6000,
        runtime=240,
    shell:
        "{params.launcher} train-drafter --config {params.cfg:q} --threads 1 --variant {wildcards.variant}"
        " --train-features {input.train} --eval-features {input.eval} --target {input.target}"
        " --out {output} > {log} 2>&1"
