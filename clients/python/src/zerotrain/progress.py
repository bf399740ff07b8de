"""The bar `Job.wait(progress=True)` draws: tqdm's (a widget in notebooks) when tqdm is
installed, else one line on stderr rewritten in place."""

import sys
from typing import Any, Protocol

from .steps import StepRecord


class Progress(Protocol):
    def state(self, state: str) -> None: ...
    def step(self, record: StepRecord) -> None: ...
    def close(self) -> None: ...


def bar(total: int | None, enabled: bool) -> Progress:
    if not enabled:
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Line(total)
    return _Tqdm(tqdm(total=total, unit="step", dynamic_ncols=True))


def _figures(record: StepRecord) -> str:
    return f"loss {record['loss']:.4f}, {record['tokens_per_second']:,.0f} tokens/s"


class _Silent:
    def state(self, state: str) -> None:
        pass

    def step(self, record: StepRecord) -> None:
        pass

    def close(self) -> None:
        pass


class _Tqdm:
    def __init__(self, tqdm: Any) -> None:
        self.tqdm = tqdm

    def state(self, state: str) -> None:
        self.tqdm.set_description_str(state)

    def step(self, record: StepRecord) -> None:
        # Drawn by `update`, at most every tqdm's `mininterval`. `step` counts from 1; a resumed
        # attempt goes back to its checkpoint's step.
        self.tqdm.set_postfix_str(_figures(record), refresh=False)
        self.tqdm.update(record["step"] - self.tqdm.n)

    def close(self) -> None:
        self.tqdm.close()


class _Line:
    def __init__(self, total: int | None) -> None:
        self.of = f"/{total}" if total else ""
        self.status = ""
        self.figures = ""
        self.width = 0

    def state(self, state: str) -> None:
        self.status = state
        self._draw()

    def step(self, record: StepRecord) -> None:
        self.figures = f" step {record['step']}{self.of}: {_figures(record)}"
        self._draw()

    def _draw(self) -> None:
        # Padded over the previous line, which may have been longer.
        line = f"{self.status}{self.figures}"
        sys.stderr.write(f"\r{line:<{self.width}}")
        self.width = len(line)
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()
