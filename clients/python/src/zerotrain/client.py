"""The REST API, endpoint by endpoint: `Client`."""

import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from . import sse
from .artifacts import Artifact
from .errors import ZerotrainError
from .job import Job

DEFAULT_URL = "http://127.0.0.1:8080"

Spec = Mapping[str, Any]


class Client:
    """One server, one token. `url` defaults to ZEROTRAIN_URL, else http://127.0.0.1:8080;
    `token` to ZEROTRAIN_TOKEN, else the admin token the server on this machine wrote to
    $ZEROTRAIN_DATA_DIR/admin-token (else ~/.local/share/zerotrain/admin-token). `timeout`:
    seconds any one read may wait for the server."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = (url or os.environ.get("ZEROTRAIN_URL") or DEFAULT_URL).rstrip("/")
        self.token = token or os.environ.get("ZEROTRAIN_TOKEN") or _default_token()
        self.timeout = timeout

    def submit(
        self,
        spec: Spec | None = None,
        priority: int | None = None,
        idempotency_key: str | None = None,
        *,
        deepspeed: Spec | str | os.PathLike[str] | None = None,
        model: str | Spec | None = None,
        model_dir: str | os.PathLike[str] | None = None,
        data: Spec | None = None,
        **fields: Any,
    ) -> Job:
        """Submits a job: a native spec (`submit({"model": …, "training": …})`), or a DeepSpeed
        config (`submit(deepspeed=ds_config, model="gpt2-124M", data=…)`: a dict or the path of
        its JSON file); `model` may be a preset's name, and other keywords (`training`, `name`,
        `world_size`, …) are spec fields. `model_dir`, a Hugging Face model directory, gives the
        model instead: its config.json as `model.config`, its weights as `model.init_from` (as
        `zerotrain submit --model-dir`). The created (or, for a repeated idempotency key, the
        earlier) job, with its plan and predicted per-rank bytes."""
        body = _request_body(spec, deepspeed, _model(model, model_dir), data, fields)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return Job(self, self.call("POST", "/v1/jobs", body, {"priority": priority}, headers))

    def job(self, job_id: str) -> Job:
        return Job(self, self.call("GET", _job_path(job_id)))

    def jobs(self, state: str | None = None, name: str | None = None, page_size: int = 100) -> Iterator[Job]:
        """Every job, newest first, following the cursor page by page."""
        cursor = None
        while True:
            query = {"state": state, "name": name, "limit": page_size, "cursor": cursor}
            page = self.call("GET", "/v1/jobs", query=query)
            for job in page["jobs"]:
                yield Job(self, job)
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def wait(self, job_id: str, timeout: float | None = None, progress: bool = False) -> Job:
        """`Job.wait` for the job of this id."""
        return self.job(job_id).wait(timeout, progress)

    def cancel(self, job_id: str) -> Job:
        return Job(self, self.call("POST", _job_path(job_id, "cancel")))

    def metrics(self, job_id: str) -> dict[str, Any]:
        """Step series (loss, loss scale, tokens/s) and per-rank memory, measured and predicted."""
        result: dict[str, Any] = self.call("GET", _job_path(job_id, "metrics"))
        return result

    def logs(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        """Every log line (`{seq, at, line}`) after sequence number `after`."""
        return list(self.log_lines(job_id, after))

    def log_lines(self, job_id: str, after: int = 0, follow: bool = False) -> Iterator[dict[str, Any]]:
        """The log lines after sequence number `after`, page by page; with `follow`, also those
        still to come, until the job has ended."""
        path = _job_path(job_id, "logs")
        if not follow:
            while page := self.call("GET", path, query={"after": after})["lines"]:
                yield from page
                after = page[-1]["seq"]
            return
        while True:
            for event in self.stream(path, {"follow": "true", "after": after}):
                if event.event == "end":
                    return
                line = json.loads(event.data)
                after = line["seq"]
                yield line
            # The stream closed before its `end` (the server restarted): resume after the last line.

    def events(self, job_id: str, deadline: float | None = None) -> Iterator[sse.Event]:
        """The job's `state` and `step` events as they happen, from its state now until it ends
        (or the server closes the stream); `deadline` as for `stream`."""
        return self.stream(_job_path(job_id, "events"), deadline=deadline)

    def artifacts(self, job_id: str) -> list[Artifact]:
        """What the job stored (`{name, bytes, sha256, step}` each): its model and checkpoints."""
        try:
            listing = self.call("GET", _job_path(job_id, "artifacts"))
        except ZerotrainError as e:
            # The server's own 404s say which job is missing; a bare one means no such route.
            if e.status == 404 and e.problem.get("type") != "urn:zerotrain:problem:not-found":
                route = "GET /v1/jobs/{id}/artifacts"
                detail = f"{self.url} answered 404 for {route}: it predates artifact downloads"
                raise ZerotrainError(404, {"title": "No artifacts API", "detail": detail}) from None
            raise
        artifacts: list[Artifact] = listing["artifacts"]
        return artifacts

    def artifact(self, job_id: str, name: str) -> http.client.HTTPResponse:
        """One artifact's bytes, as a response to read from (and close)."""
        return self.request("GET", _job_path(job_id, "artifacts", name))

    def estimate(
        self,
        spec: Spec | None = None,
        *,
        deepspeed: Spec | str | os.PathLike[str] | None = None,
        model: str | Spec | None = None,
        model_dir: str | os.PathLike[str] | None = None,
        data: Spec | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """The memory model's report for a spec, given as to `submit`, on the registered nodes."""
        body = _request_body(spec, deepspeed, _model(model, model_dir), data, fields)
        result: dict[str, Any] = self.call("POST", "/v1/estimate", body)
        return result

    def nodes(self) -> list[dict[str, Any]]:
        nodes: list[dict[str, Any]] = self.call("GET", "/v1/nodes")["nodes"]
        return nodes

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> http.client.HTTPResponse:
        """The server's answer to one request, unread; 4xx/5xx raise ZerotrainError."""
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            response: http.client.HTTPResponse = urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                problem = json.loads(raw)
            except ValueError:
                problem = {"title": e.reason, "detail": raw.decode(errors="replace")}
            raise ZerotrainError(e.code, problem) from None
        return response

    def stream(
        self, path: str, query: Mapping[str, Any] | None = None, deadline: float | None = None
    ) -> Iterator[sse.Event]:
        """The server-sent events of `path` until the server ends the stream. With `deadline`
        (a `time.monotonic()` instant), TimeoutError once it has passed: checked at each line,
        which the server's keep-alives make at least one every 15 s."""
        timeout = self.timeout
        if deadline is not None:
            timeout = max(min(timeout, deadline - time.monotonic()), 0.001)
        with self.request("GET", path, query=query, timeout=timeout) as response:
            lines: Iterable[bytes] = response if deadline is None else _until(response, deadline)
            yield from sse.events(lines)

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """The JSON answer to one request (None for an empty one)."""
        with self.request(method, path, body, query, headers) as response:
            raw = response.read()
        return json.loads(raw) if raw else None


def _request_body(
    spec: Spec | None,
    deepspeed: Spec | str | os.PathLike[str] | None,
    model: str | Spec | None,
    data: Spec | None,
    fields: Mapping[str, Any],
) -> dict[str, Any]:
    """The request body `submit` and `estimate` send: `spec` with the keywords laid over it. A
    DeepSpeed config goes under `deepspeed` as the server's DeepSpeed form takes it."""
    body = dict(spec or {})
    if isinstance(deepspeed, (str, os.PathLike)):
        deepspeed = json.loads(Path(deepspeed).read_text())
    if isinstance(model, str):
        model = {"preset": model}
    for key, value in (("deepspeed", deepspeed), ("model", model), ("data", data)):
        if value is not None:
            body[key] = value
    body.update(fields)
    return body


def _model(model: str | Spec | None, model_dir: str | os.PathLike[str] | None) -> str | Spec | None:
    """`model`, or the model block of the Hugging Face directory `model_dir`: its config.json as
    `config`, and as `init_from` its `model.safetensors` when it holds one file of weights, else
    the directory (absolute: the agents read it)."""
    if model_dir is None:
        return model
    if model is not None:
        raise ValueError("give model or model_dir, not both")
    directory = Path(model_dir).absolute()
    config = json.loads((directory / "config.json").read_text())
    weights = directory / "model.safetensors"
    return {"config": config, "init_from": str(weights if weights.is_file() else directory)}


def _job_path(job_id: str, *rest: str) -> str:
    return "/".join(["/v1/jobs", *(urllib.parse.quote(part, safe="") for part in (job_id, *rest))])


def _until(lines: Iterable[bytes], deadline: float) -> Iterator[bytes]:
    for line in lines:
        if time.monotonic() > deadline:
            raise TimeoutError("deadline passed")
        yield line


def _default_token() -> str:
    data_dir = os.environ.get("ZEROTRAIN_DATA_DIR")
    if data_dir is None:
        xdg = os.environ.get("XDG_DATA_HOME")
        base = Path(xdg) if xdg else Path.home() / ".local" / "share"
        path = base / "zerotrain" / "admin-token"
    else:
        path = Path(data_dir) / "admin-token"
    try:
        return path.read_text().strip()
    except OSError:
        raise ZerotrainError(
            401,
            {"title": "No token", "detail": f"set ZEROTRAIN_TOKEN, or run the server here so {path} exists"},
        ) from None
