# Drafters in the engine users deploy (kvshot.serve, docs/serving.md). Not part of `all`; ask for it:
#   snakemake --cores all results/serve/vllm.json
# The run's exported EAGLE-3 drafters and DFlash-layout block drafters (export.smk) in vLLM, plain and at
# each serve.ks, beside kvshot's decoder, HF generate, HF assisted generation (the standalone drafter) and prompt lookup, on eval.e2e's
# held-out prompts. vLLM pins its own transformers: the job runs in envs/vllm-cpu.yaml (vllm-cuda.yaml on
# CUDA) under --sdm conda; without it, `python -m kvshot serve` builds that env's pins as a venv once per
# machine (~/.cache/kvshot/vllm-*) and runs there.

VLLM_ENV = "../../envs/vllm-cuda.yaml" if config["device"] == "cuda" else "../../envs/vllm-cpu.yaml"
ASSISTANT = next((v["name"] for v in config["drafters"]["variants"] if v["paradigm"] == "standalone"), None)


rule serve_vllm:
    input:
        exports=expand("results/export/{variant}", variant=EXPORTABLE)
        + expand("results/blockwise/export/{variant}", variant=DFLASH_EXPORTABLE),
        drafters=expand("results/drafters/{variant}/seed{seed}", variant=EXPORTABLE, seed=SEEDS[0])
        + expand("results/blockwise/drafters/{variant}/seed{seed}", variant=DFLASH_EXPORTABLE, seed=SEEDS[0]),
        assistant=[f"results/drafters/{ASSISTANT}/seed{SEEDS[0]}"] if ASSISTANT else [],
        target="results/target/model",
        prompts="results/eval/natural.json",
        features="results/features/eval",
    output:
        json="results/serve/vllm.json",
        table="results/serve/vllm.md",
    params:
        cfg=stage_params("target", "drafters", "eval", "serve"),
        assistant=lambda wildcards, input: f"--assistant {input.assistant[0]}" if input.assistant else "",
    log:
        log_path("serve_vllm"),
    benchmark:
        bench_path("serve_vllm")
    conda:
        VLLM_ENV
    threads: config["threads"]
    resources:
        gpu=gpus(),
        mem_mb=24000,   # one vLLM engine per drafter and K (~1.7 GB each on the toy), each with serve.kv_cache_gib of KV cache
        runtime=120,
    shell:
        "python -m kvshot serve --config {params.cfg:q} --threads {threads} --target {input.target}"
        " --export {input.exports} --drafter {input.drafters} {params.assistant} --prompts {input.prompts}"
        " --features-index {input.features}/index.json --out {output.json} --table {output.table} > {log} 2>&1"
