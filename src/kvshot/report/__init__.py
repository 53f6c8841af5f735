"""Tables, figures and the claims verdict, computed from the result files only."""
from __future__ import annotations

from pathlib import Path

from ..io import write_json
from .claims import claims_markdown, evaluate_claims
from .figures import FIGURES
from .results import load_variants
from .tables import write_tables


def run_report(results: str, variants: list[str], tables_dir: str, figures_dir: str, claims_md: str,
               claims_json: str, figures: list[str] | None = None) -> dict:
    loaded = load_variants(results, variants)
    write_tables(loaded, tables_dir)
    for name in figures or list(FIGURES):
        FIGURES[name](loaded, Path(figures_dir) / f"{name}.pdf")
    claims = evaluate_claims(loaded)
    write_json(claims_json, claims)
    md = claims_markdown(claims)
    tmp = Path(claims_md).with_suffix(".md.tmp")
    tmp.write_text(md)
    tmp.replace(claims_md)
    return {c["claim"]: c["verdict"] for c in claims}
