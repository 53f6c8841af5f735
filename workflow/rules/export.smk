# Drafters that leave the lab: a faithful EAGLE-3 variant (hidden-only, one layer, qk_norm:
# false) written as the checkpoint SGLang's LlamaForCausalLMEagle3 and vLLM's Eagle3 loader read
# (kvshot.interop.export, docs/drafter_format.md). Not part of `all`; ask for it:
#   snakemake --cores all results/export/eagle3
# The exported head is the first training seed's (drafters.seeds).

EXPORTABLE = [v["name"] for v in config["drafters"]["variants"]
              if v["paradigm"] == "hidden" and v["layers"] == 1 and v.get("qk_norm") is False
              and not v.get("weights")]


rule export_eagle3:
    input:
        drafter=f"results/drafters/{{variant}}/seed{SEEDS[0]}",
        target="results/target/model",
    output:
        directory("results/export/{variant}"),
    wildcard_constraints:
        variant="|".join(EXPORTABLE) or "(?!)",   # (?!): none to export
    params:
        cfg=stage_params("features"),   # features.aux_layers: the layers the head fuses
    log:
        log_path("export_eagle3", "_{variant}"),
    benchmark:
        bench_path("export_eagle3", "_{variant}")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=8000,   # the fp32 drafter with its copy of the target's embedding (Qwen3-8B: ~3 GB)
        runtime=30,
    shell:
        "python -m kvshot export --format eagle3 --config {params.cfg:q} --threads {threads}"
        " --target {input.target} {input.drafter} {output} > {log} 2>&1"


# A block drafter in DFlash's layout (blockwise variants with context: dflash, one pass) written as the
# folder vLLM's DFlash loader reads (kvshot.interop.dflash). Not part of `all`; ask for it:
#   snakemake --cores all results/blockwise/export/block-dflash
DFLASH_EXPORTABLE = [v["name"] for v in (config.get("blockwise") or {}).get("variants") or []
                     if v["paradigm"] == "block" and v.get("context") == "dflash" and not v.get("refine_passes")]


rule export_dflash:
    input:
        drafter=f"results/blockwise/drafters/{{variant}}/seed{SEEDS[0]}",
        target="results/target/model",
    output:
        directory("results/blockwise/export/{variant}"),
    wildcard_constraints:
        variant="|".join(DFLASH_EXPORTABLE) or "(?!)",
    params:
        cfg=stage_params("features"),
    log:
        log_path("export_dflash", "_{variant}"),
    benchmark:
        bench_path("export_dflash", "_{variant}")
    conda:
        CPU_ENV
    threads: 1
    resources:
        mem_mb=8000,
        runtime=30,
    shell:
        "python -m kvshot export --format dflash --config {params.cfg:q} --threads {threads}"
        " --target {input.target} {input.drafter} {output} > {log} 2>&1"
