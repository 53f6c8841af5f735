# kvshot: raw data -> target -> features -> drafters -> evaluation -> tables/figures.
# Default config is the embedded CPU scale; overlay another with --configfile.
from pathlib import Path

from snakemake.utils import min_version

min_version("9.0")


def parsed_configfile(path):
    """`configfile:` names no file when its YAML is broken or empty: say which, in one line.
    (Snakemake's own CLI parses --configfile overlays before this file runs; kvshot stages
    name the file: `python -m kvshot prepare-data --config FILE --out /tmp/x`.)"""
    import yaml

    if not Path(path).is_file():
        return path   # Snakemake's own message (and overlays may stand in for it)
    try:
        with open(path, encoding="utf-8") as fh:
            parsed = yaml.safe_load(fh)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise WorkflowError(f"{path}: not valid YAML ({' '.join(str(exc).split())}): fix the file") from None
    if not isinstance(parsed, dict):
        found = "an empty file" if parsed is None else f"a {type(parsed).__name__}"
        raise WorkflowError(f"{path}: expected a mapping of config sections, found {found}: fix the file")
    return path


configfile: parsed_configfile("config/config.yaml")


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
