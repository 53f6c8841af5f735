# kvshot: raw data -> target -> features -> drafters -> evaluation -> tables/figures.
# Default config is the embedded CPU scale; overlay another with --configfile.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/target.smk"
include: "workflow/rules/regenerate.smk"
include: "workflow/rules/features.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/scaling.smk"


rule all:
    input:
        "results/data/stats.json",
        "results/target/metrics.json",
        expand("results/features/{split}", split=SPLITS),
        expand("results/drafters/{variant}", variant=VARIANTS),
        expand("results/eval/{variant}/stepwise.json", variant=VARIANTS),
        expand("results/eval/{variant}/e2e.json", variant=VARIANTS),
        expand("figures/{figure}.pdf", figure=FIGURES),
        "results/claims.md",
    default_target: True
