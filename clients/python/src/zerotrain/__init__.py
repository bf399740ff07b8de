"""A client for the zerotrain REST API, for notebooks and CI. Standard library only at its core;
tqdm draws `wait(progress=True)`'s bar and pandas makes `metrics().to_pandas()` when installed.

    from zerotrain import Client
    zt = Client()                       # ZEROTRAIN_URL, ZEROTRAIN_TOKEN, else this machine's server
    job = zt.submit({"model": {"preset": "gpt2-tiny"}})
    job.wait(progress=True)["state"]    # "succeeded"
    job.metrics().to_pandas()           # a row per step: loss, loss scale, tokens/s, …
    job.download(to="gpt2-tiny")        # config.json + model.safetensors

Errors the server answers with application/problem+json raise ZerotrainError carrying its
status, detail and the field at fault.
"""

__version__ = "0.2.0"

from .artifacts import MODEL_FILES, Artifact
from .client import DEFAULT_URL, Client
from .errors import ArtifactError, ZerotrainError
from .job import TERMINAL_STATES, Job
from .sse import Event
from .steps import StepRecord, Steps

__all__ = [
    "DEFAULT_URL",
    "MODEL_FILES",
    "TERMINAL_STATES",
    "Artifact",
    "ArtifactError",
    "Client",
    "Event",
    "Job",
    "StepRecord",
    "Steps",
    "ZerotrainError",
    "__version__",
]
