"""The client's tests run against a live server with one agent of two or more devices:
ZEROTRAIN_URL and ZEROTRAIN_TOKEN say where (the Rust test `cargo test -p zerotrain --test zerotrain
e2e::the_python` starts both and runs `pytest clients/python/tests` with the interpreter
`scripts/pyenv` prints). By hand, against `zerotrain up`:

    ZEROTRAIN_URL=http://127.0.0.1:8080 "$(scripts/pyenv)" -m pytest -q clients/python/tests
"""

import uuid

import pytest
from specs import TINY

from zerotrain import Client, Job


@pytest.fixture(scope="session")
def zt() -> Client:
    return Client()


@pytest.fixture(scope="session")
def finished(zt: Client) -> Job:
    """A gpt2-tiny job of 5 steps that succeeded."""
    job = zt.submit(TINY, name=f"py-finished-{uuid.uuid4().hex[:8]}")
    assert job.wait(timeout=120).state == "succeeded", dict(job)
    return job
