"""One atomic writer (kvshot.core.io.atomic_file) with one file mode, for text, JSON lines and figures."""
from __future__ import annotations

import stat

import pytest

from kvshot.core.io import atomic_file, write_lines, write_text
from kvshot.core.ranked_writer import RankedWriter


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_text_lines_and_ranked_output_are_0644(tmp_path):
    write_text(tmp_path / "a.json", "{}\n")
    write_lines(tmp_path / "b.jsonl", (f"{i}\n" for i in range(3)))
    w = RankedWriter(tmp_path / "train.jsonl", 3, bucket_size=2)
    for rank in (2, 0, 1):
        w.add(rank, f'{{"rank": {rank}}}\n')
    w.close()
    assert (tmp_path / "b.jsonl").read_text() == "0\n1\n2\n"
    assert (tmp_path / "train.jsonl").read_text().splitlines()[0] == '{"rank": 0}'
    assert [mode(tmp_path / n) for n in ("a.json", "b.jsonl", "train.jsonl")] == [0o644] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.jsonl", "train.jsonl"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_scratch(tmp_path):
    path = tmp_path / "x.txt"
    write_text(path, "old\n")

    def broken():
        yield "new, half\n"
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_lines(path, broken())
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_figures_go_through_it(tmp_path):
    import matplotlib.pyplot as plt

    from kvshot.report.figures import _save

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    _save(fig, tmp_path / "f.pdf")
    out = tmp_path / "f.pdf"
    assert out.read_bytes()[:4] == b"%PDF" and mode(out) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["f.pdf"]
    with atomic_file(tmp_path / "g.png") as tmp:
        assert tmp.name.startswith(".g.png.") and tmp.name.endswith(".tmp")
