# kvshot: raw data -> target -> features -> drafters -> evaluation -> tables/figures.
# Default config is the embedded CPU scale; overlay another with --configfile.
from pathlib import Path

from snakemake.utils import min_version

min_version("9.0")


BASE_CONFIG = "config/config.yaml"
# `configfile:` names no file when its YAML is broken or empty: say which, in one line.
# (Snakemake's CLI parses --configfile overlays before this file runs, and names none there;
# a kvshot stage names it: `python -m kvshot prepare-data --config FILE --out /tmp/x`.)
if Path(BASE_CONFIG).is_file():   # a missing one: Snakemake's own message (overlays may stand in)
    import yaml

    try:
        with open(BASE_CONFIG, encoding="utf-8") as fh:
            parsed = yaml.safe_load(fh)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise WorkflowError(f"{BASE_CONFIG}: not valid YAML ({' '.join(str(exc).split())}): fix the file") from None
    if not isinstance(parsed, dict):
        found = "an empty file" if parsed is None else f"a {type(parsed).__name__}"
        raise WorkflowError(f"{BASE_CONFIG}: expected a mapping of config sections, found {found}: fix the file")


configfile: BASE_CONFIG


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/target.smk"
include: "workflow/rules/regenerate.smk"
include: "workflow/rules/features.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/serve.smk"
include: "workflow/rules/published.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/scaling.smk"
include: "workflow/rules/blockwise.smk"
include: "workflow/rules/plateau.smk"
include: "workflow/rules/curve.smk"
include: "workflow/rules/drift.smk"


rule all:
    input:
        "results/data/stats.json",
        "results/target/metrics.json",
        expand("results/features/{split}", split=SPLITS),
        expand("results/drafters/{variant}/seed{seed}", variant=VARIANTS, seed=SEEDS),
        expand("results/eval/{variant}/stepwise.json", variant=VARIANTS),
        expand("results/eval/{variant}/e2e.json", variant=VARIANTS),
        expand("figures/{figure}.pdf", figure=FIGURES),
        "results/claims.md",
    default_target: True
