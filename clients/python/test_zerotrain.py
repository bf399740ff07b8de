"""The Python client against a running server with an agent. Run by the Rust test
`cargo test -p server --test e2e python`, which starts both and sets ZEROTRAIN_URL and
ZEROTRAIN_TOKEN; by hand: `python3 -m unittest -v test_zerotrain` in this folder."""

import unittest
import uuid

from zerotrain import Client, ZerotrainError

TINY = {
    "model": {"preset": "gpt2-tiny"},
    "training": {"steps": 5, "micro_batch_size": 2, "seq_len": 32},
}


class ClientTest(unittest.TestCase):
    def setUp(self):
        self.zt = Client()

    def test_a_job_is_submitted_once_per_key_waited_for_and_read_back(self):
        name = f"py-{uuid.uuid4().hex[:8]}"
        key = uuid.uuid4().hex
        job = self.zt.submit(dict(TINY, name=name), idempotency_key=key)
        self.assertIn(job["state"], ("queued", "scheduled", "running"))
        self.assertGreater(job["predicted_per_rank_bytes"]["total"], 0)
        again = self.zt.submit(dict(TINY, name=name), idempotency_key=key)
        self.assertEqual(again["id"], job["id"])

        done = self.zt.wait(job["id"], timeout=120, poll=0.1)
        self.assertEqual(done["state"], "succeeded", done)
        steps = self.zt.metrics(job["id"])["steps"]
        self.assertEqual(len(steps), 5)
        self.assertTrue(all(s["loss"] > 0 for s in steps))
        self.assertTrue(self.zt.logs(job["id"]))
        listed = [j["id"] for j in self.zt.jobs(name=name, page_size=1)]
        self.assertEqual(listed, [job["id"]])

    def test_a_bad_spec_raises_naming_the_field(self):
        spec = dict(TINY, training={"seq_len": 4096})
        with self.assertRaises(ZerotrainError) as e:
            self.zt.submit(spec)
        self.assertEqual(e.exception.status, 422)
        self.assertEqual(e.exception.field, "training.seq_len")

    def test_an_unknown_token_is_refused(self):
        with self.assertRaises(ZerotrainError) as e:
            Client(token="zt_not_a_token").nodes()
        self.assertEqual(e.exception.status, 401)

    def test_estimate_and_nodes(self):
        est = self.zt.estimate({"model": {"preset": "gpt2-124M"}, "precision": {"dtype": "bf16"}})
        self.assertEqual(est["parameters"], 124439808)
        self.assertEqual(len(self.zt.nodes()), 1)

    def test_cancel_ends_a_job(self):
        job = self.zt.submit(dict(TINY, training={"steps": 100000}))
        self.assertEqual(self.zt.cancel(job["id"])["state"], "cancelled")
        with self.assertRaises(ZerotrainError) as e:
            self.zt.cancel(job["id"])
        self.assertEqual(e.exception.status, 409)


if __name__ == "__main__":
    unittest.main()
