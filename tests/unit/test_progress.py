"""kvshot.core.progress: plain interval lines off a terminal, no carriage-return redraws."""
from __future__ import annotations

import io

from kvshot.core.progress import Progress, progress


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_interval_lines_without_redraws():
    clock, out = FakeClock(), io.StringIO()
    bar = Progress(total=100, desc="train x", every_seconds=30, stream=out, clock=clock)
    for step in range(100):        # one step per second, a postfix on every step
        clock.now += 1.0
        bar.set_postfix(loss=1.0 / (step + 1), acc0=0.5)
        bar.update(1)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert text.endswith("\n")
    # at 30, 60, 90 s, then the final count at close
    assert len(lines) == 4, lines
    assert lines[0].startswith("train x: 30/100 it (30%) 30s")
    assert "loss=0.03333" in lines[0] and "acc0=0.5" in lines[0]
    assert lines[-1].startswith("train x: 100/100 it (100%)")


def test_set_postfix_alone_prints_nothing():
    clock, out = FakeClock(), io.StringIO()
    bar = Progress(total=10, desc="d", every_seconds=30, stream=out, clock=clock)
    for _ in range(1000):
        clock.now += 1.0
        bar.set_postfix(loss=0.1)
    assert out.getvalue() == ""


def test_percent_interval_and_written_lines():
    clock, out = FakeClock(), io.StringIO()
    bar = Progress(total=50, desc="p", every_seconds=1e9, every_percent=20, stream=out, clock=clock)
    for step in range(50):
        clock.now += 0.1
        bar.update(1)
        if step == 4:
            bar.write("step 4 loss 1.0")
    bar.close()   # the last update printed 50/50: no repeat at close
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "step 4 loss 1.0"
    # 10, 20, 30, 40, 50 (20% each) plus the written line
    assert [l.split()[1] for l in lines if l.startswith("p:")] == ["10/50", "20/50", "30/50", "40/50", "50/50"]


def test_iterable_and_disabled():
    clock, out = FakeClock(), io.StringIO()

    def tick(items):
        for x in items:
            clock.now += 10.0
            yield x

    assert list(progress(tick(range(7)), desc="it", total=7, stream=out, clock=clock, every_seconds=30)) == list(range(7))
    assert len(out.getvalue().splitlines()) == 3   # 30 s, 60 s (at 6 items), the final 7
    quiet = io.StringIO()
    bar = Progress(total=5, stream=quiet, disable=True, every_seconds=0)
    for _ in range(5):
        bar.update()
    bar.write("hidden")
    bar.close()
    assert quiet.getvalue() == ""


def test_terminal_gets_a_tqdm_bar():
    out = io.StringIO()
    bar = Progress(total=3, desc="tty", stream=out, tty=True)
    for _ in range(3):
        bar.update()
    bar.close()
    assert "\r" in out.getvalue() and "3/3" in out.getvalue()


def test_library_bars_quiet_off_a_terminal():
    import subprocess
    import sys

    code = ("import io, sys; from kvshot.core.progress import quiet_library_bars; "
            "assert quiet_library_bars(io.StringIO()); "
            "from transformers.utils import logging; assert not logging.is_progress_bar_enabled(); "
            "from transformers.utils.logging import tqdm; "
            "[None for _ in tqdm(range(3), desc='Writing model shards')]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in __import__("os").environ.items() if "PROGRESS_BARS" not in k})
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "Writing model shards" not in proc.stderr
    assert not quiet_library_bars_on_tty()


def quiet_library_bars_on_tty() -> bool:
    from kvshot.core.progress import quiet_library_bars

    class Tty(io.StringIO):
        def isatty(self):
            return True

    return quiet_library_bars(Tty())
