"""`Job.download`: against a stand-in server for what a live one rarely does (wrong digests,
names outside the folder, a server from before artifacts), and against the live server for a
finished job's export (`GET /v1/jobs/{id}/artifacts` and `…/artifacts/{name}`)."""

import hashlib
import http.server
import json
import os
import struct
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zerotrain import ArtifactError, Client, Job, ZerotrainError
from zerotrain.artifacts import model_files as finished_files

JOB = "01a23325-4174-7537-ac16-414027c702ba"


class Artifacts(http.server.ThreadingHTTPServer):
    """The artifact routes of one job: `files` by name, `listing` as the server would give
    (defaults to the files' true sizes and digests), every path asked for in `asked`."""

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = files
        self.listing: list[dict[str, Any]] | None = [
            {"name": n, "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest(), "step": 5}
            for n, b in files.items()
        ]
        self.asked: list[str] = []

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Artifacts

    def do_GET(self) -> None:
        self.server.asked.append(self.path)
        parts = [urllib.parse.unquote(p) for p in self.path.split("/")]
        routed = parts[:3] == ["", "v1", "jobs"] and len(parts) >= 5 and parts[4] == "artifacts"
        if not routed or self.server.listing is None:  # as a server from before artifacts
            return self._problem("about:blank", "Not Found")
        if parts[3] != JOB:
            return self._problem("urn:zerotrain:problem:not-found", f'no job "{parts[3]}"')
        if len(parts) == 5:
            return self._send(
                200, "application/json", json.dumps({"artifacts": self.server.listing}).encode()
            )
        self._send(200, "application/octet-stream", self.server.files["/".join(parts[5:])])

    def _problem(self, kind: str, detail: str) -> None:
        problem = {"type": kind, "title": "Not found", "status": 404, "detail": detail}
        self._send(404, "application/problem+json", json.dumps(problem).encode())

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def safetensors(tensors: dict[str, list[int]]) -> bytes:
    """A safetensors file of zero-filled fp32 tensors of these shapes."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors.items():
        size = 4
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


@pytest.fixture
def model_files() -> dict[str, bytes]:
    # Several download chunks (1 MiB each) of weights, with random bytes at the end.
    weights = safetensors({"transformer.wte.weight": [512, 640], "transformer.wpe.weight": [128, 64]})
    return {
        "config.json": json.dumps({"model_type": "gpt2", "n_layer": 2}).encode(),
        "model.safetensors": weights + os.urandom(1000),
        "checkpoints/step-5/rank-0.safetensors": b"shard",
    }


@pytest.fixture
def server(model_files: dict[str, bytes]) -> Iterator[Artifacts]:
    server = Artifacts(model_files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def job_on(server: Artifacts) -> Job:
    return Job(Client(server.url, token="zt_test"), {"id": JOB, "state": "succeeded"})


def test_download_streams_the_model_files_into_a_folder(server: Artifacts, tmp_path: Path) -> None:
    folder = job_on(server).download(to=tmp_path / "model")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert (folder / name).read_bytes() == server.files[name]


def test_a_sharded_model_downloads_its_shards_and_index_as_transformers_lays_them_out(
    tmp_path: Path,
) -> None:
    shards = {f"model-0000{k}-of-00003.safetensors": safetensors({f"w{k}": [4, k]}) for k in (1, 2, 3)}
    index = {"metadata": {"total_size": 96}, "weight_map": {f"w{k}": n for k, n in enumerate(shards, 1)}}
    files = {
        "config.json": b"{}",
        **shards,
        "model.safetensors.index.json": json.dumps(index).encode(),
        "checkpoints/step-5/rank-0.safetensors": b"shard",
    }
    server = Artifacts(files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        folder = job_on(server).download(to=tmp_path / "model")
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            ["config.json", *shards, "model.safetensors.index.json"]
        )
        for name in files.keys() - {"checkpoints/step-5/rank-0.safetensors"}:
            assert (folder / name).read_bytes() == files[name]
        # A shard the listing lacks is named before anything is fetched.
        assert server.listing is not None
        server.listing = [a for a in server.listing if a["name"] != "model-00002-of-00003.safetensors"]
        server.asked.clear()
        with pytest.raises(ArtifactError, match="has no artifact model-00002-of-00003.safetensors"):
            job_on(server).download(to=tmp_path / "again")
        assert server.asked == [f"/v1/jobs/{JOB}/artifacts"]
    finally:
        server.shutdown()
        server.server_close()


def test_download_fetches_named_artifacts_into_subfolders(server: Artifacts, tmp_path: Path) -> None:
    name = "checkpoints/step-5/rank-0.safetensors"
    job_on(server).download(to=tmp_path, names=[name])
    assert (tmp_path / name).read_bytes() == b"shard"
    assert f"/v1/jobs/{JOB}/artifacts/checkpoints%2Fstep-5%2Frank-0.safetensors" in server.asked


def test_a_download_whose_digest_differs_raises_and_leaves_no_file(server: Artifacts, tmp_path: Path) -> None:
    assert server.listing is not None
    server.listing[1]["sha256"] = "0" * 64
    with pytest.raises(ArtifactError, match="model.safetensors: received .* listed as .* SHA-256 0000"):
        job_on(server).download(to=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_a_download_of_another_size_raises(server: Artifacts, tmp_path: Path) -> None:
    assert server.listing is not None
    server.listing[0]["bytes"] += 1
    with pytest.raises(ArtifactError, match="config.json: received"):
        job_on(server).download(to=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_name_outside_the_folder_is_refused_before_any_download(server: Artifacts, tmp_path: Path) -> None:
    assert server.listing is not None
    server.listing.append({"name": "../escape", "bytes": 1, "sha256": "0" * 64, "step": None})
    with pytest.raises(ArtifactError, match="'../escape' would be written outside"):
        job_on(server).download(to=tmp_path / "model", names=["config.json", "../escape"])
    assert server.asked == [f"/v1/jobs/{JOB}/artifacts"]
    assert not (tmp_path / "escape").exists()


def test_a_missing_artifact_is_named_with_those_there_are(server: Artifacts, tmp_path: Path) -> None:
    with pytest.raises(
        ArtifactError,
        match=r"no artifact tokenizer.json \(it has: checkpoints/.*, config.json, model.safetensors\)",
    ):
        job_on(server).download(to=tmp_path, names=["tokenizer.json"])


def test_an_unknown_job_is_the_servers_404(server: Artifacts) -> None:
    with pytest.raises(ZerotrainError, match='no job "nope"') as e:
        Client(server.url, token="zt_test").artifacts("nope")
    assert e.value.status == 404


def test_a_server_without_artifacts_says_so(server: Artifacts, tmp_path: Path) -> None:
    server.listing = None
    with pytest.raises(
        ZerotrainError, match=r"No artifacts API \(404\): .* answered 404 for GET /v1/jobs/\{id\}/artifacts"
    ) as e:
        job_on(server).download(to=tmp_path)
    assert e.value.status == 404


def test_a_finished_job_downloads_as_a_from_pretrained_folder(
    zt: Client, finished: Job, tmp_path: Path
) -> None:
    listed = {a["name"]: a for a in zt.artifacts(finished.id)}
    assert {"config.json", "model.safetensors"} <= listed.keys(), listed
    folder = finished.download(to=tmp_path / "gpt2-tiny")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["n_layer"], config["n_embd"], config["vocab_size"]) == (
        "gpt2",
        2,
        64,
        512,
    )
    # Read with Hugging Face's own `safetensors` package: exactly the tensors, shapes and dtype
    # of `transformers`' GPT2LMHeadModel state dict (its lm_head is tied to wte and is not stored;
    # `transformers` and torch themselves are too heavy to install in CI).
    from safetensors import safe_open

    c, layers = config["n_embd"], config["n_layer"]
    vocab, positions = config["vocab_size"], config["n_positions"]
    want: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (vocab, c),
        "transformer.wpe.weight": (positions, c),
    }
    want |= {f"transformer.ln_f.{p}": (c,) for p in ("weight", "bias")}
    for i in range(layers):
        h = f"transformer.h.{i}"
        want |= {f"{h}.{ln}.{p}": (c,) for ln in ("ln_1", "ln_2") for p in ("weight", "bias")}
        want |= {
            f"{h}.attn.c_attn.weight": (c, 3 * c),
            f"{h}.attn.c_attn.bias": (3 * c,),
            f"{h}.attn.c_proj.weight": (c, c),
            f"{h}.attn.c_proj.bias": (c,),
            f"{h}.mlp.c_fc.weight": (c, 4 * c),
            f"{h}.mlp.c_fc.bias": (4 * c,),
            f"{h}.mlp.c_proj.weight": (4 * c, c),
            f"{h}.mlp.c_proj.bias": (c,),
        }
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        got = {name: f.get_tensor(name) for name in f.keys()}
    assert {name: t.shape for name, t in got.items()} == want
    assert {str(t.dtype) for t in got.values()} == {"float32"}


def test_a_lora_job_downloads_its_adapter_as_peft_saves_it_and_its_merged_model() -> None:
    lora = ["adapter_config.json", "adapter_model.safetensors"]
    lora += ["merged/config.json", "merged/model.safetensors"]
    assert finished_files({*lora, "checkpoints/x"}) == lora
    # Part of it is still asked for whole, so that what is missing is named.
    assert finished_files({"adapter_config.json"}) == lora
