//! A real Slurm on localhost (issue 40): munged, slurmctld and two slurmd (`-N n1`, `-N n2`),
//! Debian's slurm-wlm and munge (scripts/test installs them), with their own key, ports, state
//! and logs in a temporary folder, and CPU nodes only (fake GPU GRES would need character
//! devices). Each test starts its own cluster and [`Cluster`]'s drop cancels every job and stops
//! every daemon it started, then checks that none is left. The server under test runs in this
//! process with the cluster's partition as its pool (one CPU device of 1 GiB a node); the
//! agents its allocations start are `zerotrain agent --slurm` processes that slurmd runs.
//!
//! The daemons run as root (`SlurmUser=root`), as CI runs the tests. Without slurm-wlm, munge
//! or root the tests fail saying so, unless `ZEROTRAIN_SKIP_SLURM=1`: then they say what they
//! did not check and pass.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use runner::train::{Options, run};
use scheduler::plan::plan_local;
use scheduler::spec::{JobSpec, Purpose};
use serde_json::{Value, json};
use server::slurm::{self, SlurmNode};

use crate::live::{self, Live, poll};

/// Set to 1 to pass, saying so, where Slurm cannot run.
const SKIP: &str = "ZEROTRAIN_SKIP_SLURM";

/// The nodes every test cluster has: CPUs and MiB of memory Slurm schedules on each.
const NODES: [(&str, usize, u64); 2] = [("n1", 2, 3000), ("n2", 2, 3000)];
const PARTITION: &str = "debug";

/// A running cluster; dropping it stops it.
struct Cluster {
    dir: tempfile::TempDir,
    daemons: Vec<(String, Child)>,
}

/// Why Slurm cannot run here, if it cannot.
fn missing() -> Option<String> {
    let tools = [
        "munged",
        "munge",
        "slurmctld",
        "slurmd",
        "scontrol",
        "sbatch",
        "squeue",
    ];
    let absent: Vec<&str> = tools
        .into_iter()
        .filter(|t| {
            Command::new("sh")
                .args(["-c", &format!("command -v {t}")])
                .stdout(Stdio::null())
                .status()
                .map_or(true, |s| !s.success())
        })
        .collect();
    if !absent.is_empty() {
        return Some(format!(
            "{} not on PATH (Debian: slurm-wlm, munge)",
            absent.join(", ")
        ));
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("the daemons need root (SlurmUser=root)".into());
    }
    None
}

/// The cluster, or `None` (after saying why) where Slurm cannot run and `ZEROTRAIN_SKIP_SLURM=1`.
fn cluster(test: &str) -> Option<Cluster> {
    if let Some(why) = missing() {
        if std::env::var(SKIP).as_deref() == Ok("1") {
            eprintln!("{test}: not checked, {SKIP}=1 and {why}");
            return None;
        }
        panic!("{test}: Slurm cannot run here: {why}; set {SKIP}=1 to pass without it");
    }
    Some(Cluster::start())
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().to_owned();
        let at = |p: &str| root.join(p);
        for d in ["state", "spool", "log"] {
            std::fs::create_dir(at(d)).expect("mkdir");
        }
        let mut key = vec![0u8; 1024];
        std::io::Read::read_exact(
            &mut std::fs::File::open("/dev/urandom").expect("urandom"),
            &mut key,
        )
        .expect("random key");
        write_private(&at("munge.key"), &key);
        let mut cluster = Cluster {
            daemons: Vec::new(),
            dir,
        };
        let path = |p: &str| root.join(p).display().to_string();
        // munged forks, and its parent exits once the daemon serves its socket.
        let munged = Command::new("munged")
            .args([
                "--force",
                &format!("--socket={}", path("munge.sock")),
                &format!("--key-file={}", path("munge.key")),
                &format!("--pid-file={}", path("munged.pid")),
                &format!("--log-file={}", path("log/munged.log")),
                &format!("--seed-file={}", path("munged.seed")),
            ])
            .status();
        let munged_ok = munged.as_ref().is_ok_and(|s| s.success());
        assert!(munged_ok, "munged: {munged:?}:\n{}", cluster.logs());
        let mut conf = format!(
            "ClusterName=zerotrain-test\n\
             SlurmctldHost=localhost(127.0.0.1)\n\
             SlurmctldPort={}\n\
             AuthType=auth/munge\n\
             AuthInfo=socket={}\n\
             CryptoType=crypto/munge\n\
             StateSaveLocation={}\n\
             SlurmdSpoolDir={}/%n\n\
             SlurmctldPidFile={}\n\
             SlurmdPidFile={}/slurmd.%n.pid\n\
             SlurmctldLogFile={}\n\
             SlurmdLogFile={}/slurmd.%n.log\n\
             SlurmUser=root\nSlurmdUser=root\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core_Memory\n\
             SchedulerType=sched/builtin\n\
             ReturnToService=2\nMpiDefault=none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             SlurmdTimeout=10\nInactiveLimit=0\nMinJobAge=2\n",
            free_port(),
            path("munge.sock"),
            path("state"),
            path("spool"),
            path("slurmctld.pid"),
            path("spool"),
            path("log/slurmctld.log"),
            path("log"),
        );
        for (name, cpus, mib) in NODES {
            conf += &format!(
                "NodeName={name} NodeAddr=127.0.0.1 Port={} CPUs={cpus} RealMemory={mib} State=UNKNOWN\n",
                free_port()
            );
        }
        let names: Vec<&str> = NODES.iter().map(|n| n.0).collect();
        conf += &format!(
            "PartitionName={PARTITION} Nodes={} Default=YES MaxTime=INFINITE State=UP\n",
            names.join(",")
        );
        std::fs::write(at("slurm.conf"), conf).expect("slurm.conf");
        let conf = path("slurm.conf");
        cluster.spawn(
            "slurmctld",
            cluster_cmd(&root, "slurmctld").args(["-D", "-f", &conf]),
        );
        for &name in &names {
            let mut c = cluster_cmd(&root, "slurmd");
            cluster.spawn(
                &format!("slurmd {name}"),
                c.args(["-D", "-f", &conf, "-N", name]),
            );
        }
        // A job on both nodes runs once the controller answers (srun retries it) and both
        // nodes have registered: the cluster is ready.
        let mut ready = cluster.command("timeout");
        let ready = ready
            .args(["60", "srun", "-N2", "-w", &names.join(","), "true"])
            .output();
        let ready_ok = ready.as_ref().is_ok_and(|o| o.status.success());
        assert!(
            ready_ok,
            "no job ran on both nodes within 60 s: {ready:?}:\n{}",
            cluster.logs()
        );
        cluster
    }

    /// Starts a daemon in the foreground, its output in the log folder.
    fn spawn(&mut self, name: &str, cmd: &mut Command) {
        let log = self
            .dir
            .path()
            .join("log")
            .join(format!("{}.out", name.replace(' ', "-")));
        let log = std::fs::File::create(log).expect("log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        self.daemons.push((name.to_owned(), child));
    }

    /// Kills node `name`'s slurmd (SIGKILL: the node as if it died).
    fn kill_slurmd(&mut self, name: &str) {
        let label = format!("slurmd {name}");
        let at = self
            .daemons
            .iter()
            .position(|(n, _)| *n == label)
            .expect("a slurmd");
        let (_, mut child) = self.daemons.remove(at);
        child.kill().expect("kill slurmd");
        child.wait().expect("reap slurmd");
    }

    /// Starts node `name`'s slurmd again (the node came back).
    fn start_slurmd(&mut self, name: &str) {
        let conf = self.dir.path().join("slurm.conf").display().to_string();
        let mut c = self.command("slurmd");
        c.args(["-D", "-f", &conf, "-N", name]);
        self.spawn(&format!("slurmd {name}"), &mut c);
    }

    /// The daemons' logs, for a failure's message.
    fn logs(&self) -> String {
        let mut out = String::new();
        for entry in std::fs::read_dir(self.dir.path().join("log"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(20).collect();
            out += &format!("--- {}\n", entry.path().display());
            tail.into_iter()
                .rev()
                .for_each(|l| out += &format!("{l}\n"));
        }
        out
    }

    /// `program args…` against this cluster.
    fn command(&self, program: &str) -> Command {
        cluster_cmd(self.dir.path(), program)
    }

    /// The standard output of a successful `program args…`.
    fn output(&self, program: &str, args: &[&str]) -> Option<String> {
        let out = self.command(program).args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// `program` with `SLURM_CONF` naming the cluster in `dir`.
fn cluster_cmd(dir: &Path, program: &str) -> Command {
    let mut c = Command::new(program);
    c.env("SLURM_CONF", dir.join("slurm.conf"));
    c
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self
            .command("scancel")
            .args(["--full", "--partition", PARTITION])
            .status();
        // slurmd first (their jobs' steps end with them), slurmctld, then munged, which
        // `--stop` ends and waits for.
        for (name, child) in self.daemons.iter_mut().rev() {
            // SAFETY: kill has no preconditions; the pid is our child's.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            if let Err(e) = child.wait() {
                eprintln!("{name}: {e}");
            }
        }
        let socket = self.dir.path().join("munge.sock");
        let stopped = Command::new("munged")
            .arg("--stop")
            .arg(format!("--socket={}", socket.display()))
            .status();
        if std::thread::panicking() {
            return;
        }
        assert!(stopped.is_ok_and(|s| s.success()), "munged --stop failed");
        // Every daemon names a file of the cluster's folder on its command line.
        let dir = self.dir.path().display().to_string();
        let left = Command::new("pgrep").args(["-f", &dir]).output();
        let left = left.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
        assert_eq!(left.as_deref().unwrap_or(""), "", "processes of {dir} left");
    }
}

/// Writes `bytes` to a new file only its owner may read (munged refuses any other key).
fn write_private(path: &PathBuf, bytes: &[u8]) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .expect("key file");
    f.write_all(bytes).expect("key");
}

/// What zerotrain reads of the cluster's nodes is what the cluster was configured with.
#[test]
fn the_nodes_read_from_scontrol_are_the_configured_ones() {
    let Some(cluster) = cluster("the_nodes_read_from_scontrol") else {
        return;
    };
    // The server reads with the environment it has: here the cluster's SLURM_CONF.
    let text = cluster
        .output("scontrol", &["show", "node", "-o"])
        .expect("scontrol show node");
    let nodes: Vec<SlurmNode> =
        slurm::parse_nodes(&text).unwrap_or_else(|e| panic!("{e}:\n{text}"));
    let seen: Vec<(&str, usize, u64)> = nodes
        .iter()
        .map(|n| (n.name.as_str(), n.cpus, n.memory_bytes >> 20))
        .collect();
    assert_eq!(seen, NODES);
    for n in &nodes {
        assert_eq!(n.addr, "127.0.0.1");
        assert!(n.gpus.is_empty(), "{n:?}");
        assert!(n.usable() && n.in_partition(PARTITION), "{n:?}");
    }
}

/// A server whose pool is `cluster`'s partition, one CPU device of 1 GiB a node; agents lost
/// after 5 s of silence.
async fn server(cluster: &Cluster) -> Live {
    let conf = cluster.dir.path().join("slurm.conf");
    live::start_with(None, |s| {
        s.heartbeat_interval = Duration::from_millis(200);
        s.heartbeat_timeout = Duration::from_secs(5);
        s.scheduling_interval = Duration::from_millis(200);
        s.slurm.partitions = vec![PARTITION.into()];
        s.slurm.conf = Some(conf);
        s.slurm.agent_binary = Some(env!("CARGO_BIN_EXE_zerotrain").into());
        s.slurm.device_memory = 1 << 30;
    })
    .await
}

/// `method path` on `live` as its admin, with `body`: the status and the JSON answer.
async fn call(
    live: &Live,
    method: reqwest::Method,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .request(method, format!("{}{path}", live.server.url()))
        .bearer_auth(&live.admin);
    if let Some(body) = body {
        req = req.json(body);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn get(live: &Live, path: &str) -> Value {
    let (status, body) = call(live, reqwest::Method::GET, path, None).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

/// Submits `spec`, which must be queued; its id.
async fn submit(live: &Live, spec: &Value) -> String {
    let (status, created) = call(live, reqwest::Method::POST, "/v1/jobs", Some(spec)).await;
    assert_eq!(status, 201, "{created}");
    created["id"].as_str().unwrap().to_string()
}

/// The job's log, one string.
async fn logs(live: &Live, id: &str) -> String {
    get(live, &format!("/v1/jobs/{id}/logs?limit=1000"))
        .await
        .to_string()
}

/// Waits until Slurm lists no job (every allocation released, finished ones forgotten after
/// `MinJobAge`).
async fn until_squeue_is_empty(cluster: &Cluster) {
    poll(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let out = cluster
                .output("squeue", &["-h", "-o", "%i %j %T"])
                .unwrap_or_else(|| "squeue failed".into());
            out.trim().is_empty().then_some(()).ok_or(out)
        },
    )
    .await;
}

/// A two-rank ZeRO-2 job of `steps` steps, checkpointing every `every` steps.
fn two_rank_job(steps: u32, every: u32) -> Value {
    json!({"model": {"preset": "gpt2-tiny"}, "world_size": 2, "zero": {"stage": 2},
        "training": {"steps": steps, "micro_batch_size": 2},
        "checkpoint": {"every_steps": every}})
}

/// The loss `spec` ends at when trained uninterrupted in this process.
async fn reference_loss(spec: &Value) -> f64 {
    let spec = JobSpec::parse(&spec.to_string(), Purpose::Train)
        .unwrap()
        .spec;
    let plan = plan_local(&spec, None).unwrap();
    let done = tokio::task::spawn_blocking(move || {
        run(&spec, &plan, &Options::default(), &mut |_| {}).unwrap()
    });
    done.await.unwrap().final_loss
}

/// The job's last step's loss.
async fn final_loss(live: &Live, id: &str) -> f64 {
    let m = get(live, &format!("/v1/jobs/{id}/metrics")).await;
    let steps = m["steps"].as_array().unwrap();
    steps.last().unwrap()["loss"].as_f64().unwrap()
}

/// The whole life of a job through Slurm: an allocation of both nodes, an agent on each that
/// serves it alone, the losses of an uninterrupted run in one process, and the allocation gone
/// once the job succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_node_zero2_job_placed_through_slurm_trains_as_in_one_process() {
    let Some(cluster) = cluster("a_two_node_zero2_job_placed_through_slurm") else {
        return;
    };
    let spec = two_rank_job(10, 5);
    let want = reference_loss(&spec).await;
    let live = server(&cluster).await;
    let url = live.server.url();
    let id = submit(&live, &spec).await;
    let job = live::until_state(
        &url,
        &live.admin,
        &id,
        &["succeeded"],
        Duration::from_secs(240),
    )
    .await;
    assert_eq!(job["attempt"], 1, "{job}");
    assert_eq!(final_loss(&live, &id).await, want);
    let nodes = get(&live, "/v1/nodes").await;
    let mut names: Vec<&str> = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["reserved_for"] == id.as_str())
        .map(|n| n["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["n1", "n2"], "{nodes}");
    until_squeue_is_empty(&cluster).await;
    // The allocation's end reaches the log once the server saw Slurm release it.
    poll(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            let log = logs(&live, &id).await;
            let ended = log.contains("released: the job succeeded") || log.contains("ended: ");
            ended.then_some(log.clone()).ok_or(log)
        },
    )
    .await;
    let log = logs(&live, &id).await;
    for line in [
        "submitted Slurm job ",
        "--nodes=2 --ntasks-per-node=1",
        "agent --slurm --gpus none --cpu-devices 1",
        ": RUNNING (None) on n[1-2]",
        "n1: starting ranks",
        "n2: starting ranks",
    ] {
        assert!(log.contains(line), "{line:?} not in the log: {log}");
    }
}

/// Admission checks a job against the partition's nodes: what no node could hold, or more
/// ranks than it has devices, is refused at submission with the memory model's numbers, and
/// Slurm is asked for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_larger_than_the_partition_is_refused_at_submission() {
    let Some(cluster) = cluster("a_job_larger_than_the_partition_is_refused") else {
        return;
    };
    let live = server(&cluster).await;
    let too_big = json!({"model": {"preset": "gpt2-350M"}, "zero": {"stage": 0}});
    let (status, problem) = call(&live, reqwest::Method::POST, "/v1/jobs", Some(&too_big)).await;
    assert_eq!(status, 422, "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("per rank at stage 0") && detail.contains("largest device has 1.0 GB"),
        "{problem}"
    );
    let wide = json!({"model": {"preset": "gpt2-tiny"}, "world_size": 3});
    let (status, problem) = call(&live, reqwest::Method::POST, "/v1/jobs", Some(&wide)).await;
    assert_eq!(status, 422, "{problem}");
    let out = cluster.output("squeue", &["-h"]).unwrap();
    assert_eq!(out.trim(), "", "nothing asked of Slurm");
}

/// While Slurm holds the allocation back, the job says why, in its reason and its log; `zerotrain
/// cancel` then cancels the allocation too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waiting_for_nodes_shows_slurms_reason_and_cancel_releases_it() {
    let Some(cluster) = cluster("a_job_waiting_for_nodes_shows_slurms_reason") else {
        return;
    };
    // Another user's job holds both nodes' memory until it is cancelled.
    let blocker = cluster
        .output(
            "sbatch",
            &[
                "--parsable",
                "--output=/dev/null",
                "-N2",
                "-w",
                "n1,n2",
                "--wrap",
                "exec tail -f /dev/null",
            ],
        )
        .expect("sbatch");
    let blocker = blocker.trim().to_string();
    poll(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            let state = cluster
                .output("squeue", &["-h", "-j", &blocker, "-o", "%T"])
                .unwrap_or_default();
            (state.trim() == "RUNNING").then_some(()).ok_or(state)
        },
    )
    .await;
    let live = server(&cluster).await;
    let id = submit(&live, &two_rank_job(5, 5)).await;
    let reason = poll(
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            let job = get(&live, &format!("/v1/jobs/{id}")).await;
            let reason = job["reason"].as_str().unwrap_or_default().to_string();
            // Slurm says `None` until its scheduler has looked at the job.
            let why = reason.contains(": PENDING (") && !reason.ends_with("(None)");
            why.then_some(reason.clone()).ok_or(reason)
        },
    )
    .await;
    assert!(reason.starts_with("waiting for Slurm job "), "{reason}");
    assert!(reason.ends_with("PENDING (Resources)"), "{reason}");
    let log = logs(&live, &id).await;
    assert!(log.contains(": PENDING (Resources)"), "{log}");
    let cancelled = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(["cancel", &id, "--url", &live.server.url()])
        .env("ZEROTRAIN_TOKEN", &live.admin)
        .output()
        .unwrap();
    assert!(cancelled.status.success(), "{cancelled:?}");
    // Only the blocker is left.
    poll(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            let out = cluster
                .output("squeue", &["-h", "-o", "%i"])
                .unwrap_or_default();
            (out.trim() == blocker).then_some(()).ok_or(out)
        },
    )
    .await;
    assert!(cluster.output("scancel", &[&blocker]).is_some());
    until_squeue_is_empty(&cluster).await;
}

/// The pids of the `zerotrain agent --slurm` processes Slurm runs on node `name`.
fn agents_on(name: &str) -> Vec<i32> {
    let node = format!("SLURMD_NODENAME={name}");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let read =
                |what: &str| std::fs::read(format!("/proc/{pid}/{what}")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&read("cmdline")).replace('\0', " ");
            let environ = read("environ");
            cmdline.contains(" agent --slurm ")
                && environ.split(|&b| b == 0).any(|v| v == node.as_bytes())
        })
        .collect()
}

/// A node that dies mid-job (its slurmd and its agent killed) costs the job its attempt, not
/// its progress: the job goes back to the queue, gets a new allocation once the node is back,
/// resumes from its last checkpoint and ends at the loss of an uninterrupted run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_node_dies_is_requeued_and_resumes_from_its_checkpoint() {
    let Some(mut cluster) = cluster("a_job_whose_node_dies_is_requeued") else {
        return;
    };
    let spec = two_rank_job(80, 10);
    let want = reference_loss(&spec).await;
    let live = server(&cluster).await;
    let id = submit(&live, &spec).await;
    poll(
        Duration::from_secs(180),
        Duration::from_millis(20),
        || async {
            let m = get(&live, &format!("/v1/jobs/{id}/metrics")).await;
            let steps = m["steps"].as_array().map_or(0, Vec::len);
            (steps >= 25)
                .then_some(())
                .ok_or(format!("no progress: {steps} steps"))
        },
    )
    .await;
    cluster.kill_slurmd("n1");
    let agents = agents_on("n1");
    assert!(!agents.is_empty(), "no agent runs on n1");
    for pid in agents {
        // SAFETY: kill has no preconditions.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let url = live.server.url();
    poll(
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            let job = get(&live, &format!("/v1/jobs/{id}")).await;
            (job["attempt"] == 2).then_some(()).ok_or(job.to_string())
        },
    )
    .await;
    cluster.start_slurmd("n1");
    let job = live::until_state(
        &url,
        &live.admin,
        &id,
        &["succeeded"],
        Duration::from_secs(300),
    )
    .await;
    let log = logs(&live, &id).await;
    assert_eq!(job["attempt"], 2, "{}\n{log}", job["transitions"]);
    assert_eq!(final_loss(&live, &id).await, want);
    assert!(log.contains("resumed from the checkpoint of step"), "{log}");
    until_squeue_is_empty(&cluster).await;
}
