"""The README's and docs' commands parse as written (issue 49): every `snakemake` command of
README.md and docs/*.md (fenced blocks and inline code, tests/doc_commands.py) through Snakemake
9's own argument parser, every `python -m kvshot` command through kvshot's. Snakemake's
`--configfile` and `--sdm` take one or more values, so a target written after them is read as a
config file or a deployment method: that fails here. The dry runs are
tests/pipeline/test_doc_dry_runs.py."""
from __future__ import annotations

from .. import doc_commands as dc


def test_the_docs_have_commands():
    cmds = dc.commands()
    assert sum(c.tool == "snakemake" for c in cmds) >= 20 and sum(c.tool == "kvshot" for c in cmds) >= 3, cmds


def test_every_snakemake_command_parses_and_names_only_config_files_after_configfile():
    bad = [f"{c}\n    {p}" for c in dc.commands() if c.tool == "snakemake" for p in dc.parse_snakemake(c)[1]]
    assert not bad, "commands that fail as written:\n" + "\n".join(bad)


def test_every_kvshot_command_parses():
    cmds = [c for c in dc.commands() if c.tool == "kvshot" and c.text not in dc.NOT_PARSED]
    bad = [f"{c}\n    {p}" for c in cmds for p in dc.parse_kvshot(c)]
    assert not bad, "commands that fail as written:\n" + "\n".join(bad)


def test_a_target_after_configfile_or_sdm_is_caught():
    """The checks themselves, on the two mistakes issue 49 found in the README."""
    def problems(text):
        return dc.parse_snakemake(dc.Command("x.md", 1, text, text.split()[1:], "snakemake"))[1]

    assert problems("snakemake -n --profile profiles/slurm --configfile config/paper.yaml all figures/scaling.pdf")
    assert problems("snakemake --profile profiles/slurm --configfile config/paper.yaml --sdm conda all")
    assert not problems("snakemake all figures/scaling.pdf -n --profile profiles/slurm --configfile config/paper.yaml")
