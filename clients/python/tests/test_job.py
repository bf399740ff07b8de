"""`Job`: waiting with a progress bar, metrics as dicts and a DataFrame, followed logs, and
DeepSpeed configs submitted as they are."""

import json
import re
import sys
import time
from pathlib import Path

import pytest
from specs import ENDLESS, TINY

from zerotrain import Client, Job, StepRecord, Steps


def test_wait_draws_a_tqdm_bar_of_steps_with_loss_and_tokens_per_second(
    zt: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    job = zt.submit(TINY).wait(timeout=120, progress=True)
    assert job.state == "succeeded"
    bar = capsys.readouterr().err
    # tqdm's final frame: the state, all five steps, and the last step's figures.
    last = job.metrics()[-1]
    assert re.search(r"succeeded: +100%.* 5/5 ", bar), bar
    assert f"loss {last['loss']:.4f}, {last['tokens_per_second']:,.0f} tokens/s" in bar, bar


def test_wait_without_tqdm_rewrites_one_line(
    zt: Client, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    job = zt.submit(TINY).wait(timeout=120, progress=True)
    last = job.metrics()[-1]
    frames = capsys.readouterr().err.split("\r")
    assert (
        frames[-1].rstrip()
        == f"succeeded step 5/5: loss {last['loss']:.4f}, {last['tokens_per_second']:,.0f} tokens/s"
    )
    assert frames[-1].endswith("\n")


def test_wait_without_progress_prints_nothing(zt: Client, capsys: pytest.CaptureFixture[str]) -> None:
    assert zt.submit(TINY).wait(timeout=120).state == "succeeded"
    assert capsys.readouterr().err == ""


def test_wait_gives_up_after_its_timeout(zt: Client) -> None:
    job = zt.submit(ENDLESS)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=f"job {job.id} still (queued|scheduled|running) after 1 s"):
            job.wait(timeout=1)
        assert time.monotonic() - start < 10
    finally:
        job.cancel()


def test_metrics_are_step_dicts_and_a_dataframe(finished: Job) -> None:
    steps = finished.metrics()
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert all(s["loss"] > 0 and s["tokens_per_second"] > 0 for s in steps)
    # The spec asks for no validation: every step says so.
    assert all(s["validation_loss"] is None for s in steps)

    frame = steps.to_pandas()
    assert len(frame) == 5
    assert list(frame["loss"]) == [s["loss"] for s in steps]
    assert frame["validation_loss"].dtype == "float64" and frame["validation_loss"].isna().all()
    assert str(frame["at"].dtype).startswith("datetime64") and str(frame["at"].dt.tz) == "UTC"
    assert frame["at"].iloc[0].timestamp() * 1000 == pytest.approx(steps[0]["at"])


def test_the_dataframes_validation_loss_is_nan_on_steps_without_validation() -> None:
    def record(step: int, validation_loss: float | None) -> StepRecord:
        return {
            "attempt": 1,
            "step": step,
            "loss": 4.0,
            "loss_scale": 1.0,
            "tokens_per_second": 1000.0,
            "skipped": False,
            "step_seconds": 0.1,
            "at": 1_700_000_000_000,
            "validation_loss": validation_loss,
        }

    frame = Steps([record(1, None), record(2, 3.5), record(3, None)]).to_pandas()
    assert frame["validation_loss"].dtype == "float64"
    assert frame["validation_loss"].isna().tolist() == [True, False, True]
    assert frame["validation_loss"][1] == 3.5


def test_to_pandas_without_pandas_says_how_to_get_it(finished: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'zerotrain[pandas]'")):
        finished.metrics().to_pandas()


def test_followed_logs_end_when_the_job_does(zt: Client) -> None:
    job = zt.submit(TINY)
    followed = list(job.logs(follow=True))
    # The stream ends only after the job has, with every line it logged.
    assert job.refresh().state == "succeeded"
    assert followed == list(job.logs())
    assert any("step 5/5" in line for line in followed), followed
    assert "finished" in followed[-1]


def test_a_deepspeed_config_is_submitted_in_its_own_form(zt: Client, tmp_path: Path) -> None:
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "wall_clock_breakdown": False,
    }
    job = zt.submit(
        deepspeed=ds_config,
        model="gpt2-tiny",
        data={"kind": "synthetic"},
        world_size=2,
        training={"steps": 3, "seq_len": 32},
    )
    assert job["spec"]["zero"] == {"stage": 1}
    assert job["spec"]["precision"]["dtype"] == "bf16"
    assert job["spec"]["training"]["micro_batch_size"] == 2
    assert job["plan"]["zero_stage"] == 1
    assert job["unsupported_keys"] == ["deepspeed.wall_clock_breakdown"]
    assert job.wait(timeout=120).state == "succeeded", dict(job)
    assert len(job.metrics()) == 3

    # A DeepSpeed config file, as deepspeed.initialize(config=…) takes one.
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config))
    report = zt.estimate(deepspeed=path, model="gpt2-tiny")
    assert report["parameters"] == 141056
    assert report["plan"]["zero_stage"] == 1
