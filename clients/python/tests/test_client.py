"""The calls every client had before `Job`: submit, wait, read back, estimate, nodes, cancel,
and the errors the server answers."""

import shutil
import uuid
from pathlib import Path

import pytest
from specs import ENDLESS, TINY

from zerotrain import Client, Job, ZerotrainError


def test_a_job_is_submitted_once_per_key_waited_for_and_read_back(zt: Client) -> None:
    name = f"py-{uuid.uuid4().hex[:8]}"
    key = uuid.uuid4().hex
    job = zt.submit(dict(TINY, name=name), idempotency_key=key)
    assert isinstance(job, Job)
    assert job["state"] in ("queued", "scheduled", "running")
    assert job["predicted_per_rank_bytes"]["total"] > 0
    again = zt.submit(dict(TINY, name=name), idempotency_key=key)
    assert again["id"] == job.id

    done = zt.wait(job.id, timeout=120)
    assert done["state"] == "succeeded", dict(done)
    steps = zt.metrics(job.id)["steps"]
    assert len(steps) == 5
    assert all(s["loss"] > 0 for s in steps)
    assert zt.logs(job.id)
    listed = [j.id for j in zt.jobs(name=name, page_size=1)]
    assert listed == [job.id]
    assert zt.job(job.id) == done


def test_a_bad_spec_raises_naming_the_field(zt: Client) -> None:
    with pytest.raises(ZerotrainError) as e:
        zt.submit(dict(TINY, training={"seq_len": 4096}))
    assert e.value.status == 422
    assert e.value.field == "training.seq_len"


def test_an_unknown_token_is_refused() -> None:
    with pytest.raises(ZerotrainError) as e:
        Client(token="zt_not_a_token").nodes()
    assert e.value.status == 401


def test_estimate_and_nodes(zt: Client) -> None:
    est = zt.estimate(model="gpt2-124M", precision={"dtype": "bf16"})
    assert est["parameters"] == 124439808
    assert len(zt.nodes()) == 1


def test_a_lora_spec_is_estimated_with_peft_s_counts_and_its_adapter_must_be_in_the_data_roots(
    zt: Client, tmp_path: Path
) -> None:
    est = zt.estimate(model="gpt2-124M", lora={"rank": 8})
    # PEFT's print_trainable_parameters for GPT-2 with its default target, c_attn.
    assert (est["trainable_parameters"], est["parameters"]) == (294912, 124734720)
    with pytest.raises(ZerotrainError) as e:
        zt.submit(model="gpt2-124M", lora={"rank": 8, "init_from": str(tmp_path)})
    assert e.value.status == 422
    assert e.value.field == "lora.init_from"
    with pytest.raises(ZerotrainError) as e:
        zt.submit(model="gpt2-124M", lora={"rank": 8, "dropout": 1.0})
    assert e.value.status == 422
    assert e.value.field == "lora.dropout"


def test_a_model_dir_is_estimated_and_its_weights_must_be_in_the_data_roots(
    zt: Client, tmp_path: Path
) -> None:
    reference = Path(__file__).parents[3] / "tests/reference/hf_configs"
    shutil.copy(reference / "smollm2-135M.json", tmp_path / "config.json")
    est = zt.estimate(model_dir=tmp_path, training={"seq_len": 128})
    assert est["parameters"] == 134515008
    assert est["model"]["family"] == "llama"
    # Training reads the weights from the directory, which lies outside the server's data roots.
    with pytest.raises(ZerotrainError) as e:
        zt.submit(model_dir=tmp_path)
    assert e.value.status == 422
    assert e.value.field == "model.init_from"


def test_cancel_ends_a_job(zt: Client) -> None:
    job = zt.submit(ENDLESS)
    assert job.cancel().state == "cancelled"
    with pytest.raises(ZerotrainError) as e:
        zt.cancel(job.id)
    assert e.value.status == 409
