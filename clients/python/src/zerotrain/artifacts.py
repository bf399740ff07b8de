"""A job's stored outputs, downloaded into a folder: streamed to disk chunk by chunk, each file
checked against the size and SHA-256 the listing gives before it takes its name."""

import hashlib
import re
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from .errors import ArtifactError

if TYPE_CHECKING:
    from .client import Client

# What Hugging Face's `from_pretrained` reads from a folder: the finished model, when its weights
# are one file.
MODEL_FILES = ("config.json", "model.safetensors")
# A LoRA job's finished adapter, as PEFT's `PeftModel.from_pretrained(base, folder)` reads it,
# and its merged model (`from_pretrained(folder / "merged")`).
ADAPTER_FILES = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "merged/config.json",
    "merged/model.safetensors",
)
# A sharded model's index (which file holds each tensor), beside its shards.
INDEX_FILE = "model.safetensors.index.json"
_SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
CHUNK = 1 << 20


class Artifact(TypedDict):
    """One stored output of a job, as `GET /v1/jobs/{id}/artifacts` lists it."""

    name: str
    bytes: int
    sha256: str
    step: int | None
    """The training step it holds (None where it is not a checkpoint's)."""


def download(client: "Client", job_id: str, to: str | Path, names: Iterable[str] | None = None) -> Path:
    """Downloads the artifacts `names` of a job into the folder `to` (made if missing); the folder.
    Without `names`, the finished model (`model_files`)."""
    listed = {a["name"]: a for a in client.artifacts(job_id)}
    names = model_files(listed) if names is None else list(names)
    missing = [name for name in names if name not in listed]
    if missing:
        have = ", ".join(sorted(listed)) or "none"
        raise ArtifactError(f"job {job_id} has no artifact {', '.join(missing)} (it has: {have})")
    folder = Path(to)
    targets = [(listed[name], _inside(folder, name)) for name in names]
    for artifact, path in targets:
        _fetch(client, job_id, artifact, path)
    return folder


def model_files(listed: Collection[str]) -> list[str]:
    """The files of a job's finished model, from the names of the artifacts it has: `config.json`
    and `model.safetensors`, or for a model sharded as transformers shards one, every shard
    `model-KKKKK-of-NNNNN.safetensors` and then `model.safetensors.index.json`; for a LoRA job,
    its adapter (`adapter_config.json`, `adapter_model.safetensors`) and merged model
    (`merged/config.json`, `merged/model.safetensors`)."""
    if any(name in listed for name in ADAPTER_FILES):
        return list(ADAPTER_FILES)
    if INDEX_FILE not in listed or MODEL_FILES[1] in listed:
        return list(MODEL_FILES)
    counts = [int(m[2]) for m in map(_SHARD.fullmatch, listed) if m]
    count = max(counts, default=2)
    shards = [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
    return [MODEL_FILES[0], *shards, INDEX_FILE]


def _inside(folder: Path, name: str) -> Path:
    """Where artifact `name` goes: under `folder`, never outside it (`../x`, `/etc/x`)."""
    root = folder.resolve()
    path = (root / name).resolve()
    if path == root or not path.is_relative_to(root):
        raise ArtifactError(f"artifact {name!r} would be written outside {folder}")
    return path


def _fetch(client: "Client", job_id: str, artifact: Artifact, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    digest = hashlib.sha256()
    size = 0
    try:
        with client.artifact(job_id, artifact["name"]) as response, part.open("wb") as out:
            while chunk := response.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        if size != artifact["bytes"] or digest.hexdigest() != artifact["sha256"]:
            raise ArtifactError(
                f"{artifact['name']}: received {size} bytes with SHA-256 {digest.hexdigest()}, "
                f"listed as {artifact['bytes']} bytes with SHA-256 {artifact['sha256']}"
            )
        part.replace(path)
    finally:
        part.unlink(missing_ok=True)
