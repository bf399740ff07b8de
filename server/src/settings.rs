//! The server's settings, layered: defaults ← `ZEROTRAIN_*` environment variables ← command-line
//! flags (the CLI assigns its flags over `Settings::from_env()`). The defaults work on a fresh
//! machine: loopback on port 8080, SQLite under the user's data directory.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use scheduler::bytes::{number_and_unit, parse_size};
use wire::data_roots::{DataRoots, RootsError};

#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Address to listen on (`ZEROTRAIN_LISTEN`, default 127.0.0.1).
    pub listen: IpAddr,
    /// Port to listen on; 0 picks a free one (`ZEROTRAIN_PORT`, default 8080).
    pub port: u16,
    /// Where the SQLite database, job outputs and token files live (`ZEROTRAIN_DATA_DIR`,
    /// default `$XDG_DATA_HOME/zerotrain` or `~/.local/share/zerotrain`).
    pub data_dir: PathBuf,
    /// The directories jobs may name input files in (`ZEROTRAIN_DATA_ROOTS`, `:`-separated;
    /// default `<data_dir>/datasets`). Submissions naming a file outside them are refused;
    /// `zerotrain up`'s local agent reads only inside them. They may not contain `data_dir`.
    pub data_roots: Vec<PathBuf>,
    /// `sqlite://PATH` or `postgres://…` (`ZEROTRAIN_DATABASE_URL`); `None` means
    /// `sqlite://<data_dir>/zerotrain.db`.
    pub database_url: Option<String>,
    /// A node silent this long is lost and its jobs go back to the queue
    /// (`ZEROTRAIN_HEARTBEAT_TIMEOUT`, default 30s).
    pub heartbeat_timeout: Duration,
    /// How often agents are told to heartbeat (`ZEROTRAIN_HEARTBEAT_INTERVAL`, default 2s).
    pub heartbeat_interval: Duration,
    /// Time between scheduling passes; submissions and finished jobs also start one
    /// (`ZEROTRAIN_SCHEDULING_INTERVAL`, default 1s).
    pub scheduling_interval: Duration,
    /// How long the scheduler lease lasts unrenewed: the replica holding it places jobs and
    /// renews it every pass; when it stops (killed, cut off from the database), another replica
    /// takes over this long after its last pass (`ZEROTRAIN_SCHEDULER_LEASE`, default 10s). A
    /// server that shuts down hands it over at once.
    pub scheduler_lease: Duration,
    /// Fraction of each device's memory placement keeps free (`ZEROTRAIN_SAFETY_MARGIN`,
    /// default 0.05).
    pub safety_margin: f64,
    /// Largest request body accepted (`ZEROTRAIN_BODY_LIMIT`, default 4MiB).
    pub body_limit: usize,
    /// Longest a request may take to produce its response headers
    /// (`ZEROTRAIN_REQUEST_TIMEOUT`, default 30s); streams run on past it.
    pub request_timeout: Duration,
    /// How long a finished job's training series stay on `/metrics`, so the last scrape sees
    /// its final values (`ZEROTRAIN_FINISHED_SERIES_TTL`, default 60s).
    pub finished_series_ttl: Duration,
    /// The URL browsers reach the server at, when it is not `http://` + the `Host` they send:
    /// behind a TLS-terminating proxy, `https://zerotrain.example.com` (`ZEROTRAIN_PUBLIC_URL`).
    /// Its origin is what cookie-authenticated requests must come from; with `https` the
    /// console's cookie is `Secure` and `__Host-` prefixed.
    pub public_url: Option<url::Url>,
    /// How long a console login lasts (`ZEROTRAIN_SESSION_TTL`, default 12h).
    pub session_ttl: Duration,
    /// `/readyz` waits for an agent to register (`zerotrain up` sets it for its local agent).
    pub expect_local_agent: bool,
    /// Queue a job that asks for a kind of device (`"device": "cuda"`) of which no node has
    /// registered any, planned as if such devices held it, instead of refusing it with 422: for
    /// clusters whose GPU nodes join later (`ZEROTRAIN_QUEUE_UNREGISTERED_DEVICES`, default
    /// false).
    pub queue_unregistered_devices: bool,
    /// Where jobs' checkpoints and exports are kept (`ZEROTRAIN_ARTIFACTS`): `s3://bucket/prefix`
    /// (any S3-compatible store) or a directory; `None` means `<data_dir>/artifacts`.
    pub artifacts: Option<String>,
    /// The S3 store's configuration: the `AWS_*` variables the server started with
    /// (credentials, `AWS_REGION`, `AWS_ENDPOINT_URL` for another S3-compatible store, ...).
    pub s3: S3Options,
    /// What one owner (token name) may ask of the service.
    pub limits: Limits,
}

/// `object_store`'s S3 configuration as `(key, value)` pairs, keys as the `AWS_*` variables
/// spell them; shown without its values, which hold secrets.
#[derive(Clone, Default, PartialEq)]
pub struct S3Options(pub Vec<(String, String)>);

impl std::fmt::Debug for S3Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| k))
            .finish()
    }
}

/// Limits an operator sets; every one has a default that keeps one client from exhausting the
/// service.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Queued jobs one owner may have; a submission past it gets 429
    /// (`ZEROTRAIN_MAX_QUEUED_PER_OWNER`, default 1000).
    pub queued_per_owner: u32,
    /// Ranks one owner's scheduled and running jobs may hold at once; further jobs wait, and
    /// a job of more ranks is refused (`ZEROTRAIN_MAX_RUNNING_RANKS_PER_OWNER`, default 64).
    pub running_ranks_per_owner: u32,
    /// Largest `training.steps` accepted (`ZEROTRAIN_MAX_STEPS`, default 1000000).
    pub max_steps: u32,
    /// How long an attempt may hold its devices before the job fails
    /// (`ZEROTRAIN_MAX_WALL_TIME`, default 72h).
    pub max_wall_time: Duration,
    /// A finished job's checkpoints are removed this long after it ended
    /// (`ZEROTRAIN_CHECKPOINT_RETENTION`, default 7d).
    pub checkpoint_retention: Duration,
    /// A finished job's whole output directory (the final model too) is removed this long
    /// after it ended; `None` keeps the model (`ZEROTRAIN_MODEL_RETENTION`, default unset).
    pub model_retention: Option<Duration>,
    /// Failed authentications (unknown tokens) one client address may make per minute before
    /// its requests get 429 with `Retry-After`; 0 turns the limit off
    /// (`ZEROTRAIN_AUTH_FAILURES_PER_MINUTE`, default 30).
    pub auth_failures_per_minute: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            queued_per_owner: 1000,
            running_ranks_per_owner: 64,
            max_steps: 1_000_000,
            max_wall_time: Duration::from_secs(72 * 3600),
            checkpoint_retention: Duration::from_secs(7 * 24 * 3600),
            model_retention: None,
            auth_failures_per_minute: 30,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{var}={value:?}: {reason}")]
pub struct SettingsError {
    pub var: &'static str,
    pub value: String,
    pub reason: String,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            listen: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 8080,
            data_dir: default_data_dir(),
            data_roots: Vec::new(),
            database_url: None,
            heartbeat_timeout: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(2),
            scheduling_interval: Duration::from_secs(1),
            scheduler_lease: Duration::from_secs(10),
            safety_margin: 0.05,
            body_limit: 4 << 20,
            request_timeout: Duration::from_secs(30),
            finished_series_ttl: Duration::from_secs(60),
            public_url: None,
            session_ttl: Duration::from_secs(12 * 3600),
            expect_local_agent: false,
            queue_unregistered_devices: false,
            artifacts: None,
            s3: S3Options::default(),
            limits: Limits::default(),
        }
    }
}

impl Settings {
    /// The defaults with every `ZEROTRAIN_*` variable that is set applied over them.
    pub fn from_env() -> Result<Settings, SettingsError> {
        let mut s = Settings::from_vars(|name| std::env::var(name).ok())?;
        s.s3 = S3Options(
            std::env::vars()
                .filter(|(k, _)| k.starts_with("AWS_"))
                .collect(),
        );
        Ok(s)
    }

    fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Settings, SettingsError> {
        // Parses variable `name` with `parse` when it is set.
        let read = |name: &'static str| var(name).map(|value| (name, value));
        let mut s = Settings::default();
        if let Some(v) = read("ZEROTRAIN_LISTEN") {
            s.listen = parse(v, |v| v.parse().map_err(|e| format!("{e}")))?;
        }
        if let Some(v) = read("ZEROTRAIN_PORT") {
            s.port = parse(v, |v| v.parse().map_err(|e| format!("{e}")))?;
        }
        if let Some((_, v)) = read("ZEROTRAIN_DATA_DIR") {
            s.data_dir = PathBuf::from(v);
        }
        if let Some((_, v)) = read("ZEROTRAIN_DATA_ROOTS") {
            s.data_roots = std::env::split_paths(&v).collect();
        }
        if let Some((_, v)) = read("ZEROTRAIN_DATABASE_URL") {
            s.database_url = Some(v);
        }
        if let Some(v) = read("ZEROTRAIN_ARTIFACTS") {
            s.artifacts = Some(parse(v, parse_artifacts)?);
        }
        if let Some(v) = read("ZEROTRAIN_HEARTBEAT_TIMEOUT") {
            s.heartbeat_timeout = parse(v, parse_duration)?;
        }
        if let Some(v) = read("ZEROTRAIN_HEARTBEAT_INTERVAL") {
            s.heartbeat_interval = parse(v, parse_duration)?;
        }
        if let Some(v) = read("ZEROTRAIN_SCHEDULING_INTERVAL") {
            s.scheduling_interval = parse(v, parse_duration)?;
        }
        if let Some(v) = read("ZEROTRAIN_SCHEDULER_LEASE") {
            s.scheduler_lease = parse(v, parse_duration)?;
        }
        if let Some(v) = read("ZEROTRAIN_SAFETY_MARGIN") {
            s.safety_margin = parse(v, parse_margin)?;
        }
        if let Some(v) = read("ZEROTRAIN_BODY_LIMIT") {
            s.body_limit = parse(v, |v| {
                let bytes = parse_size(v).map_err(|e| e.to_string())?;
                usize::try_from(bytes).map_err(|e| e.to_string())
            })?;
        }
        if let Some(v) = read("ZEROTRAIN_REQUEST_TIMEOUT") {
            s.request_timeout = parse(v, parse_duration)?;
        }
        if let Some(v) = read("ZEROTRAIN_FINISHED_SERIES_TTL") {
            s.finished_series_ttl = parse(v, parse_duration)?;
        }
        if let Some(v) = read("ZEROTRAIN_PUBLIC_URL") {
            s.public_url = Some(parse(v, parse_public_url)?);
        }
        if let Some(v) = read("ZEROTRAIN_SESSION_TTL") {
            s.session_ttl = parse(v, parse_duration)?;
        }
        if let Some(v) = read("ZEROTRAIN_QUEUE_UNREGISTERED_DEVICES") {
            s.queue_unregistered_devices = parse(v, parse_bool)?;
        }
        let count = |v: &str| v.parse::<u32>().map_err(|e| e.to_string());
        let l = &mut s.limits;
        if let Some(v) = read("ZEROTRAIN_MAX_QUEUED_PER_OWNER") {
            l.queued_per_owner = parse(v, count)?;
        }
        if let Some(v) = read("ZEROTRAIN_MAX_RUNNING_RANKS_PER_OWNER") {
            l.running_ranks_per_owner = parse(v, count)?;
        }
        if let Some(v) = read("ZEROTRAIN_MAX_STEPS") {
            l.max_steps = parse(v, count)?;
        }
        if let Some(v) = read("ZEROTRAIN_MAX_WALL_TIME") {
            l.max_wall_time = parse(v, parse_duration)?;
        }
        if let Some(v) = read("ZEROTRAIN_CHECKPOINT_RETENTION") {
            l.checkpoint_retention = parse(v, parse_duration)?;
        }
        if let Some(v) = read("ZEROTRAIN_MODEL_RETENTION") {
            l.model_retention = Some(parse(v, parse_duration)?);
        }
        if let Some(v) = read("ZEROTRAIN_AUTH_FAILURES_PER_MINUTE") {
            l.auth_failures_per_minute = parse(v, count)?;
        }
        Ok(s)
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
pub fn parse_artifacts(v: &str) -> Result<String, String> {
    match v.strip_prefix("s3://") {
        Some(rest) if rest.split('/').next().is_some_and(|b| !b.is_empty()) => Ok(v.into()),
        Some(_) => Err("s3:// needs a bucket: s3://bucket/prefix".into()),
        None if Path::new(v).is_absolute() => Ok(v.into()),
        None => Err("expected s3://bucket/prefix or an absolute directory".into()),
    }
}

fn parse<T>(
    (var, value): (&'static str, String),
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<T, SettingsError> {
    parse(&value).map_err(|reason| SettingsError { var, value, reason })
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
pub fn parse_duration(s: &str) -> Result<Duration, String> {
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

/// `true`/`false` (or `1`/`0`).
pub fn parse_bool(s: &str) -> Result<bool, String> {
    match s.trim() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err("expected true or false".to_string()),
    }
}

/// A fraction in [0, 1).
pub fn parse_margin(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(m) if (0.0..1.0).contains(&m) => Ok(m),
        _ => Err("expected a fraction in [0, 1), e.g. 0.05".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_variables_override_the_defaults() {
        let vars = [
            ("ZEROTRAIN_PORT", "9000"),
            ("ZEROTRAIN_HEARTBEAT_TIMEOUT", "1500ms"),
            ("ZEROTRAIN_SAFETY_MARGIN", "0.1"),
            ("ZEROTRAIN_BODY_LIMIT", "1MiB"),
            ("ZEROTRAIN_QUEUE_UNREGISTERED_DEVICES", "true"),
            ("ZEROTRAIN_SCHEDULER_LEASE", "3s"),
        ];
        let s = Settings::from_vars(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
        .unwrap();
        assert_eq!(s.port, 9000);
        assert_eq!(s.heartbeat_timeout, Duration::from_millis(1500));
        assert_eq!(s.safety_margin, 0.1);
        assert_eq!(s.body_limit, 1 << 20);
        assert!(s.queue_unregistered_devices);
        assert_eq!(s.scheduler_lease, Duration::from_secs(3));
        assert_eq!(
            s.scheduling_interval,
            Settings::default().scheduling_interval
        );
    }

    #[test]
    fn a_bad_variable_is_named() {
        let err =
            Settings::from_vars(|name| (name == "ZEROTRAIN_SAFETY_MARGIN").then(|| "2".into()))
                .unwrap_err();
        assert_eq!(err.var, "ZEROTRAIN_SAFETY_MARGIN");
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
