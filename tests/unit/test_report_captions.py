"""Each Snakemake report caption (workflow/report/*.rst) names the statistic its table, figure or
verdict is computed with, as the code computes it now."""
from __future__ import annotations

import inspect

import pytest

from ..conftest import REPO

CAPTIONS = REPO / "workflow" / "report"


def caption(name: str) -> str:
    return " ".join((CAPTIONS / f"{name}.rst").read_text().split())


def test_claims_caption_says_paired_not_overlap():
    from kvshot.report import claims

    text = caption("claims")
    assert "paired" in inspect.getsource(claims)          # the claims are paired tests...
    assert "paired" in text and "overlap" not in text     # ...and the caption says so
    assert "min_sequences" in text and "80% power" in text


@pytest.mark.parametrize("name", ["figures", "tables", "scaling"])
def test_intervals_are_named_as_sequence_resamples(name):
    from kvshot.stats import resample

    assert "resamples whole sequences" in inspect.getsource(resample)
    text = caption(name)
    assert "resampl" in text and "sequences" in text and "bootstrap 95% interval" not in text


def test_figure_captions_match_what_the_figures_plot():
    from kvshot.report import figures

    text = caption("figures")
    source = inspect.getsource(figures.gradients)
    assert "positions into W_K,W_V / W_Q,W_O" in source and "positions sending gradient" in text
    assert "mean over seeds" in inspect.getsource(figures.query_error) and "mean over the training seeds" in text
