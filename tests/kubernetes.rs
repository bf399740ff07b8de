//! `deploy/kubernetes`, rendered by kustomize as an operator would (`kubectl kustomize
//! --load-restrictor=LoadRestrictionsNone`, or `kustomize build`: the dashboard's ConfigMap is
//! generated from `deploy/grafana`, outside the kustomization's folder), passes the Kubernetes
//! API's schemas of 1.30 and of the newest version `kubernetes-validate` ships, strictly (an
//! unknown field fails); every flag and `ZEROTRAIN_*` variable its containers pass is one that
//! `zerotrain serve --help` / `agent --help` lists (or that the code reads); an overlay picks
//! the image, the server's replica count and the GPUs per node; and the objects agree with each
//! other (selectors, ports, mounts) and with docs/operations.md's secrets.
//!
//! Needs `kubectl` (≥ 1.21, with kustomize inside) or `kustomize` on PATH, and the virtual
//! environment `scripts/kubeenv` makes from PyPI (kubernetes-validate and PyYAML, pinned; once).
//! Without either the tests fail saying so, unless `ZEROTRAIN_SKIP_KUBERNETES=1`: then they
//! say what they did not check and pass.
//!
//! The PodMonitors (Prometheus Operator's CRD) have no schema in kubernetes-validate: they are
//! the only objects allowed to have none, and `the_manifests_agree_…` checks their selectors,
//! ports and secret instead. The manifests have never been applied to a real cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use serde_json::Value;

/// Set to 1 to pass, saying so, where kubectl/kustomize or the virtual environment is missing.
const SKIP: &str = "ZEROTRAIN_SKIP_KUBERNETES";

/// What `deploy/kubernetes/kustomization.yaml` sets.
const BASE_IMAGE: &str = "zerotrain:0.1.0";
const BASE_REPLICAS: u64 = 2;
const BASE_GPUS: u64 = 8;

/// `ZEROTRAIN_*` variables the manifests set that are not settings of the subcommand's
/// `--help`, each with the file that reads it (checked to still do so).
const READ_IN_CODE: [(&str, &str, &str); 2] = [
    // The admin token `serve` stores on first start.
    ("serve", "ZEROTRAIN_TOKEN", "cli/src/serve.rs"),
    // Where the CUDA back end keeps the kernels NVRTC compiled.
    (
        "agent",
        "ZEROTRAIN_KERNEL_CACHE",
        "kernels/src/cuda/program.rs",
    ),
];

/// Reads YAML on stdin, validates each object strictly against each version's schemas, prints
/// `{latest, versions, objects, results}` as JSON. `kubernetes-validate`'s command line prints a
/// warning and exits 0 for an object it has no schema for (a CRD, but also a misspelt
/// apiVersion), so the module is called instead and the outcome of each object kept.
const VALIDATE: &str = r#"
import functools, json, sys, yaml
import kubernetes_validate.utils as kv

# One read of each schema file, not one per object.
kv.schema_contents = functools.lru_cache(maxsize=None)(kv.schema_contents)
objects = [o for o in yaml.safe_load_all(sys.stdin) if o]
versions = ["1.30", kv.latest_version()]
results = []
for o in objects:
    for v in versions:
        try:
            outcome, detail = "passed", kv.validate(o, v, strict=True)
        except kv.SchemaNotFoundError as e:
            outcome, detail = "no_schema", e.message
        except kv.ValidationError as e:
            outcome, detail = "failed", "%s: %s" % (".".join(map(str, e.path)), e.message)
        results.append({"kind": o["kind"], "name": o["metadata"]["name"], "version": v,
                        "outcome": outcome, "detail": str(detail)})
json.dump({"latest": kv.latest_version(), "versions": versions, "objects": objects,
           "results": results}, sys.stdout)
"#;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ has a parent")
        .to_path_buf()
}

fn base_dir() -> PathBuf {
    root().join("deploy/kubernetes")
}

/// The programs the checks need.
struct Tools {
    /// kustomize's command line, up to the folder to build.
    kustomize: Vec<String>,
    /// The interpreter of `scripts/kubeenv`'s environment.
    python: String,
}

/// `None` (after saying why) when a tool is missing and `ZEROTRAIN_SKIP_KUBERNETES=1`.
fn tools() -> Option<&'static Tools> {
    static TOOLS: OnceLock<Result<Tools, String>> = OnceLock::new();
    match TOOLS.get_or_init(find_tools) {
        Ok(tools) => Some(tools),
        Err(why) if std::env::var(SKIP).is_ok_and(|v| v == "1") => {
            eprintln!("kubernetes: NOT CHECKED ({SKIP}=1): {why}");
            None
        }
        Err(why) => panic!("{why}\n(set {SKIP}=1 to skip these checks where that cannot be had)"),
    }
}

fn find_tools() -> Result<Tools, String> {
    let restrictor = "--load-restrictor=LoadRestrictionsNone".to_string();
    let kustomize = if let Some(k) = on_path("kustomize") {
        vec![k, "build".into(), restrictor]
    } else if let Some(k) = on_path("kubectl") {
        vec![k, "kustomize".into(), restrictor]
    } else {
        return Err("neither kustomize nor kubectl (>= 1.21) is on PATH".into());
    };
    let out = Command::new(root().join("scripts/kubeenv"))
        .output()
        .map_err(|e| format!("scripts/kubeenv: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "scripts/kubeenv could not make the environment (kubernetes-validate from PyPI):\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let python = String::from_utf8(out.stdout).unwrap().trim().to_string();
    Ok(Tools { kustomize, python })
}

fn on_path(program: &str) -> Option<String> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .map(|p| p.display().to_string())
}

/// One kustomization, rendered and validated.
struct Rendered {
    /// The newest Kubernetes version kubernetes-validate ships, e.g. `1.37.0`.
    latest: String,
    versions: Vec<String>,
    objects: Vec<Value>,
    /// One per object and version: kind, name, version, outcome, detail.
    results: Vec<Value>,
}

impl Rendered {
    fn object(&self, kind: &str, name: &str) -> &Value {
        self.objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name} among the rendered objects"))
    }

    /// The Deployments' and DaemonSets' pod templates.
    fn workloads(&self) -> Vec<&Value> {
        self.objects
            .iter()
            .filter(|o| o["kind"] == "Deployment" || o["kind"] == "DaemonSet")
            .collect()
    }
}

fn render(tools: &Tools, dir: &Path) -> Rendered {
    let out = Command::new(&tools.kustomize[0])
        .args(&tools.kustomize[1..])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{:?} {}: {}",
        tools.kustomize,
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    validate(tools, &out.stdout)
}

/// Every object of `yaml` against the schemas of each version.
fn validate(tools: &Tools, yaml: &[u8]) -> Rendered {
    let mut python = Command::new(&tools.python)
        .args(["-c", VALIDATE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The rendering is small (tens of KiB): written whole before the output is read.
    std::io::Write::write_all(&mut python.stdin.take().unwrap(), yaml).unwrap();
    let validated = python.wait_with_output().unwrap();
    assert!(
        validated.status.success(),
        "validating: {}",
        String::from_utf8_lossy(&validated.stderr)
    );
    let v: Value = serde_json::from_slice(&validated.stdout).unwrap();
    Rendered {
        latest: v["latest"].as_str().unwrap().to_string(),
        versions: strings(&v["versions"]),
        objects: v["objects"].as_array().unwrap().clone(),
        results: v["results"].as_array().unwrap().clone(),
    }
}

/// deploy/kubernetes as it stands, rendered once for all the tests.
fn base() -> Option<&'static Rendered> {
    static BASE: OnceLock<Rendered> = OnceLock::new();
    let tools = tools()?;
    Some(BASE.get_or_init(|| render(tools, &base_dir())))
}

/// `1.30.0` → `1.30`.
fn major_minor(version: &str) -> String {
    version.split('.').take(2).collect::<Vec<_>>().join(".")
}

/// Each object's failures against the schemas, and the objects with no schema that are not
/// Prometheus Operator's PodMonitors.
fn schema_problems(r: &Rendered) -> Vec<String> {
    assert_eq!(r.results.len(), r.objects.len() * r.versions.len());
    let mut problems = Vec::new();
    for res in &r.results {
        let text = |k: &str| res[k].as_str().unwrap();
        let (kind, name, version, detail) =
            (text("kind"), text("name"), text("version"), text("detail"));
        let object = r.object(kind, name);
        match text("outcome") {
            // kubernetes-validate falls back to an older version's schemas where it lacks the
            // one asked for: it must have used the version asked for.
            "passed" if detail == major_minor(version) => {}
            "no_schema"
                if kind == "PodMonitor"
                    && object["apiVersion"] == "monitoring.coreos.com/v1"
                    && detail.contains("Couldn't find schema for kind PodMonitor") => {}
            outcome => problems.push(format!("{kind} {name} on {version}: {outcome}: {detail}")),
        }
    }
    problems
}

#[test]
fn every_object_validates_against_kubernetes_1_30_and_the_newest_schemas() {
    let Some(r) = base() else { return };
    assert_eq!(r.versions[0], "1.30");
    assert_eq!(r.versions[1], r.latest);
    let newest: Vec<u32> = major_minor(&r.latest)
        .split('.')
        .map(|n| n.parse().unwrap())
        .collect();
    assert!(
        newest > vec![1, 30],
        "kubernetes-validate's newest: {}",
        r.latest
    );
    let problems = schema_problems(r);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // What the issue asks for is there (and so was validated above).
    for (kind, name) in [
        ("Deployment", "zerotrain-server"),
        ("Service", "zerotrain"),
        ("DaemonSet", "zerotrain-agent"),
        ("NetworkPolicy", "zerotrain-agents"),
        ("ConfigMap", "zerotrain-grafana-dashboard"),
        ("PodMonitor", "zerotrain-server"),
        ("PodMonitor", "zerotrain-agents"),
    ] {
        let o = r.object(kind, name);
        assert_eq!(o["metadata"]["namespace"], "zerotrain", "{kind} {name}");
    }
    // Only the PodMonitors went unvalidated.
    let unvalidated: BTreeSet<String> = r
        .results
        .iter()
        .filter(|res| res["outcome"] != "passed")
        .map(|res| {
            format!(
                "{} {}",
                res["kind"].as_str().unwrap(),
                res["name"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        unvalidated,
        BTreeSet::from([
            "PodMonitor zerotrain-agents".to_string(),
            "PodMonitor zerotrain-server".to_string()
        ])
    );
}

#[test]
fn a_misspelt_field_or_api_version_fails_the_schema_check() {
    let Some(r) = base() else { return };
    let tools = tools().unwrap();
    // The check above would catch these: one unknown field, one apiVersion with no schema.
    let mut bad = r.object("DaemonSet", "zerotrain-agent").clone();
    bad["spec"]["template"]["spec"]["containers"][0]["argz"] = serde_json::json!(["agent"]);
    let mut old = r.object("Deployment", "zerotrain-server").clone();
    old["apiVersion"] = "apps/v1beta2".into();
    let yaml = [bad, old]
        .iter()
        .map(|o| serde_json::to_string(o).unwrap()) // JSON is YAML
        .collect::<Vec<_>>()
        .join("\n---\n");
    let bad = validate(tools, yaml.as_bytes());
    let problems = schema_problems(&bad).join("\n");
    assert!(
        problems.contains("DaemonSet zerotrain-agent on 1.30: failed")
            && problems.contains("'argz' was unexpected"),
        "{problems}"
    );
    assert!(
        problems.contains("Deployment zerotrain-server on 1.30: no_schema"),
        "{problems}"
    );
}

/// `zerotrain SUBCOMMAND --help`, once per subcommand.
fn help(subcommand: &str) -> &'static str {
    static HELP: OnceLock<BTreeMap<&'static str, String>> = OnceLock::new();
    let all = HELP.get_or_init(|| {
        ["serve", "agent"]
            .into_iter()
            .map(|sub| {
                let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
                    .args([sub, "--help"])
                    .output()
                    .unwrap();
                assert!(out.status.success(), "zerotrain {sub} --help");
                (sub, String::from_utf8(out.stdout).unwrap())
            })
            .collect()
    });
    all.get(subcommand)
        .unwrap_or_else(|| panic!("the manifests run `zerotrain {subcommand}`, not serve or agent"))
}

/// The long flags a help text lists: `--name` at the start of a line (`--name <V>`), or after
/// `-x, `.
fn flags_in(help: &str) -> BTreeSet<String> {
    help.lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let line = match line.strip_prefix('-') {
                Some(rest) if !rest.starts_with('-') => rest.split_once(", ")?.1,
                _ => line,
            };
            let name: String = line
                .strip_prefix("--")?
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            Some(name)
        })
        .collect()
}

/// The variables a help text names (`[env: NAME=…]`).
fn variables_in(help: &str) -> BTreeSet<String> {
    help.split("[env: ")
        .skip(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

/// The `--flags` among `args` that `zerotrain SUBCOMMAND` does not take.
fn unknown_flags(subcommand: &str, args: &[String]) -> Vec<String> {
    let known = flags_in(help(subcommand));
    args.iter()
        .filter_map(|a| a.strip_prefix("--"))
        .map(|a| a.split_once('=').map_or(a, |(name, _)| name))
        .filter(|name| !known.contains(*name))
        .map(|name| format!("--{name}"))
        .collect()
}

/// The `ZEROTRAIN_*` variables among `names` that `zerotrain SUBCOMMAND` does not read.
fn unknown_variables(subcommand: &str, names: &[String]) -> Vec<String> {
    let known = variables_in(help(subcommand));
    names
        .iter()
        .filter(|n| n.starts_with("ZEROTRAIN_") && !known.contains(*n))
        .filter(|n| {
            !READ_IN_CODE.iter().any(|(sub, var, file)| {
                *sub == subcommand
                    && var == n
                    && std::fs::read_to_string(root().join(file))
                        .unwrap()
                        .contains(&format!("\"{var}\""))
            })
        })
        .cloned()
        .collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| s.as_str().expect("a string").to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn containers(workload: &Value) -> Vec<&Value> {
    let spec = &workload["spec"]["template"]["spec"];
    ["initContainers", "containers"]
        .iter()
        .filter_map(|k| spec[k].as_array())
        .flatten()
        .collect()
}

/// The values of `--name=VALUE` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Vec<&'a str> {
    let prefix = format!("--{name}=");
    args.iter()
        .filter_map(|a| a.strip_prefix(prefix.as_str()))
        .collect()
}

/// The names a container's environment sets: `env`, and the keys of the ConfigMaps it takes
/// whole (`envFrom`; a Secret's keys are not known here).
fn variables(r: &Rendered, container: &Value) -> Vec<String> {
    let mut names: Vec<String> = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .collect();
    for from in container["envFrom"].as_array().into_iter().flatten() {
        if let Some(name) = from["configMapRef"]["name"].as_str() {
            let map = r.object("ConfigMap", name);
            names.extend(map["data"].as_object().unwrap().keys().cloned());
        }
    }
    names
}

#[test]
fn every_flag_and_variable_the_containers_pass_is_one_zerotrain_accepts() {
    let Some(r) = base() else { return };
    // The check fails on what it should: a flag no subcommand has, and one of the other's.
    assert_eq!(
        unknown_flags(
            "agent",
            &[
                "--no-such-flag".into(),
                "--database-url=postgres://x".into()
            ]
        ),
        ["--no-such-flag", "--database-url"]
    );
    assert!(unknown_flags("serve", &["--database-url=postgres://x".into()]).is_empty());
    assert_eq!(
        unknown_variables(
            "agent",
            &["ZEROTRAIN_TOKEN".into(), "ZEROTRAIN_NOPE".into()]
        ),
        ["ZEROTRAIN_TOKEN", "ZEROTRAIN_NOPE"]
    );

    let mut subcommands = BTreeSet::new();
    let mut problems = Vec::new();
    for workload in r.workloads() {
        for c in containers(workload) {
            let at = format!(
                "{} {}",
                workload["metadata"]["name"].as_str().unwrap(),
                c["name"].as_str().unwrap()
            );
            let command = strings(&c["command"]);
            let args = strings(&c["args"]);
            assert_eq!(command, ["zerotrain"], "{at}: command");
            let subcommand = args
                .first()
                .unwrap_or_else(|| panic!("{at}: no subcommand"));
            subcommands.insert(subcommand.clone());
            for f in unknown_flags(subcommand, &args[1..]) {
                problems.push(format!("{at}: zerotrain {subcommand} has no {f}"));
            }
            for f in args[1..].iter().filter(|a| !a.starts_with("--")) {
                problems.push(format!("{at}: {f:?} is not a --flag=value"));
            }
            let env = variables(r, c);
            for v in unknown_variables(subcommand, &env) {
                problems.push(format!("{at}: zerotrain {subcommand} does not read {v}"));
            }
            // Kubernetes leaves a `$(NAME)` it cannot resolve as it is.
            for a in &args {
                for reference in a.split("$(").skip(1) {
                    let name = reference.split(')').next().unwrap();
                    if !env.iter().any(|e| e == name) {
                        problems.push(format!("{at}: {a} names $({name}), which env lacks"));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // clap parses each value as it meets it, and prints help only on reaching `--help`: a
    // value the subcommand refuses (a port that is not a number) fails here.
    for workload in r.workloads() {
        for c in containers(workload) {
            let args: Vec<String> = strings(&c["args"]).iter().map(|a| expanded(a, c)).collect();
            let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
                .args(&args)
                .arg("--help")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "zerotrain {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    assert_eq!(
        subcommands,
        BTreeSet::from(["agent".to_string(), "serve".to_string()])
    );
}

/// `arg` with each `$(NAME)` replaced as Kubernetes would: by the container's `env` value, or a
/// value of the kind its downward-API field gives.
fn expanded(arg: &str, c: &Value) -> String {
    let mut arg = arg.to_string();
    for e in c["env"].as_array().into_iter().flatten() {
        let reference = format!("$({})", e["name"].as_str().unwrap());
        if !arg.contains(&reference) {
            continue;
        }
        let value = match (
            e["value"].as_str(),
            e["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        ) {
            (Some(v), _) => v,
            (None, Some("spec.nodeName")) => "gpu-node-1",
            (None, Some("status.podIP")) => "10.1.2.3",
            (None, field) => panic!("{reference}: no sample value for {field:?}"),
        };
        arg = arg.replace(&reference, value);
    }
    arg
}

/// `to` relative to `from` (kustomize takes no absolute path as a resource).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<Component> = from.components().collect();
    let to: Vec<Component> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut path = PathBuf::new();
    for _ in common..from.len() {
        path.push("..");
    }
    to[common..].iter().for_each(|c| path.push(c));
    path
}

/// The images, the server's replica count and the agents' GPU limit of a rendering.
fn picks(r: &Rendered) -> (BTreeSet<String>, u64, u64) {
    let images = r
        .workloads()
        .into_iter()
        .flat_map(containers)
        .map(|c| c["image"].as_str().unwrap().to_string())
        .collect();
    let replicas = r.object("Deployment", "zerotrain-server")["spec"]["replicas"]
        .as_u64()
        .unwrap();
    let agent = r.object("DaemonSet", "zerotrain-agent");
    let gpus = &containers(agent)[0]["resources"]["limits"]["nvidia.com/gpu"];
    let gpus = gpus
        .as_u64()
        .or_else(|| gpus.as_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| panic!("nvidia.com/gpu limit {gpus}"));
    (images, replicas, gpus)
}

#[test]
fn an_overlay_picks_the_image_the_replica_count_and_the_gpus_per_node() {
    let Some(r) = base() else { return };
    let tools = tools().unwrap();
    assert_eq!(
        picks(r),
        (
            BTreeSet::from([BASE_IMAGE.to_string()]),
            BASE_REPLICAS,
            BASE_GPUS
        )
    );
    // The overlay docs/operations.md shows, on this checkout.
    let docs = docs_section();
    let yaml = docs
        .split("```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/operations.md's \"On Kubernetes\" shows an overlay");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let overlay = dir.path().canonicalize().unwrap();
    let base = relative(&overlay, &base_dir().canonicalize().unwrap());
    let their_base = "../zerotrain/deploy/kubernetes";
    assert!(yaml.contains(their_base), "{yaml}");
    let yaml = yaml.replace(their_base, base.to_str().unwrap());
    std::fs::write(overlay.join("kustomization.yaml"), yaml).unwrap();
    let picked = render(tools, &overlay);
    let problems = schema_problems(&picked);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert_eq!(
        picks(&picked),
        (
            BTreeSet::from(["registry.example.com/ml/zerotrain:0.1.0".to_string()]),
            3,
            4
        )
    );
}

/// Whether `selector`'s matchLabels all hold in `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let wanted = selector["matchLabels"].as_object().expect("matchLabels");
    !wanted.is_empty() && wanted.iter().all(|(k, v)| &labels[k] == v)
}

fn pod_labels(workload: &Value) -> &Value {
    &workload["spec"]["template"]["metadata"]["labels"]
}

fn container_port(c: &Value, name: &str) -> u64 {
    c["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("{}: no port named {name}", c["name"]))["containerPort"]
        .as_u64()
        .unwrap()
}

/// Whether `path` lies under one of the container's volume mounts (their root filesystems are
/// read-only, so every directory they write or read must).
fn mounted(c: &Value, path: &str) -> bool {
    c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|m| Path::new(path).starts_with(m["mountPath"].as_str().unwrap()))
}

/// docs/operations.md's "On Kubernetes" section.
fn docs_section() -> String {
    let docs = std::fs::read_to_string(root().join("docs/operations.md")).unwrap();
    let start = docs
        .find("\n## On Kubernetes\n")
        .expect("docs/operations.md has an \"On Kubernetes\" section");
    let rest = &docs[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 4);
    rest[..end].to_string()
}

#[test]
fn the_manifests_agree_with_each_other_with_the_dashboard_and_with_the_docs() {
    let Some(r) = base() else { return };
    let server = r.object("Deployment", "zerotrain-server");
    let agent = r.object("DaemonSet", "zerotrain-agent");
    let service = r.object("Service", "zerotrain");
    let (sc, ac) = (containers(server)[0], containers(agent)[0]);
    let (sargs, aargs) = (strings(&sc["args"]), strings(&ac["args"]));

    // The Service reaches the server's pods at the port it listens on, and agents reach the
    // Service.
    assert!(selects(
        &serde_json::json!({"matchLabels": service["spec"]["selector"]}),
        pod_labels(server)
    ));
    assert!(!selects(
        &serde_json::json!({"matchLabels": service["spec"]["selector"]}),
        pod_labels(agent)
    ));
    let port = &service["spec"]["ports"][0];
    let http = container_port(sc, port["targetPort"].as_str().unwrap());
    assert_eq!(flag(&sargs, "port"), [http.to_string()]);
    assert_eq!(flag(&sargs, "listen"), ["0.0.0.0"]);
    let url = format!(
        "http://{}:{}",
        service["metadata"]["name"].as_str().unwrap(),
        port["port"]
    );
    assert_eq!(flag(&aargs, "server"), [url]);

    // The agent's metrics: where it listens, its named port, the scrape annotations.
    let metrics = container_port(ac, "metrics");
    assert_eq!(flag(&aargs, "metrics-addr"), [format!("0.0.0.0:{metrics}")]);
    let annotations = &agent["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], metrics.to_string());
    assert_eq!(annotations["prometheus.io/path"], "/metrics");

    // The PodMonitors select their pods and name ports those pods have; the server's sends a
    // token and keeps the training series' `job` label.
    for (monitor, workload, c) in [
        ("zerotrain-server", server, sc),
        ("zerotrain-agents", agent, ac),
    ] {
        let m = r.object("PodMonitor", monitor);
        assert!(
            selects(&m["spec"]["selector"], pod_labels(workload)),
            "{monitor}"
        );
        for endpoint in m["spec"]["podMetricsEndpoints"].as_array().unwrap() {
            container_port(c, endpoint["port"].as_str().unwrap());
            assert_eq!(endpoint["path"], "/metrics");
        }
    }
    let endpoint = &r.object("PodMonitor", "zerotrain-server")["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["honorLabels"], true);
    assert_eq!(endpoint["authorization"]["type"], "Bearer");

    // The agents: on GPU nodes, holding GPUs, reachable by each other on every port.
    let pod = &agent["spec"]["template"]["spec"];
    assert!(!pod["nodeSelector"].as_object().unwrap().is_empty());
    assert!(ac["resources"]["limits"]["nvidia.com/gpu"].is_number());
    let policy = r.object("NetworkPolicy", "zerotrain-agents");
    assert!(selects(&policy["spec"]["podSelector"], pod_labels(agent)));
    let from_agents = policy["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .find(|rule| {
            rule["from"].as_array().is_some_and(|f| {
                f.iter()
                    .any(|p| selects(&p["podSelector"], pod_labels(agent)))
            })
        })
        .expect("an ingress rule from the agents");
    assert!(
        from_agents["ports"].is_null(),
        "agents reach each other on every port"
    );

    // What the containers read and write lies on their volumes.
    for (c, args) in [(sc, &sargs), (ac, &aargs)] {
        let mut paths: Vec<&str> = ["data-dir", "data-root", "work-dir"]
            .iter()
            .flat_map(|f| flag(args, f))
            .collect();
        let cache = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "ZEROTRAIN_KERNEL_CACHE");
        paths.extend(cache.map(|e| e["value"].as_str().unwrap()));
        assert!(paths.len() >= 2, "{paths:?}");
        for p in paths {
            assert!(mounted(c, p), "{}: {p} is on no volume", c["name"]);
        }
    }
    // The server refuses submissions naming files outside its roots: they are the agents'.
    assert_eq!(flag(&sargs, "data-root"), flag(&aargs, "data-root"));

    // The dashboard is generated from deploy/grafana, not copied.
    let dashboard = r.object("ConfigMap", "zerotrain-grafana-dashboard");
    let json = std::fs::read_to_string(root().join("deploy/grafana/zerotrain.json")).unwrap();
    assert_eq!(dashboard["data"]["zerotrain.json"], json.as_str());
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let copies: Vec<_> = std::fs::read_dir(base_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    assert!(copies.is_empty(), "{copies:?}");

    // Every Secret the objects need is one docs/operations.md says how to create, with the
    // key they read; the section says the manifests never ran on a cluster.
    let docs = docs_section();
    let mut secrets: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for c in [sc, ac] {
        for e in c["env"].as_array().unwrap() {
            let s = &e["valueFrom"]["secretKeyRef"];
            if let Some(name) = s["name"].as_str() {
                secrets
                    .entry(name.into())
                    .or_default()
                    .insert(s["key"].as_str().unwrap().into());
            }
        }
        for from in c["envFrom"].as_array().into_iter().flatten() {
            if let Some(name) = from["secretRef"]["name"].as_str() {
                secrets.entry(name.into()).or_default();
            }
        }
    }
    let credentials = &endpoint["authorization"]["credentials"];
    secrets
        .entry(credentials["name"].as_str().unwrap().into())
        .or_default()
        .insert(credentials["key"].as_str().unwrap().into());
    assert_eq!(secrets.len(), 5, "{secrets:?}");
    for (name, keys) in &secrets {
        assert!(
            docs.contains(&format!("create secret generic {name} ")),
            "docs/operations.md does not say how to create the Secret {name}"
        );
        for key in keys {
            assert!(
                docs.contains(&format!("--from-literal={key}=")),
                "docs/operations.md does not create the key {key} of {name}"
            );
        }
    }
    assert!(
        docs.contains("never been applied to a real cluster"),
        "{docs}"
    );
}
