#!/usr/bin/env python3
"""What `kill -9` of an agent or of the server does to a running job.

Starts `zerotrain serve` and `zerotrain agent` processes on loopback (SQLite in a temporary
data dir, heartbeat timeout --timeout), submits a gpt2-tiny job that checkpoints every 10
steps, and once it is past step 25 kills one process with SIGKILL:

- the agent: a second agent is started at once; the job is requeued when the timeout passes
  and resumes on the new agent from its last committed checkpoint;
- (not a kill: the agent stopped with SIGSTOP past the timeout and continued once the job
  was requeued: answered 410, it stops its ranks and registers again; the job resumes on the
  second agent from the last checkpoint the server committed);
- the server, restarted at once: the agent's heartbeats fail meanwhile, are retried with
  backoff and carry the buffered reports when it is back; the job goes on in its attempt;
- the server, restarted after longer than the timeout: a server that just started gives nodes
  one timeout to come back (its downtime is not their silence), so the job goes on as well.

Prints a table: attempts, the step the last attempt resumed from, seconds from the kill until
the server records a new step (the agent goes on training while the server is down), and the
job's outcome.

    python3 scripts/kill9.py [--bin target/release/zerotrain] [--timeout 10] [--steps 200]
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, binary, timeout):
        self.binary = binary
        self.timeout = timeout
        self.dir = tempfile.TemporaryDirectory(prefix="zerotrain-kill9-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None
        self.agents = []

    def start_server(self):
        env = dict(os.environ, ZEROTRAIN_HEARTBEAT_TIMEOUT=f"{self.timeout}s")
        env.pop("ZEROTRAIN_TOKEN", None)
        self.server = subprocess.Popen(
            [self.binary, "serve", "--port", str(self.port), "--data-dir", self.dir.name],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self.ready(), 30, "the server to answer")

    def ready(self):
        try:
            urllib.request.urlopen(self.url + "/healthz", timeout=1)
        except OSError:
            return False
        # The tokens are written once the server listens.
        return all(os.path.exists(os.path.join(self.dir.name, f))
                   for f in ("admin-token", "join-token"))

    def token(self, name):
        with open(os.path.join(self.dir.name, name)) as f:
            return f.read().strip()

    def start_agent(self, name):
        agent = subprocess.Popen(
            [self.binary, "agent", "--server", self.url, "--token", self.token("join-token"),
             "--name", name, "--cpu-devices", "1", "--device-memory", "1GiB",
             "--threads", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.agents.append(agent)
        return agent

    def call(self, method, path, body=None):
        req = urllib.request.Request(
            self.url + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": "Bearer " + self.token("admin-token"),
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)

    def get(self, path):
        try:
            return self.call("GET", path)
        except OSError:
            return None  # the server is down

    def live_nodes(self):
        nodes = self.get("/v1/nodes") or {"nodes": []}
        return [n for n in nodes["nodes"] if not n.get("lost")]

    def steps(self, job):
        m = self.get(f"/v1/jobs/{job}/metrics")
        return [] if m is None else m["steps"]

    def stop(self):
        for p in self.agents + [self.server]:
            if p and p.poll() is None:
                p.kill()
                p.wait()
        self.dir.cleanup()


def wait_for(probe, limit, what):
    start = time.monotonic()
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() - start > limit:
            raise SystemExit(f"gave up after {limit} s waiting for {what}")
        time.sleep(0.05)


def scenario(args, victim, downtime):
    s = Service(args.bin, args.timeout)
    try:
        s.start_server()
        agent = s.start_agent("first")
        wait_for(lambda: s.live_nodes(), 30, "the agent to register")
        spec = {"model": {"preset": "gpt2-tiny"}, "training": {"steps": args.steps,
                "micro_batch_size": 2}, "checkpoint": {"every_steps": 10}}
        job = s.call("POST", "/v1/jobs", spec)["id"]
        wait_for(lambda: len(s.steps(job)) >= 25, 120, "step 25")
        killed = time.time()
        if victim == "agent":
            agent.send_signal(signal.SIGKILL)
            agent.wait()
            s.start_agent("second")
        elif victim == "zombie":
            agent.send_signal(signal.SIGSTOP)
            s.start_agent("second")
            wait_for(lambda: (s.get(f"/v1/jobs/{job}") or {}).get("attempt") == 2, 60,
                     "the job to be requeued")
            agent.send_signal(signal.SIGCONT)
        else:
            s.server.send_signal(signal.SIGKILL)
            s.server.wait()
            time.sleep(downtime)
            s.start_server()

        # A kill of the agent ends its attempt; the server's restart does not.
        attempt = 1 if victim == "server" else 2

        def reported_again():
            newer = [x["at"] for x in s.steps(job)
                     if x["at"] / 1000 > killed and x["attempt"] >= attempt]
            return min(newer) / 1000 if newer else None
        idle = wait_for(reported_again, 120, "new steps") - killed

        def finished():
            j = s.get(f"/v1/jobs/{job}")
            return j if j and j["state"] in ("succeeded", "failed", "cancelled") else None
        j = wait_for(finished, 600, "the job to end")
        resumed = [re.search(r"resumed from step (\d+)", t["reason"]) for t in j["transitions"]]
        resumed = [m.group(1) for m in resumed if m]
        return {"attempts": j["attempt"], "resumed": resumed[-1] if resumed else "-",
                "idle": idle, "state": j["state"]}
    finally:
        s.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default="target/release/zerotrain")
    p.add_argument("--timeout", type=float, default=10.0, help="heartbeat timeout, seconds")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    cases = [
        ("agent", 0, "agent, a new one started at once"),
        ("zombie", 0, "(SIGSTOP of the agent past the timeout, then SIGCONT)"),
        ("server", 0, "server, restarted at once"),
        ("server", args.timeout + 3, f"server, restarted after {args.timeout + 3:g} s"),
    ]
    print(f"gpt2-tiny, {args.steps} steps, checkpoint every 10; killed past step 25; "
          f"heartbeat timeout {args.timeout:g} s")
    print("| kill -9 of | attempts | resumed from step | seconds to the next step recorded | job |")
    print("|---|---:|---:|---:|---|")
    for victim, downtime, label in cases:
        r = scenario(args, victim, downtime)
        print(f"| {label} | {r['attempts']} | {r['resumed']} | {r['idle']:.1f} | {r['state']} |",
              flush=True)


if __name__ == "__main__":
    main()
