rule capture_features:
    input:
        split=split_jsonl,
        target="results/target/model",
    output:
        directory("results/features/{split}"),
    wildcard_constraints:
        split="train|eval|val",
    params:
        cfg=stage_params("data", "target", "features"),
    log:
        log_path("capture_features", "_{split}"),
    benchmark:
        bench_path("capture_features", "_{split}")
    conda:
        DEVICE_ENV
    threads: 1
    resources:
        gpu=capture_gpus(),
        mem_mb=8000,
        runtime=60,
    shell:
        "python -m kvshot capture-features --config {params.cfg:q} --threads {threads} --split {input.split}"
        " --target {input.target} --out {output} > {log} 2>&1"
