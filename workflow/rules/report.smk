FIGURES = ["decay", "depth", "gate", "gradients", "query_error", "e2e", "context"]


rule report:
    input:
        stepwise=expand("results/eval/{variant}/stepwise.json", variant=VARIANTS),
        natural=expand("results/eval/{variant}/stepwise_natural.json", variant=VARIANTS),
        e2e=expand("results/eval/{variant}/e2e.json", variant=VARIANTS),
        e2e_timing=["results/eval/e2e_timing.json"] if E2E_TIMED else [],   # eval.smk
        benchmarks=expand("results/eval/{variant}/benchmarks.json", variant=VARIANTS) if BENCHMARKS else [],
        drafters=expand("results/drafters/{variant}/seed{seed}", variant=VARIANTS, seed=SEEDS),
    output:
        tables=report(
            directory("results/tables"),
            patterns=["{name}.csv"],
            caption="../report/tables.rst",
            category="Tables",
        ),
        figures=report(
            expand("figures/{figure}.pdf", figure=FIGURES + (["benchmarks"] if BENCHMARKS else [])),
            caption="../report/figures.rst",
            category="Figures",
        ),
        claims_md=report("results/claims.md", caption="../report/claims.rst", category="Claims"),
        claims_json="results/claims.json",
        fingerprints="results/fingerprints.json",   # every stage's digest and the machine (docs/reproducibility.md)
    params:
        cfg=stage_params("drafters"),
    log:
        log_path("report"),
    benchmark:
        bench_path("report")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
    shell:
        "python -m kvshot report --config {params.cfg:q} --threads {threads} --results results"
        " --tables {output.tables} --figures figures --claims-md {output.claims_md}"
        " --claims-json {output.claims_json} --fingerprints {output.fingerprints}"
        + (" --benchmarks" if BENCHMARKS else "") + " > {log} 2>&1"
