def local_data_files(sources):
    """The local files a list of data sources reads (`sharegpt_file` paths, and a hub entry's
    `data_files` when they all exist here, as kvshot.data loads them), as rule inputs: editing
    one reruns the rule and everything below it. Hub names and packaged data are not files here."""
    files = []
    for src in sources:
        if src.get("kind") == "sharegpt_file":
            files.append(src["path"])
        elif src.get("kind") == "hub" and src.get("data_files") is not None:
            listed = [src["data_files"]] if isinstance(src["data_files"], str) else list(src["data_files"])
            if all(Path(f).exists() for f in listed):
                files.extend(listed)
    return files


rule prepare_data:
    input:
        local_data_files(config["data"]["sources"]),
    output:
        train="results/data/train.jsonl",
        eval="results/data/eval.jsonl",
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
