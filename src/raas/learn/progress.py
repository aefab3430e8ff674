"""The reference trainer's progress where its user looks: a live bar on a terminal, a line every few
seconds when the output goes to a file (a SLURM log), and a final table."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

HEARTBEAT_S = 10.0


class Progress:
    """Steps of a run and what it is doing now (``phase``): a rich bar on a terminal; otherwise a plain
    line at each step, evaluation and phase change, and every ``interval_s`` seconds in between (from a
    task on the running event loop). Silent when ``enabled`` is False."""

    def __init__(
        self,
        total: int,
        enabled: bool,
        *,
        stream: TextIO | None = None,
        interval_s: float = HEARTBEAT_S,
        label: str = "raas train",
    ) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.label = label
        self.done = 0
        self._bar: Any = None
        self._task: Any = None
        self._note = ""
        self._phase = "starting"
        self._last = ""
        self._started = time.monotonic()
        self._beat: asyncio.Task[None] | None = None

    @property
    def live(self) -> bool:
        return self._bar is not None

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        if not self.enabled:
            return self
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=Console(file=self.stream),
            )
            self._bar.start()
            self._task = self._bar.add_task("", total=self.total)
        else:
            with contextlib.suppress(RuntimeError):
                self._beat = asyncio.get_running_loop().create_task(self._heartbeat())
        return self

    def _line(self, text: str) -> None:
        elapsed = int(time.monotonic() - self._started)
        stamp = f"{elapsed // 3600:d}:{elapsed % 3600 // 60:02d}:{elapsed % 60:02d}"
        self.stream.write(f"[{self.label} {stamp}] step {self.done}/{self.total} {text}\n")
        self.stream.flush()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._line(f"{self._phase}" + (f" | {self._last}" if self._last else ""))

    def _describe(self) -> str:
        return " | ".join(x for x in (self._phase, self._last, self._note) if x)

    def phase(self, text: str) -> None:
        """What the run does now (waiting for rollouts, training, syncing weights, evaluating)."""
        if text == self._phase:
            return
        self._phase = text
        if self._bar is not None:
            self._bar.update(self._task, description=self._describe())

    def note(self, text: str) -> None:
        """A result worth keeping on screen (the latest held-out pass rate)."""
        self._note = text
        if self._bar is not None:
            self._bar.update(self._task, description=self._describe())
        elif self.enabled:
            self._line(text)

    def advance(self, rec: dict[str, Any]) -> None:
        self.done += 1
        reward = rec.get("reward_mean")
        self._last = (
            f"reward {reward:.2f} " if reward is not None else ""
        ) + f"wait {rec['wait_s']:.0f}s train {rec['train_s']:.0f}s sync {rec['sync_s']:.1f}s"
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=self._describe())
        elif self.enabled:
            self._line(self._last + (f" | {self._note}" if self._note else ""))

    def __exit__(self, *exc: object) -> None:
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], stream: TextIO | None = None
) -> None:
    """A final table (rich on a terminal, plain aligned text in a file)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for row in rows:
        table.add_row(*("" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    Console(file=stream or sys.stderr, width=120).print(table)
