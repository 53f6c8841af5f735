"""Progress that reads well in a log file.

On a terminal: a normal tqdm bar. Anywhere else (under Snakemake stderr is `logs/*.log`):
one plain, newline-terminated line per interval, never a carriage-return redraw. tqdm's own
`mininterval` does not help there, because `set_postfix` redraws on every call; here
`set_postfix` only stores the values, which the next line prints.

The interval is `every_seconds` (default 30, or `KVSHOT_PROGRESS_SECONDS`) or, when given,
every `every_percent` of the total, whichever comes first.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Iterable, Iterator, TextIO


def _default_seconds() -> float:
    try:
        return float(os.environ.get("KVSHOT_PROGRESS_SECONDS", "30"))
    except ValueError:
        return 30.0


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Progress:
    """A progress counter: tqdm on a TTY, interval lines otherwise.

    `disable=True` (e.g. on ranks other than 0 under DDP) prints nothing at all."""

    def __init__(self, total: int | None = None, desc: str = "", initial: int = 0, unit: str = "it",
                 every_seconds: float | None = None, every_percent: float | None = None,
                 stream: TextIO | None = None, disable: bool = False,
                 clock: Callable[[], float] = time.monotonic, tty: bool | None = None):
        self.total, self.desc, self.n, self.unit = total, desc, initial, unit
        self.stream = stream if stream is not None else sys.stderr
        self.every_seconds = _default_seconds() if every_seconds is None else every_seconds
        self.every_percent = every_percent
        self.disable, self.clock = disable, clock
        self.postfix: dict = {}
        is_tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar = None
        if is_tty and not disable:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, initial=initial, unit=unit, file=self.stream,
                             mininterval=1.0)
        self._start = self._last_time = clock()
        self._start_n = self._last_n = initial
        self._closed = False

    # -- counting ---------------------------------------------------------------------------
    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif not self.disable and self._due():
            self._emit()

    def set_postfix(self, **values) -> None:
        """Store values for the next line (a TTY bar shows them now); never prints a line itself."""
        self.postfix.update(values)
        if self._bar is not None:
            self._bar.set_postfix({k: _fmt(v) for k, v in self.postfix.items()}, refresh=False)

    def write(self, line: str) -> None:
        """A line of its own (e.g. a loss log); on a TTY printed above the bar. Counts as this
        interval's line, so a progress line does not follow right after it."""
        if self.disable:
            return
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
            return
        print(line, file=self.stream, flush=True)
        self._last_time, self._last_n = self.clock(), self.n

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif not self.disable and self.n != self._last_n:   # the final count, unless just printed
            self._emit()

    # -- lines ------------------------------------------------------------------------------
    def _due(self) -> bool:
        now = self.clock()
        if now - self._last_time >= self.every_seconds:
            return True
        if self.every_percent and self.total:
            step = self.total * self.every_percent / 100
            return int(self.n / step) > int(self._last_n / step)
        return False

    def line(self) -> str:
        """The text of one progress line (no newline)."""
        now = self.clock()
        elapsed = now - self._start
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.desc}: {count} {self.unit}{pct}", f"{elapsed:.0f}s", f"{rate:.3g} {self.unit}/s"]
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"eta {(self.total - self.n) / rate:.0f}s")
        parts += [f"{k}={_fmt(v)}" for k, v in self.postfix.items()]
        return " ".join(parts)

    def _emit(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._last_time, self._last_n = self.clock(), self.n

    # -- context manager / iteration --------------------------------------------------------
    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(iterable: Iterable, desc: str = "", total: int | None = None, **kw) -> Iterator:
    """Iterate with progress: `for x in progress(items, desc="capture"): ...`."""
    if total is None:
        try:
            total = len(iterable)   # type: ignore[arg-type]
        except TypeError:
            total = None
    bar = Progress(total=total, desc=desc, **kw)
    try:
        for item in iterable:
            yield item
            bar.update(1)
    finally:
        bar.close()


def quiet_library_bars(stream: TextIO | None = None) -> bool:
    """Off a terminal, turn off the tqdm bars of transformers ("Writing model shards", "Loading
    weights"), huggingface_hub and datasets, which would write redraws into the log. Returns
    whether it did. Environment variables when those libraries are not imported yet (transformers
    reads huggingface_hub's at import), their switches when they are."""
    stream = stream if stream is not None else sys.stderr
    if bool(getattr(stream, "isatty", lambda: False)()):
        return False
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    return True
