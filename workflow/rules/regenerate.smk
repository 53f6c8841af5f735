# Optional (data.regenerate): the target rewrites the training answers, as EAGLE-3 and
# SpecForge train their drafters. Nothing reads results/data/regenerated/train.jsonl unless a
# rule takes its split through split_jsonl (common.smk; capture_features: `split=split_jsonl,`).


rule regenerate_data:
    input:
        train="results/data/train.jsonl",
        target="results/target/model",
    output:
        train="results/data/regenerated/train.jsonl",
        stats="results/data/regenerated/stats.json",
    params:
        cfg=stage_params("data", "target"),
    log:
        log_path("regenerate_data"),
    benchmark:
        bench_path("regenerate_data")
    conda:
        DEVICE_ENV
    threads: 1
    resources:
        gpu=gpus(),
        mem_mb=8000,
        runtime=60,
    shell:
        "python -m kvshot regenerate-data --config {params.cfg:q} --threads {threads} --train {input.train}"
        " --target {input.target} --out {output.train} > {log} 2>&1"
