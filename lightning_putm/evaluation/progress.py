"""Console progress of evaluations and studies: a bar on a terminal, plain lines anywhere else.

A progress bar redraws one line with carriage returns. Written into a pipe or a log file (``| tee``, a cluster's
job log) it leaves fragments mixed with the results table, so bars are drawn only when stderr (where they go) is
a terminal; elsewhere each finished unit of work (a setting, a study run) is one plain line with the elapsed
time and an estimate of the time left, and a long count (images extracted) gets a line every 30 s
(:func:`~lightning_putm.config.progress_seconds`; :class:`ProgressLines`), so a log file never goes silent for
minutes.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, TextIO

from pytorch_lightning.callbacks import TQDMProgressBar
from pytorch_lightning.callbacks.progress.tqdm_progress import Tqdm, convert_inf

from lightning_putm.config import progress_seconds


def on_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stderr, where bars are drawn) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def format_duration(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``: the way tqdm shows times, so bar and plain lines read alike."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Eta:
    """Elapsed time and time left of ``total`` units of work, from the pace of the units *solved* so far.

    Units read back from disk (a resumed setting, a finished run) take no time; counting them in the pace would
    promise far too short a wait, so they only shrink what is left.

    With ``kinds`` (the kind of every unit, in the order they are done: an evaluation's methods, setting by
    setting) each unit left is paced by the units of its own kind solved so far, a kind not solved yet by all
    units' pace. One pace for all swings the estimate within every round of methods when one method is much slower
    than the others (measured: docs/lab/code-notes.md#evaluates-time-left-paced-by-method).

    With ``stored`` (per unit: whether a result of it is already on disk) the units still to come that will be read
    back count as no time: a resumed run with most settings stored otherwise promises hours for minutes of work
    (seen: ``ETA 14:23:06`` for 1 h 45 min of work, 6 of 72 settings to solve).
    """

    def __init__(self, total: float, clock: Callable[[], float] = time.perf_counter,
                 kinds: Sequence[str] | None = None, stored: Sequence[bool] | None = None) -> None:
        if kinds is not None and len(kinds) != total:
            raise ValueError(f"Eta: {len(kinds)} kinds for {total} units")
        if stored is not None and len(stored) != total:
            raise ValueError(f"Eta: {len(stored)} stored flags for {total} units")
        self.total, self.clock = total, clock
        self.kinds = None if kinds is None else list(kinds)
        self.stored = [False] * int(total) if stored is None else [bool(flag) for flag in stored]
        self.started = self.last = clock()
        self.done = 0.0  # solved or read back
        self.solved = 0.0
        self.kind_seconds: dict[str, float] = {}  # time and count of the solved units of each kind
        self.kind_solved: dict[str, float] = {}

    def advance(self, units: float, solved: bool = True) -> None:
        now = self.clock()
        if solved and self.kinds is not None and units:
            kind = self.kinds[min(int(self.done), len(self.kinds) - 1)]
            self.kind_seconds[kind] = self.kind_seconds.get(kind, 0.0) + now - self.last
            self.kind_solved[kind] = self.kind_solved.get(kind, 0.0) + units
        self.last = now
        self.done += units
        if solved:
            self.solved += units

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    @property
    def left(self) -> float | None:
        """Seconds still to go, ``None`` until something was solved."""
        if self.solved <= 0:
            return None
        pace = self.elapsed / self.solved
        return sum(self._pace(self._kind(index), pace) for index in self._to_solve(int(self.done)))

    def left_in_unit(self, fraction: float) -> float | None:
        """Seconds still to go while the current unit is ``fraction`` done (a progress bar within a setting): the
        rest of this unit at the pace it has had so far, the units after it as :attr:`left` paces them (before
        anything was solved, at this unit's pace). ``None`` while nothing can be timed yet."""
        in_unit = self.clock() - self.last
        if self.solved > 0:
            pace: float | None = self.elapsed / self.solved
        else:
            pace = in_unit / fraction if fraction > 0 else None
        if pace is None:
            return None
        index = int(self.done)
        current = in_unit * (1 - fraction) / fraction if fraction > 0 else self._pace(self._kind(index), pace)
        return current + sum(self._pace(self._kind(later), pace) for later in self._to_solve(index + 1))

    def _kind(self, index: int) -> str | None:
        return self.kinds[index] if self.kinds is not None and index < len(self.kinds) else None

    def _to_solve(self, start: int) -> list[int]:
        """The units from ``start`` on that are not stored (the ones that will take time)."""
        return [index for index in range(start, int(self.total)) if not self.stored[index]]

    def _pace(self, kind: str | None, pace: float) -> float:
        """Seconds per unit of ``kind``: its own solved units', else ``pace`` (all units')."""
        return self.kind_seconds[kind] / self.kind_solved[kind] if kind in self.kind_solved else pace

    def text(self) -> str:
        """``elapsed 0:40, ETA 1:20`` (``ETA unknown`` before the first solved unit)."""
        left = self.left
        return f"elapsed {format_duration(self.elapsed)}, ETA " + ("unknown" if left is None else format_duration(left))


class Heartbeat:
    """A line every ``every_seconds`` (default :func:`~lightning_putm.config.progress_seconds`) while one long unit of
    work runs where no bar is drawn, from a background thread: ``setting 1/66 putm 1-shot: solving, 0/1000 tasks
    done, elapsed 2:00``. Otherwise a log shows nothing between two finished settings, and a 1000-task PUTM
    setting takes a quarter of an hour on a 2-core CPU; a unit done within the interval prints nothing. Use as a context
    manager around the work; ``done`` reports the tasks finished so far (chunks), read when a line is due."""

    def __init__(self, what: str, log: Callable[[str], None], total: int, done: Callable[[], int] = lambda: 0,
                 every_seconds: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.what, self.log, self.total, self.done, self.clock = what, log, total, done, clock
        every = progress_seconds() if every_seconds is None else every_seconds
        self.every = max(every, 0.05)  # 0 means "every update" for counts; a heartbeat has none: a short period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="lightning-putm-heartbeat", daemon=True)
        self.lines = 0

    def __enter__(self) -> "Heartbeat":
        self.started = self.clock()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            elapsed = format_duration(self.clock() - self.started)
            self.log(f"{self.what}: solving, {self.done()}/{self.total} tasks done, elapsed {elapsed}")
            self.lines += 1


class ProgressLines:
    """A bar's information as plain lines, for a count that takes minutes where no bar is drawn: every
    ``every_seconds`` (default :func:`~lightning_putm.config.progress_seconds`) one line ``extracting features:
    4096/13760 images (30%), 160 images/s, elapsed 0:26, ETA 1:00``, and when the count ends a last line, if any
    line was printed (a count done within the interval prints nothing: its start and end lines around it say
    enough)."""

    def __init__(self, what: str, total: int | None, log: Callable[[str], None] = print, unit: str = "images",
                 every_seconds: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.what, self.total, self.log, self.unit, self.clock = what, total, log, unit, clock
        self.every = progress_seconds() if every_seconds is None else every_seconds
        self.started = self.last = clock()
        self.done, self.lines = 0, 0

    def update(self, count: int) -> None:
        self.done += count
        now = self.clock()
        if now - self.last >= self.every and (self.total is None or self.done < self.total):
            self.last = now
            self._line(now)

    def close(self) -> None:
        """The closing line (once), when the count printed lines on the way."""
        if self.lines:
            elapsed = self.clock() - self.started
            rate = f" ({self.done / elapsed:.0f} {self.unit}/s)" if elapsed > 0 else ""
            self.log(f"{self.what}: {self.done} {self.unit} done in {format_duration(elapsed)}{rate}")
            self.lines = 0

    def _line(self, now: float) -> None:
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total} {self.unit} ({100 * self.done / self.total:.0f}%)" if self.total else f" {self.unit}"
        left = (f", ETA {format_duration((self.total - self.done) / rate)}" if self.total and rate > 0 else "")
        self.log(f"{self.what}: {self.done}{of}, {rate:.0f} {self.unit}/s, elapsed {format_duration(elapsed)}{left}")
        self.lines += 1


class ExtractionBar(TQDMProgressBar):
    """Lightning's test-loop bar, kept only where it means something: the batches of a feature extraction.

    The few-shot evaluation runs at the end of the test loop, so the stock bar (``Testing DataLoader 0: 100% 1/1``)
    would sit under the results for the whole evaluation. This one is named for what it counts, is drawn only on
    a terminal and for more than one batch (a feature file is replayed as one), and is gone once the last batch is
    done, before the evaluation's own bar (tasks, ETA) starts.
    """

    _images = 0  # rows extracted so far in this loop, and when it started: the bar shows images/s
    _started = 0.0
    _lines: ProgressLines | None = None  # where no bar is drawn (a log file): a line every progress_seconds()

    def __init__(self, log: Callable[[str], None] = print) -> None:
        super().__init__()
        self._say = log

    def init_test_tqdm(self) -> Tqdm:
        batches = sum(2 if n == float("inf") else int(n) for n in self.trainer.num_test_batches)
        return Tqdm(desc="extracting features", position=2 * self.process_position, leave=False, dynamic_ncols=True,
                    file=sys.stderr, bar_format=self.BAR_FORMAT,
                    disable=self.is_disabled or batches <= 1 or not on_terminal())

    def on_test_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        if self.has_dataloader_changed(dataloader_idx):  # Lightning's version would draw "Testing DataLoader 0"
            self.test_progress_bar.reset(total=convert_inf(self.total_test_batches_current_dataloader))
        if batch_idx == 0:
            self._images, self._started = 0, time.perf_counter()
            self._lines = None
            if self.test_progress_bar.disable and not self.is_disabled and not on_terminal():
                batches = convert_inf(self.total_test_batches_current_dataloader)
                loaders = trainer.test_dataloaders
                loader = loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders
                dataset = getattr(loader, "dataset", None)
                total = len(dataset) if hasattr(dataset, "__len__") else None
                if batches is not None and batches > 1:  # a feature file is replayed as one batch: nothing to show
                    self._lines = ProgressLines("extracting features", total, self._say)

    def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._images += images_in(batch)
        if self._lines is not None:
            self._lines.update(images_in(batch))
        elapsed = time.perf_counter() - self._started
        if elapsed > 0 and not self.test_progress_bar.disable:  # the backbone's throughput, data loading included
            self.test_progress_bar.set_postfix_str(f"{self._images / elapsed:.0f} images/s", refresh=False)
        super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        total = self.test_progress_bar.total
        if total is not None and batch_idx + 1 >= total:
            self.test_progress_bar.close()  # cleared (leave=False) before the evaluation prints anything
            if self._lines is not None:
                self._lines.close()


def images_in(batch: Any) -> int:
    """Rows of a test-loop batch (images, labels, indices): the first tensor's length."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return int(first.shape[0]) if hasattr(first, "shape") and len(first.shape) else 0


def extraction_bar(progress: bool, log: Callable[[str], None] = print) -> list[ExtractionBar]:
    """The callbacks to give a Trainer whose ``enable_progress_bar=progress``: the bar above (plain lines through
    ``log`` where no bar is drawn), or none."""
    return [ExtractionBar(log)] if progress else []
