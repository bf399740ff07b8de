"""`Job`: a submitted job, and what a notebook does with it."""

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import artifacts, progress
from .steps import Steps

if TYPE_CHECKING:
    from .client import Client

TERMINAL_STATES = ("succeeded", "failed", "cancelled")


class Job(Mapping[str, Any]):
    """A job as the server last described it: read-only `job["state"]`, `job["plan"]`, …
    (`dict(job)` is the JSON), refreshed by `refresh`, `wait` and `cancel`."""

    def __init__(self, client: "Client", data: Mapping[str, Any]) -> None:
        self.client = client
        self._data = dict(data)

    @property
    def id(self) -> str:
        job_id: str = self._data["id"]
        return job_id

    @property
    def state(self) -> str:
        """As of the last answer: call `refresh` for the state now."""
        state: str = self._data["state"]
        return state

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.state}>"

    def refresh(self) -> "Job":
        self._data = dict(self.client.job(self.id))
        return self

    def wait(self, timeout: float | None = None, progress: bool = False) -> "Job":
        """Follows the job's events until it has ended; then this job, refreshed. `progress`:
        a bar of steps with loss and tokens/s (tqdm's when it is installed). TimeoutError after
        `timeout` seconds (noticed within the server's 15 s keep-alive)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = _bar(self, progress)
        try:
            while not self._follow(deadline, bar, fill=progress):
                # The stream closed before the job ended (the server restarted): follow anew.
                pass
        except TimeoutError:
            if deadline is None or time.monotonic() <= deadline:
                raise
            raise TimeoutError(f"job {self.id} still {self.state} after {timeout} s") from None
        finally:
            bar.close()
        return self.refresh()

    def _follow(self, deadline: float | None, bar: progress.Progress, fill: bool) -> bool:
        """Reads one connection's events; whether the job has ended."""
        for n, event in enumerate(self.client.events(self.id, deadline)):
            record = json.loads(event.data)
            if event.event == "step":
                bar.step(record)
                continue
            if event.event != "state":
                continue
            self._data.update(state=record["state"], attempt=record["attempt"], reason=record["reason"])
            bar.state(record["state"])
            # The stream starts at the state now: steps already made are at /metrics.
            if n == 0 and fill and (made := self.metrics()):
                bar.step(made[-1])
            if record["state"] in TERMINAL_STATES:
                return True
        return False

    def metrics(self) -> Steps:
        """Every step so far: dicts of loss, loss scale, tokens/s, …; `.to_pandas()` for a
        DataFrame. `client.metrics(job.id)` has the per-rank memory too."""
        return Steps(self.client.metrics(self.id)["steps"])

    def logs(self, follow: bool = False) -> Iterator[str]:
        """The job's log lines; with `follow`, also those still to come, until it has ended."""
        for line in self.client.log_lines(self.id, follow=follow):
            text: str = line["line"]
            yield text

    def download(self, to: str | Path, names: Iterable[str] | None = None) -> Path:
        """Downloads the finished model (`config.json` + `model.safetensors`, or a sharded
        model's `model-KKKKK-of-NNNNN.safetensors` files + `model.safetensors.index.json`: a folder
        `transformers`' `from_pretrained` loads), or the artifacts `names`, into the folder `to`;
        the folder. Each file is streamed and checked against its listed SHA-256."""
        return artifacts.download(self.client, self.id, to, names)

    def cancel(self) -> "Job":
        self._data = dict(self.client.cancel(self.id))
        return self


def _bar(job: Job, enabled: bool) -> progress.Progress:
    steps = job.get("spec", {}).get("training", {}).get("steps") if enabled else None
    return progress.bar(steps, enabled)
