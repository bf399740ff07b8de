//! The server's settings, layered: defaults ← `ZEROTRAIN_*` environment variables ← command-line
//! flags, one clap argument each (the CLI flattens `Settings` into `serve` and `up`). The
//! defaults work on a fresh machine: loopback on port 8080, SQLite under the user's data
//! directory.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{Args as _, Command, FromArgMatches as _};
use scheduler::bytes::{number_and_unit, parse_size};
use wire::data_roots::{DataRoots, RootsError};

/// Every field but the last two (and `limits`, whose fields are) is a flag of `zerotrain serve`
/// and `up` and a `ZEROTRAIN_*` variable (the flag's name upper-cased); `zerotrain serve
/// --help` lists them with their defaults.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct Settings {
    /// Address to listen on.
    #[arg(long, env = "ZEROTRAIN_LISTEN", default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    pub listen: IpAddr,
    /// Port to listen on; 0 picks a free one.
    #[arg(long, env = "ZEROTRAIN_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Where the SQLite database, job outputs and token files live [default:
    /// $XDG_DATA_HOME/zerotrain, else ~/.local/share/zerotrain].
    #[arg(long, env = "ZEROTRAIN_DATA_DIR", default_value_os_t = default_data_dir(), hide_default_value = true)]
    pub data_dir: PathBuf,
    /// A directory jobs may name input files in (repeatable; the variable is `:`-separated)
    /// [default: DATA_DIR/datasets]. Submissions naming a file outside them are refused; `up`'s
    /// local agent reads only inside them. They may not contain the data directory.
    #[arg(
        long = "data-root",
        value_name = "DIR",
        env = "ZEROTRAIN_DATA_ROOTS",
        value_delimiter = ':'
    )]
    pub data_roots: Vec<PathBuf>,
    /// sqlite://PATH or postgres://… [default: sqlite://DATA_DIR/zerotrain.db].
    #[arg(long, env = "ZEROTRAIN_DATABASE_URL")]
    pub database_url: Option<String>,
    /// A node silent this long is lost and its jobs go back to the queue.
    #[arg(long, env = "ZEROTRAIN_HEARTBEAT_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub heartbeat_timeout: Duration,
    /// How often agents are told to heartbeat.
    #[arg(long, env = "ZEROTRAIN_HEARTBEAT_INTERVAL", default_value = "2s", value_parser = parse_duration)]
    pub heartbeat_interval: Duration,
    /// Time between scheduling passes; submissions and finished jobs also start one.
    #[arg(long, env = "ZEROTRAIN_SCHEDULING_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub scheduling_interval: Duration,
    /// How long the scheduler lease lasts unrenewed: the replica holding it places jobs and
    /// renews it every pass; when it stops (killed, cut off from the database), another replica
    /// takes over this long after its last pass. A server that shuts down hands it over at once.
    #[arg(long, env = "ZEROTRAIN_SCHEDULER_LEASE", default_value = "10s", value_parser = parse_duration)]
    pub scheduler_lease: Duration,
    /// Fraction of each device's memory placement keeps free.
    #[arg(long, env = "ZEROTRAIN_SAFETY_MARGIN", default_value = "0.05", value_parser = parse_margin)]
    pub safety_margin: f64,
    /// Largest request body accepted.
    #[arg(long, env = "ZEROTRAIN_BODY_LIMIT", default_value = "4MiB", value_parser = parse_body_limit)]
    pub body_limit: usize,
    /// Longest a request may take to produce its response headers; streams run on past it.
    #[arg(long, env = "ZEROTRAIN_REQUEST_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub request_timeout: Duration,
    /// How long a finished job's training series stay on `/metrics`, so the last scrape sees
    /// its final values.
    #[arg(long, env = "ZEROTRAIN_FINISHED_SERIES_TTL", default_value = "60s", value_parser = parse_duration)]
    pub finished_series_ttl: Duration,
    /// The URL browsers reach the server at, when it is not `http://` + the `Host` they send:
    /// behind a TLS-terminating proxy, `https://zerotrain.example.com`. Its origin is what
    /// cookie-authenticated requests must come from; with `https` the console's cookie is
    /// `Secure` and `__Host-` prefixed.
    #[arg(long, env = "ZEROTRAIN_PUBLIC_URL", value_parser = parse_public_url)]
    pub public_url: Option<url::Url>,
    /// How long a console login lasts.
    #[arg(long, env = "ZEROTRAIN_SESSION_TTL", default_value = "12h", value_parser = parse_duration)]
    pub session_ttl: Duration,
    /// Queue a job that asks for a kind of device (`"device": "cuda"`) of which no node has
    /// registered any, planned as if such devices held it, instead of refusing it with 422: for
    /// clusters whose GPU nodes join later.
    #[arg(long, env = "ZEROTRAIN_QUEUE_UNREGISTERED_DEVICES", value_parser = BoolishValueParser::new())]
    pub queue_unregistered_devices: bool,
    /// Where jobs' checkpoints and exports are kept: `s3://bucket/prefix` (any S3-compatible
    /// store, configured by the usual `AWS_*` variables) or an absolute directory [default:
    /// DATA_DIR/artifacts].
    #[arg(long, env = "ZEROTRAIN_ARTIFACTS", value_parser = parse_artifacts)]
    pub artifacts: Option<String>,
    /// What one owner (token name) may ask of the service.
    #[command(flatten)]
    pub limits: Limits,
    /// Where Slurm hands the service nodes.
    #[command(flatten)]
    pub slurm: SlurmSettings,
    /// `/readyz` waits for an agent to register (`zerotrain up` sets it for its local agent).
    #[arg(skip)]
    pub expect_local_agent: bool,
    /// The S3 store's configuration: the `AWS_*` variables the server started with
    /// (credentials, `AWS_REGION`, `AWS_ENDPOINT_URL` for another S3-compatible store, ...).
    #[arg(skip)]
    pub s3: S3Options,
}

/// `object_store`'s S3 configuration as `(key, value)` pairs, keys as the `AWS_*` variables
/// spell them; shown without its values, which hold secrets.
#[derive(Clone, Default, PartialEq)]
pub struct S3Options(pub Vec<(String, String)>);

impl S3Options {
    /// The `AWS_*` variables of this process.
    pub fn from_env() -> S3Options {
        S3Options(
            std::env::vars()
                .filter(|(k, _)| k.starts_with("AWS_"))
                .collect(),
        )
    }
}

impl std::fmt::Debug for S3Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| k))
            .finish()
    }
}

/// Limits an operator sets; every one has a default that keeps one client from exhausting the
/// service.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct Limits {
    /// Queued jobs one owner may have; a submission past it gets 429.
    #[arg(
        long = "max-queued-per-owner",
        env = "ZEROTRAIN_MAX_QUEUED_PER_OWNER",
        default_value_t = 1000
    )]
    pub queued_per_owner: u32,
    /// Ranks one owner's scheduled and running jobs may hold at once; further jobs wait, and
    /// a job of more ranks is refused.
    #[arg(
        long = "max-running-ranks-per-owner",
        env = "ZEROTRAIN_MAX_RUNNING_RANKS_PER_OWNER",
        default_value_t = 64
    )]
    pub running_ranks_per_owner: u32,
    /// Largest `training.steps` accepted.
    #[arg(long, env = "ZEROTRAIN_MAX_STEPS", default_value_t = 1_000_000)]
    pub max_steps: u32,
    /// How long an attempt may hold its devices before the job fails.
    #[arg(long, env = "ZEROTRAIN_MAX_WALL_TIME", default_value = "72h", value_parser = parse_duration)]
    pub max_wall_time: Duration,
    /// A finished job's checkpoints are removed this long after it ended.
    #[arg(long, env = "ZEROTRAIN_CHECKPOINT_RETENTION", default_value = "7d", value_parser = parse_duration)]
    pub checkpoint_retention: Duration,
    /// A finished job's whole output directory (the final model too) is removed this long
    /// after it ended [default: kept].
    #[arg(long, env = "ZEROTRAIN_MODEL_RETENTION", value_parser = parse_duration)]
    pub model_retention: Option<Duration>,
    /// Failed authentications (unknown tokens) one client address may make per minute before
    /// its requests get 429 with `Retry-After`; 0 turns the limit off.
    #[arg(long, env = "ZEROTRAIN_AUTH_FAILURES_PER_MINUTE", default_value_t = 30)]
    pub auth_failures_per_minute: u32,
}

/// Slurm partitions as pools of nodes (docs/operations.md, "On Slurm"). The server runs
/// `scontrol`, `sbatch`, `squeue` and `scancel` as the user it runs as, with its environment
/// less the `ZEROTRAIN_*` variables.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct SlurmSettings {
    /// A Slurm partition to run jobs on (repeatable; the variable is comma-separated): jobs are
    /// admitted against its nodes' shape, and a queued job no registered node takes gets an
    /// allocation of its own there, whose agents serve it alone.
    #[arg(
        id = "slurm_partition",
        long = "slurm-partition",
        value_name = "NAME",
        env = "ZEROTRAIN_SLURM_PARTITION",
        value_delimiter = ','
    )]
    pub partitions: Vec<String>,
    /// The memory of a GPU GRES type, e.g. a100=80GiB (repeatable; the variable is
    /// comma-separated), over the built-in table (docs/operations.md). A node whose GPUs'
    /// type is in neither offers none.
    #[arg(
        id = "slurm_gpu_memory",
        long = "slurm-gpu-memory",
        value_name = "TYPE=SIZE",
        env = "ZEROTRAIN_SLURM_GPU_MEMORY",
        value_delimiter = ',',
        value_parser = parse_gpu_memory
    )]
    pub gpu_memory: Vec<(String, u64)>,
    /// Virtual CPU devices a partition node without GPUs offers (0: none).
    #[arg(
        id = "slurm_cpu_devices",
        long = "slurm-cpu-devices",
        env = "ZEROTRAIN_SLURM_CPU_DEVICES",
        default_value_t = 1
    )]
    pub cpu_devices: usize,
    /// The memory budget of each such device, at most the node's memory shared among them.
    #[arg(
        id = "slurm_device_memory",
        long = "slurm-device-memory",
        env = "ZEROTRAIN_SLURM_DEVICE_MEMORY",
        default_value = "2GiB",
        value_parser = parse_size
    )]
    pub device_memory: u64,
    /// The `zerotrain` binary as the partition's nodes see it [default: this server's own
    /// path, for nodes that share its filesystem].
    #[arg(
        id = "slurm_agent_binary",
        long = "slurm-agent-binary",
        env = "ZEROTRAIN_SLURM_AGENT_BINARY",
        value_name = "PATH"
    )]
    pub agent_binary: Option<PathBuf>,
    /// The cluster's slurm.conf, as `SLURM_CONF` for the Slurm commands the server runs
    /// [default: Slurm's own lookup].
    #[arg(
        id = "slurm_conf",
        long = "slurm-conf",
        env = "ZEROTRAIN_SLURM_CONF",
        value_name = "PATH"
    )]
    pub conf: Option<PathBuf>,
    /// The URL the allocations' agents reach this server at [default: the public URL, else
    /// the address it listens on].
    #[arg(
        id = "slurm_server_url",
        long = "slurm-server-url",
        env = "ZEROTRAIN_SLURM_SERVER_URL",
        value_parser = parse_public_url
    )]
    pub server_url: Option<url::Url>,
}

/// `TYPE=SIZE`, e.g. `h100=80GiB`.
fn parse_gpu_memory(s: &str) -> Result<(String, u64), String> {
    let (kind, size) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not TYPE=SIZE"))?;
    if kind.is_empty() {
        return Err(format!("{s:?} names no GPU type"));
    }
    let bytes = parse_size(size).map_err(|e| e.to_string())?;
    Ok((kind.to_ascii_lowercase(), bytes))
}

impl Default for Limits {
    fn default() -> Self {
        Settings::default().limits
    }
}

/// The defaults, whatever the environment says.
impl Default for Settings {
    fn default() -> Self {
        Settings::parse(false, []).expect("the defaults parse")
    }
}

impl Settings {
    /// The defaults with every `ZEROTRAIN_*` variable that is set applied over them.
    pub fn from_env() -> Result<Settings, clap::Error> {
        Settings::parse(true, [])
    }

    /// `flags` over the defaults, and over the `ZEROTRAIN_*` variables when `with_env`.
    fn parse<'a>(
        with_env: bool,
        flags: impl IntoIterator<Item = &'a str>,
    ) -> Result<Settings, clap::Error> {
        let mut command = Settings::augment_args(Command::new("zerotrain"));
        if !with_env {
            command = command.mut_args(|a| a.env(None));
        }
        let args = std::iter::once("zerotrain").chain(flags);
        Settings::from_arg_matches(&command.try_get_matches_from(args)?)
    }

    /// The database URL in effect.
    pub fn database_url(&self) -> String {
        self.database_url
            .clone()
            .unwrap_or_else(|| format!("sqlite://{}", self.data_dir.join("zerotrain.db").display()))
    }

    /// The data roots, checked: `data_roots`, or `<data_dir>/datasets` (created if missing);
    /// none may hold the data dir or the SQLite database.
    pub fn open_data_roots(&self) -> Result<DataRoots, RootsError> {
        let database: Vec<PathBuf> = self.sqlite_path().into_iter().collect();
        DataRoots::for_data_dir(&self.data_roots, &self.data_dir, &database)
    }

    /// The SQLite database file, when the store is one.
    pub fn sqlite_path(&self) -> Option<PathBuf> {
        let url = self.database_url();
        let path = url.strip_prefix("sqlite://")?;
        Some(PathBuf::from(path.split('?').next().unwrap_or(path)))
    }

    /// The artifact store in effect: `artifacts`, or `<data_dir>/artifacts`.
    pub fn artifacts(&self) -> String {
        self.artifacts
            .clone()
            .unwrap_or_else(|| self.data_dir.join("artifacts").display().to_string())
    }
}

/// `s3://bucket[/prefix]` or an absolute directory.
fn parse_artifacts(v: &str) -> Result<String, String> {
    match v.strip_prefix("s3://") {
        Some(rest) if rest.split('/').next().is_some_and(|b| !b.is_empty()) => Ok(v.into()),
        Some(_) => Err("s3:// needs a bucket: s3://bucket/prefix".into()),
        None if Path::new(v).is_absolute() => Ok(v.into()),
        None => Err("expected s3://bucket/prefix or an absolute directory".into()),
    }
}

/// A size such as `4MiB` or `1048576`, as a count of bytes.
fn parse_body_limit(s: &str) -> Result<usize, String> {
    let bytes = parse_size(s).map_err(|e| e.to_string())?;
    usize::try_from(bytes).map_err(|e| e.to_string())
}

/// `$XDG_DATA_HOME/zerotrain`, else `~/.local/share/zerotrain`, else `./zerotrain-data`.
pub fn default_data_dir() -> PathBuf {
    let xdg = std::env::var_os("XDG_DATA_HOME").filter(|v| !v.is_empty());
    let home = std::env::var_os("HOME").filter(|v| !v.is_empty());
    match (xdg, home) {
        (Some(xdg), _) => Path::new(&xdg).join("zerotrain"),
        (None, Some(home)) => Path::new(&home).join(".local/share/zerotrain"),
        (None, None) => PathBuf::from("zerotrain-data"),
    }
}

/// `500ms`, `2s`, `5m`, `1h`, `7d`, or a plain number of seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let (value, unit) =
        number_and_unit(s).ok_or("expected a number with an optional unit: ms, s, m, h or d")?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        "d" => value * 86400.0,
        other => return Err(format!("unknown unit {other:?}; use ms, s, m, h or d")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| e.to_string())
}

/// An `http` or `https` URL of a host, with no path: where browsers reach the server.
pub fn parse_public_url(s: &str) -> Result<url::Url, String> {
    let url = url::Url::parse(s).map_err(|e| e.to_string())?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err("expected http://HOST[:PORT] or https://HOST[:PORT]".into());
    }
    if url.path() != "/" || url.query().is_some() {
        return Err("the console is served at the root: give no path or query".into());
    }
    Ok(url)
}

/// A fraction in [0, 1).
fn parse_margin(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(m) if (0.0..1.0).contains(&m) => Ok(m),
        _ => Err("expected a fraction in [0, 1), e.g. 0.05".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(flags: &[&str]) -> Result<Settings, clap::Error> {
        Settings::parse(false, flags.iter().copied())
    }

    #[test]
    fn flags_override_the_defaults() {
        let s = parse(&[
            "--port=9000",
            "--heartbeat-timeout=1500ms",
            "--safety-margin=0.1",
            "--body-limit=1MiB",
            "--queue-unregistered-devices",
            "--scheduler-lease=3s",
            "--max-queued-per-owner=5",
            "--data-root=/srv/a:/srv/b",
        ])
        .unwrap();
        assert_eq!(s.port, 9000);
        assert_eq!(s.heartbeat_timeout, Duration::from_millis(1500));
        assert_eq!(s.safety_margin, 0.1);
        assert_eq!(s.body_limit, 1 << 20);
        assert!(s.queue_unregistered_devices);
        assert_eq!(s.scheduler_lease, Duration::from_secs(3));
        assert_eq!(s.limits.queued_per_owner, 5);
        assert_eq!(
            s.data_roots,
            [PathBuf::from("/srv/a"), PathBuf::from("/srv/b")]
        );
        let d = Settings::default();
        assert_eq!(s.scheduling_interval, d.scheduling_interval);
        assert_eq!(
            (d.port, d.body_limit, d.limits.max_steps),
            (8080, 4 << 20, 1_000_000)
        );
        assert_eq!(d.limits.model_retention, None);
        assert!(!d.queue_unregistered_devices);
    }

    #[test]
    fn every_setting_is_a_flag_and_the_variable_of_its_name() {
        let command = Settings::augment_args(Command::new("zerotrain"));
        let mut names = Vec::new();
        for arg in command.get_arguments() {
            let long = arg.get_long().expect("every setting has a flag");
            let mut var = format!("ZEROTRAIN_{}", long.to_uppercase().replace('-', "_"));
            if long == "data-root" {
                var.push('S'); // one root per flag, all of them in the variable
            }
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            assert_eq!(env.as_deref(), Some(var.as_str()), "--{long}");
            assert!(arg.get_help().is_some(), "--{long} says what it does");
            names.push(var);
        }
        for flattened in [
            "ZEROTRAIN_SCHEDULER_LEASE",
            "ZEROTRAIN_AUTH_FAILURES_PER_MINUTE",
        ] {
            assert!(names.iter().any(|n| n == flattened), "{names:?}");
        }
    }

    #[test]
    fn a_bad_value_is_named_with_its_reason() {
        let err = parse(&["--safety-margin=2"]).unwrap_err().to_string();
        assert!(
            err.contains("--safety-margin") && err.contains("[0, 1)"),
            "{err}"
        );
        let err = parse(&["--heartbeat-timeout=2 fortnights"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--heartbeat-timeout"), "{err}");
    }

    #[test]
    fn a_public_url_is_an_origin() {
        let url = parse_public_url("https://zt.example.com").unwrap();
        assert_eq!(url.origin().ascii_serialization(), "https://zt.example.com");
        assert!(parse_public_url("https://zt.example.com/console").is_err());
        assert!(parse_public_url("ftp://zt.example.com").is_err());
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86400)
        );
        assert!(parse_duration("2 fortnights").is_err());
    }

    #[test]
    fn artifacts_go_to_s3_or_an_absolute_directory() {
        assert_eq!(
            parse_artifacts("s3://models/team-a").unwrap(),
            "s3://models/team-a"
        );
        assert!(parse_artifacts("/srv/zerotrain/artifacts").is_ok());
        for bad in ["s3://", "s3:///prefix", "artifacts", "gs://bucket"] {
            assert!(parse_artifacts(bad).is_err(), "{bad}");
        }
        let s = Settings {
            data_dir: PathBuf::from("/var/lib/zt"),
            ..Settings::default()
        };
        assert_eq!(s.artifacts(), "/var/lib/zt/artifacts");
        let secret = S3Options(vec![("AWS_SECRET_ACCESS_KEY".into(), "hunter2".into())]);
        assert!(
            !format!("{secret:?}").contains("hunter2"),
            "secrets stay out of logs"
        );
    }

    #[test]
    fn the_default_database_lives_in_the_data_dir() {
        let s = Settings {
            data_dir: PathBuf::from("/var/lib/zt"),
            ..Settings::default()
        };
        assert_eq!(s.database_url(), "sqlite:///var/lib/zt/zerotrain.db");
    }
}
