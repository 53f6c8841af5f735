rule prepare_data:
    input:
        local_data_files(config["data"]["sources"]),
    output:
        train="results/data/train.jsonl",
        eval="results/data/eval.jsonl",
        val="results/data/val.jsonl",   # the drafter trainer's held-out curve and plateau stop, never evaluated on
        stats="results/data/stats.json",
    params:
        cfg=stage_params("data"),
    log:
        log_path("prepare_data"),
    benchmark:
        bench_path("prepare_data")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=6000,
        runtime=60,
    shell:
        "python -m kvshot prepare-data --config {params.cfg:q} --threads {threads} --out $(dirname {output.stats}) > {log} 2>&1"
