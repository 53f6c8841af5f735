rule train_tokenizer:
    input:
        train="results/data/train.jsonl",
    output:
        directory("results/target/tokenizer"),
    params:
        cfg=stage_params("tokenizer"),
    log:
        log_path("train_tokenizer"),
    benchmark:
        bench_path("train_tokenizer")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        "python -m kvshot train-tokenizer --config {params.cfg:q} --threads {threads} --train {input.train} --out {output} > {log} 2>&1"


rule target:
    input:
        train="results/data/train.jsonl",
        eval="results/data/eval.jsonl",
        tokenizer="results/target/tokenizer",
    output:
        model=directory("results/target/model"),
        metrics="results/target/metrics.json",
    params:
        cfg=stage_params("data", "target"),
        threads=torch_threads(),
    log:
        log_path("target"),
    benchmark:
        bench_path("target")
    conda:
        DEVICE_ENV
    threads: config["threads"]  # Snakemake caps it at --cores
    resources:
        gpu=gpus(),
        mem_mb=8000,
        runtime=120,
    shell:
        "python -m kvshot target --config {params.cfg:q} --threads {params.threads} --train {input.train} --eval {input.eval}"
        " --tokenizer {input.tokenizer} --out {output.model} --metrics {output.metrics} > {log} 2>&1"
