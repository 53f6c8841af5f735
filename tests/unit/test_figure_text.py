"""Figures a reader can read (issue 49): every figure the smoke run writes (the `all` target's
figures, the data-scaling, block-wise, drift and benchmark figures) is drawn from synthetic result
files in the real schemas (the writers of test_claims, test_blockwise_report, test_drift_report),
rendered to PNG, and no two drawn text boxes may overlap (matplotlib's text extents; a rotated
label is tested as its rotated rectangle, not its axis-aligned box)."""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
from matplotlib.text import Text  # noqa: E402

NAMES = ["eagle3", "kv-d1", "kv-d2", "kv-d4", "hybrid", "standalone"]


def _corners(text: Text, renderer) -> list[tuple[float, float]]:
    """The drawn rectangle of `text` in display pixels: its axis-aligned box rotated back by the
    text's rotation about that box's centre (a rotated rectangle's bounding box shares its centre)."""
    box = text.get_window_extent(renderer)
    angle = text.get_rotation()
    if angle % 90 == 0:
        return [(box.x0, box.y0), (box.x1, box.y0), (box.x1, box.y1), (box.x0, box.y1)]
    rotation = text.get_rotation()
    text.set_rotation(0)
    flat = text.get_window_extent(renderer)
    text.set_rotation(rotation)
    cx, cy, w, h = (box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2, flat.width, flat.height
    c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    return [(cx + dx * c - dy * s, cy + dx * s + dy * c) for dx, dy in
            ((-w / 2, -h / 2), (w / 2, -h / 2), (w / 2, h / 2), (-w / 2, h / 2))]


def _overlap(a: list, b: list, slack: float = 0.5) -> bool:
    """Separating-axis test of two convex quadrilaterals (display pixels); touching within `slack` is apart."""
    for poly in (a, b):
        for (x0, y0), (x1, y1) in zip(poly, poly[1:] + poly[:1]):
            nx, ny = y0 - y1, x1 - x0
            norm = math.hypot(nx, ny) or 1.0
            pa = [(x * nx + y * ny) / norm for x, y in a]
            pb = [(x * nx + y * ny) / norm for x, y in b]
            if max(pa) <= min(pb) + slack or max(pb) <= min(pa) + slack:
                return False
    return True


def overlapping_text(fig, png: Path) -> list[tuple[str, str]]:
    """Render `fig` to `png` and return the pairs of drawn, non-empty texts whose boxes overlap."""
    drawn = {}   # a text drawn twice (a layout pass before the final one) counts at its last place
    original = Text.draw

    def draw(self, renderer):
        original(self, renderer)
        if self.get_visible() and self.get_text().strip():
            drawn[id(self)] = (self, _corners(self, renderer))

    Text.draw = draw
    try:
        fig.savefig(png, format="png", dpi=110)   # one draw, the pipeline's dpi
    finally:
        Text.draw = original
    return [(a.get_text(), b.get_text()) for (a, pa), (b, pb) in itertools.combinations(drawn.values(), 2) if _overlap(pa, pb)]


@pytest.fixture
def captured(monkeypatch):
    """Every figure the report code saves, kept open (name -> Figure) instead of written as PDF;
    the block-wise and drift reports' (under <root>/figures/) as block/NAME, drift/NAME."""
    from kvshot.report import blockwise, drift, figures

    got = {}

    def keep(fig, path):
        got[Path(path).stem if Path(path).parent.name != "figures" else f"{Path(path).parent.parent.name}/{Path(path).stem}"] = fig

    for module in (figures, blockwise, drift):
        monkeypatch.setattr(module, "_save", keep)
    return got


def benchmark_records() -> list[dict]:
    def mode(tau):
        return {"intervals": {"tau": {"value": tau, "ci": [tau - 0.1, tau + 0.1]}}, "speedup": 1.2, "rounds": 40,
                "acceptance_by_position": [0.6] * 7}

    return [{"variant": name, "benchmarks": {bench: {"prompts": 8, "temperatures": {
        f"t{t}": {"temperature": t, "modes": {"chain": mode(2.0 + i / 10)}} for t in (0.0, 1.0)}}
        for bench in ("heldout", "mt_bench", "humaneval")}} for i, name in enumerate(NAMES)]


def draw_every_figure(root: Path) -> None:
    """The report code's figures from synthetic result files under root."""
    from kvshot.report import benchmarks
    from kvshot.report.figures import FIGURES, scaling
    from kvshot.report.results import load_variants

    from .test_blockwise_report import CHAIN_ALPHAS, block_report, write_block_results
    from .test_claims import ALPHAS, write_results
    from .test_drift_report import BLOCKS, DECAYING, DRIFT, HOLDING, MAIN
    from .test_drift_report import report as drift_report
    from .test_drift_report import write_results as write_drift_results

    main = write_results(root / "main", repetition=0.58, natural=ALPHAS, seeds=[{}, {}])
    variants = load_variants(str(main), NAMES)
    for name, fn in FIGURES.items():
        fn(variants, root / f"{name}.pdf")
    scaling([{"train_samples": n, "variant": v, "MAT": 2.0 + i / 10 + n / 4000, "MAT_lo": 1.8, "MAT_hi": 2.9}
             for n in (500, 1000, 2000) for i, v in enumerate(NAMES)], root / "scaling.pdf")
    benchmarks.figure(benchmark_records(), root / "benchmarks.pdf")
    up = {f"block-kv-d{d}": [min(a + 0.15, 0.99) for a in CHAIN_ALPHAS[f"kv-d{d}"]] for d in (1, 2, 4)}
    up["block-hidden"] = [0.70, 0.60, 0.50, 0.40, 0.35, 0.30, 0.25]
    block_report(write_block_results(root / "block", up))
    alphas = {**BLOCKS, **{name: DECAYING for name in MAIN}, **{name: HOLDING for name in DRIFT}}
    drift_report(write_drift_results(root / "drift", alphas))


def test_no_two_texts_overlap_in_any_figure(captured, tmp_path):
    draw_every_figure(tmp_path)
    want = {"decay", "depth", "gate", "gradients", "query_error", "e2e", "context", "scaling", "benchmarks",
            "block/blockwise", "block/decay", "block/depth", "drift/drift"}
    assert want <= set(captured), sorted(captured)
    found = {}
    for name, fig in captured.items():
        bad = overlapping_text(fig, tmp_path / f"{name}.png")
        if bad:
            found[name] = [(a[:60], b[:60]) for a, b in bad[:4]]
    assert not found, f"overlapping text boxes (figure: first pairs): {found}"


def test_the_overlap_check_sees_two_titles_that_run_into_each_other(tmp_path):
    """The check itself: two long panel titles side by side overlap; short ones do not."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(6, 3))
    for ax in axes:
        ax.set_title("a title far too long for its own panel, so it runs into its neighbour's")
    assert overlapping_text(fig, tmp_path / "long.png")
    for ax in axes:
        ax.set_title("short")
    assert not overlapping_text(fig, tmp_path / "short.png")
    plt.close(fig)
