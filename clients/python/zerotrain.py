"""A client for the zerotrain REST API, for notebooks and CI. Standard library only.

    from zerotrain import Client
    zt = Client()                       # ZEROTRAIN_URL, ZEROTRAIN_TOKEN, else this machine's server
    job = zt.submit({"model": {"preset": "gpt2-tiny"}})
    zt.wait(job["id"])["state"]         # "succeeded"

Like the `zerotrain` CLI, it reads ZEROTRAIN_URL (default http://127.0.0.1:8080) and
ZEROTRAIN_TOKEN (default: the admin token the server on this machine wrote to
$ZEROTRAIN_DATA_DIR/admin-token, else ~/.local/share/zerotrain/admin-token). Errors the server
answers with application/problem+json raise ZerotrainError carrying its status, detail and
the field at fault.
"""

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8080"
TERMINAL_STATES = ("succeeded", "failed", "cancelled")


class ZerotrainError(Exception):
    """A 4xx/5xx answer: `status`, `title`, `detail`, `field` (or None) and the whole `problem`."""

    def __init__(self, status, problem):
        self.status = status
        self.problem = problem
        self.title = problem.get("title", "error")
        self.detail = problem.get("detail", "")
        self.field = problem.get("field")
        where = f" [{self.field}]" if self.field else ""
        super().__init__(f"{self.title} ({status}){where}: {self.detail}")


def _default_token():
    data_dir = os.environ.get("ZEROTRAIN_DATA_DIR")
    if data_dir is None:
        xdg = os.environ.get("XDG_DATA_HOME")
        base = Path(xdg) if xdg else Path.home() / ".local" / "share"
        data_dir = base / "zerotrain"
    path = Path(data_dir) / "admin-token"
    try:
        return path.read_text().strip()
    except OSError:
        raise ZerotrainError(
            401,
            {"title": "No token", "detail": f"set ZEROTRAIN_TOKEN, or run the server here so {path} exists"},
        ) from None


class Client:
    def __init__(self, url=None, token=None, timeout=30.0):
        self.url = (url or os.environ.get("ZEROTRAIN_URL") or DEFAULT_URL).rstrip("/")
        self.token = token or os.environ.get("ZEROTRAIN_TOKEN") or _default_token()
        self.timeout = timeout

    def _call(self, method, path, body=None, query=None, headers=None):
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
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                problem = json.loads(raw)
            except ValueError:
                problem = {"title": e.reason, "detail": raw.decode(errors="replace")}
            raise ZerotrainError(e.code, problem) from None
        return json.loads(raw) if raw else None

    def submit(self, spec, priority=None, idempotency_key=None):
        """Submits a job spec (native or DeepSpeed form); the created (or, for a repeated
        idempotency key, the earlier) job with its plan and predicted per-rank bytes."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self._call("POST", "/v1/jobs", spec, {"priority": priority}, headers)

    def job(self, job_id):
        return self._call("GET", f"/v1/jobs/{job_id}")

    def jobs(self, state=None, name=None, page_size=100):
        """Every job, newest first, following the cursor page by page."""
        cursor = None
        while True:
            query = {"state": state, "name": name, "limit": page_size, "cursor": cursor}
            page = self._call("GET", "/v1/jobs", query=query)
            yield from page["jobs"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def cancel(self, job_id):
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def metrics(self, job_id):
        """Step series (loss, loss scale, tokens/s) and per-rank memory, measured and predicted."""
        return self._call("GET", f"/v1/jobs/{job_id}/metrics")

    def logs(self, job_id, after=0):
        """Every log line after sequence number `after`, page by page."""
        lines = []
        while True:
            page = self._call("GET", f"/v1/jobs/{job_id}/logs", query={"after": after})
            lines.extend(page["lines"])
            if not page["lines"]:
                return lines
            after = page["last_seq"]

    def estimate(self, spec):
        return self._call("POST", "/v1/estimate", spec)

    def nodes(self):
        return self._call("GET", "/v1/nodes")["nodes"]

    def wait(self, job_id, timeout=None, poll=1.0):
        """Polls the job until it ends; raises TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["state"] in TERMINAL_STATES:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout} s")
            time.sleep(poll)
