//! Nodes as `scontrol show node -o` prints them: one line a node of `Key=Value` fields,
//! where a value may hold spaces (`OS=Linux 6.1.0-18-amd64 #1 SMP …`), so a field runs until
//! the next word that starts with a key and `=`. Fields zerotrain does not read are skipped;
//! fields a Slurm version adds or drops do not matter unless they are the ones read here.

use std::collections::HashMap;

/// One node of the cluster, with what zerotrain reads of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmNode {
    pub name: String,
    /// Where other nodes reach it (`NodeAddr`).
    pub addr: String,
    /// CPUs Slurm schedules on it (`CPUTot`).
    pub cpus: usize,
    /// Memory a job may use on it (`RealMemory`, MiB in Slurm's output).
    pub memory_bytes: u64,
    /// Its GPU GRES, one entry per type.
    pub gpus: Vec<Gres>,
    /// Slurm's state words (`IDLE`, `MIXED`, `DOWN*`, `IDLE+DRAIN`, …).
    pub state: String,
    pub partitions: Vec<String>,
}

/// GPUs of one type on a node: `gpu:h100:8` is type `h100`, count 8; `gpu:2` has no type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gres {
    pub kind: Option<String>,
    pub count: usize,
}

impl SlurmNode {
    /// Whether Slurm would start a job on it: not down, drained, failed or not responding
    /// (`NOT_RESPONDING`, or sinfo's `*` mark).
    pub fn usable(&self) -> bool {
        !self.state.ends_with('*')
            && !self.state.split('+').any(|word| {
                matches!(
                    word,
                    "DOWN"
                        | "DRAIN"
                        | "DRAINED"
                        | "DRAINING"
                        | "FAIL"
                        | "FAILING"
                        | "FUTURE"
                        | "NOT_RESPONDING"
                        | "POWERED_DOWN"
                        | "POWERING_DOWN"
                        | "REBOOT_REQUESTED"
                        | "UNKNOWN"
                )
            })
    }

    /// Whether it belongs to `partition`.
    pub fn in_partition(&self, partition: &str) -> bool {
        self.partitions.iter().any(|p| p == partition)
    }
}

/// Every node in `text`, the output of `scontrol show node -o`; an error names the line and
/// the field it could not read.
pub fn parse_nodes(text: &str) -> Result<Vec<SlurmNode>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| node(line).map_err(|e| format!("line {}: {e}", i + 1)))
        .collect()
}

fn node(line: &str) -> Result<SlurmNode, String> {
    let fields = fields(line);
    let get = |key: &str| {
        fields
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| format!("no {key}"))
    };
    let number = |key: &str| {
        let v = get(key)?;
        v.parse::<u64>()
            .map_err(|_| format!("{key}={v} is not a number"))
    };
    let name = get("NodeName")?.to_owned();
    let gpus = match fields.get("Gres").map(String::as_str) {
        None | Some("(null)") | Some("") => Vec::new(),
        Some(g) => gres(g).map_err(|e| format!("node {name}: Gres={g}: {e}"))?,
    };
    let partitions = match fields.get("Partitions").map(String::as_str) {
        None | Some("(null)") | Some("") => Vec::new(),
        Some(p) => p.split(',').map(str::to_owned).collect(),
    };
    Ok(SlurmNode {
        addr: get("NodeAddr")?.to_owned(),
        cpus: number("CPUTot")? as usize,
        memory_bytes: number("RealMemory")? << 20,
        gpus,
        state: get("State")?.to_owned(),
        partitions,
        name,
    })
}

/// The line's fields by key. A word starts a field when it begins with a key (letters, digits
/// and `_`, led by a letter) and `=`; any other word continues the value before it.
fn fields(line: &str) -> HashMap<&str, String> {
    let mut out: HashMap<&str, String> = HashMap::new();
    let mut last: Option<&str> = None;
    for word in line.split_whitespace() {
        let key = word.split_once('=').map(|(k, _)| k).filter(|k| {
            k.starts_with(|c: char| c.is_ascii_alphabetic())
                && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
        match (key, last) {
            (Some(k), _) => {
                out.insert(k, word[k.len() + 1..].to_owned());
                last = Some(k);
            }
            (None, Some(k)) => {
                let v = out.get_mut(k).expect("the field was inserted");
                v.push(' ');
                v.push_str(word);
            }
            (None, None) => {}
        }
    }
    out
}

/// The GPU entries of a `Gres` value: `gpu:a100:4(S:0-1),gpu:k80:2,mps:100`; other GRES are
/// left out.
fn gres(value: &str) -> Result<Vec<Gres>, String> {
    let mut out = Vec::new();
    // Entries are comma-separated, but a socket list in parentheses may hold commas too.
    let mut depth = 0usize;
    let entries = value.split(|c| {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ => {}
        }
        c == ',' && depth == 0
    });
    for entry in entries {
        let spec = entry.split('(').next().unwrap_or(entry);
        let mut parts = spec.split(':');
        if parts.next() != Some("gpu") {
            continue;
        }
        let rest: Vec<&str> = parts.collect();
        let count = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| format!("`{entry}`: {s} is not a count"))
        };
        let g = match rest.as_slice() {
            [] => Gres {
                kind: None,
                count: 1,
            },
            [n] if n.starts_with(|c: char| c.is_ascii_digit()) => Gres {
                kind: None,
                count: count(n)?,
            },
            [t] => Gres {
                kind: Some((*t).to_owned()),
                count: 1,
            },
            [t, n] => Gres {
                kind: Some((*t).to_owned()),
                count: count(n)?,
            },
            _ => return Err(format!("`{entry}` is not gpu[:type][:count]")),
        };
        out.push(g);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node line as Slurm 22.05 (Debian 12's slurm-wlm) prints it, from the tests' own
    /// cluster, with GPUs written in.
    const LINE_22_05: &str = "NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=3.54 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h100:4(S:0-1),gpu:2,mps:100 NodeAddr=127.0.0.1 NodeHostName=n1 Port=17101 Version=22.05.8 OS=Linux 6.18.44-fc-v1272 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4000 AllocMem=0 FreeMem=18819 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug,gpu  BootTime=2026-12-06T16:33:35 SlurmdStartTime=2026-12-06T17:10:35 LastBusyTime=2026-12-06T17:10:35 CfgTRES=cpu=2,mem=4000M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s";

    #[test]
    fn a_node_line_reads_with_spaces_in_values_and_several_gres() {
        let nodes = parse_nodes(LINE_22_05).unwrap();
        let n = &nodes[0];
        assert_eq!(n.name, "n1");
        assert_eq!(n.addr, "127.0.0.1");
        assert_eq!((n.cpus, n.memory_bytes), (2, 4000 << 20));
        assert_eq!(
            n.gpus,
            [
                Gres {
                    kind: Some("h100".into()),
                    count: 4
                },
                Gres {
                    kind: None,
                    count: 2
                }
            ]
        );
        assert_eq!(n.partitions, ["debug", "gpu"]);
        assert!(n.usable() && n.in_partition("gpu") && !n.in_partition("gp"));
    }

    #[test]
    fn states_that_take_no_jobs_are_not_usable() {
        let with = |state: &str| {
            let line = LINE_22_05.replace("State=IDLE", &format!("State={state}"));
            parse_nodes(&line).unwrap()[0].usable()
        };
        for ok in ["IDLE", "MIXED", "ALLOCATED", "IDLE+PLANNED", "COMPLETING"] {
            assert!(with(ok), "{ok}");
        }
        for down in [
            "DOWN",
            "DOWN*",
            "IDLE*",
            "IDLE+DRAIN",
            "MIXED+DRAIN",
            "DOWN+NOT_RESPONDING",
            "FUTURE",
        ] {
            assert!(!with(down), "{down}");
        }
    }

    #[test]
    fn a_line_without_a_field_read_here_names_it() {
        let line = LINE_22_05.replace("RealMemory=4000 ", "");
        assert_eq!(parse_nodes(&line).unwrap_err(), "line 1: no RealMemory");
        let line = LINE_22_05.replace("gpu:2,", "gpu:h100:x,");
        let err = parse_nodes(&line).unwrap_err();
        assert!(err.contains("x is not a count"), "{err}");
    }
}
