//! `data_roots`: the directories a node's operator lets jobs read (`zerotrain agent --data-root`),
//! and the one way a job's inputs (`data.path`, its glob's matches, `model.init_from`) are
//! opened.
//!
//! A spec's path is first resolved lexically: relative to the first root, `.` and `..` folded.
//! It must then lie inside a root, and again once every symlink is resolved (`canonicalize`).
//! Only regular files are opened, without following a last symlink and without blocking (a
//! FIFO swapped in would otherwise hang the open), and the open handle is checked once more.
//! Every refusal of a path outside the roots is the same `RootsError::OutsideDataRoots`: nothing
//! about whether the file exists, its size, its bytes or what a glob matched.
//!
//! A root may not contain the service's data dir (its tokens and database): `new` refuses it.
//!
//! Here, in the crate the server and the agents share, because both enforce it: the server
//! refuses a submission whose paths lie outside its roots (`refused_input`), the agent opens
//! nothing outside its own.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use scheduler::spec::{InitFrom, JobSpec, TokenizerSource};

/// Why a data root, or a job input under the roots, was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RootsError {
    /// A data file (or glob pattern) under the data roots that cannot be used: missing,
    /// unreadable, not a regular file. `what` is the spec field and the path as the spec wrote
    /// it; the reason never quotes the file's bytes or size.
    #[error("{what}: {reason}")]
    Data { what: String, reason: String },
    /// A job input outside the data roots (or leading outside through a symlink or `..`).
    /// Says nothing else about the file: not whether it exists, nor what it holds.
    #[error("{field}: outside the data roots")]
    OutsideDataRoots { field: &'static str },
    /// A configured data root that cannot be one.
    #[error("data root {}: {reason}", root.display())]
    DataRoot { root: PathBuf, reason: String },
}

/// Where jobs may read. `anywhere()` (the default, for `zerotrain train` in a user's own
/// process) resolves any path (regular files only still); the agent always runs with roots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataRoots {
    /// `None`: any path.
    roots: Option<Vec<Root>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Root {
    /// As configured, made absolute and folded lexically: what a spec's path is compared with
    /// before symlinks are resolved.
    given: PathBuf,
    /// After symlinks: what resolved paths are compared with.
    canonical: PathBuf,
}

/// The fields of a job spec that name input files, with their values.
fn spec_inputs(spec: &JobSpec) -> Vec<(&'static str, &str)> {
    let mut inputs = Vec::new();
    if let Some(path) = spec.data.path() {
        inputs.push(("data.path", path));
    }
    if let Some(TokenizerSource::Named(path)) = spec.data.tokenizer(None) {
        inputs.push(("data.tokenizer", path));
    }
    if let Some(path) = spec.data.validation().and_then(|v| v.path.as_deref()) {
        inputs.push(("data.validation.path", path));
    }
    if let Some(path) = spec.model.init_from.as_ref().and_then(InitFrom::path) {
        inputs.push(("model.init_from", path));
    }
    if let Some(path) = spec.lora.as_ref().and_then(|l| l.init_from.as_deref()) {
        inputs.push(("lora.init_from", path));
    }
    inputs
}

impl DataRoots {
    /// Any path, as given: no roots.
    pub fn anywhere() -> DataRoots {
        DataRoots { roots: None }
    }

    /// The directories `dirs` (each must exist), none of which may contain or be one of
    /// `secrets` (the data dir with the service's tokens, its SQLite database).
    pub fn new(dirs: &[PathBuf], secrets: &[PathBuf]) -> Result<DataRoots, RootsError> {
        if dirs.is_empty() {
            return Err(RootsError::DataRoot {
                root: PathBuf::new(),
                reason: "at least one data root is needed".into(),
            });
        }
        let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
        // A secret not created yet (a database before its first start) is where it will be.
        let secrets: Vec<PathBuf> = secrets
            .iter()
            .map(|s| {
                s.canonicalize()
                    .or_else(|e| match (s.parent(), s.file_name()) {
                        (Some(dir), Some(name)) => dir.canonicalize().map(|d| d.join(name)),
                        _ => Err(e),
                    })
                    .unwrap_or_else(|_| fold(&cwd, s))
            })
            .collect();
        let roots = dirs
            .iter()
            .map(|dir| {
                let fail = |reason: String| RootsError::DataRoot {
                    root: dir.clone(),
                    reason,
                };
                let canonical = dir.canonicalize().map_err(|e| fail(e.to_string()))?;
                if !canonical.is_dir() {
                    return Err(fail("not a directory".into()));
                }
                if let Some(secret) = secrets.iter().find(|s| s.starts_with(&canonical)) {
                    return Err(fail(format!(
                        "contains {}, which holds the service's tokens or database",
                        secret.display()
                    )));
                }
                Ok(Root {
                    given: fold(&cwd, dir),
                    canonical,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(DataRoots { roots: Some(roots) })
    }

    /// A node's roots: `dirs`, or when none are given `<data_dir>/datasets`, created if
    /// missing. None may contain `data_dir` or any of `other_secrets`.
    pub fn for_data_dir(
        dirs: &[PathBuf],
        data_dir: &Path,
        other_secrets: &[PathBuf],
    ) -> Result<DataRoots, RootsError> {
        let default = [data_dir.join("datasets")];
        let dirs = if dirs.is_empty() {
            std::fs::create_dir_all(&default[0]).map_err(|e| RootsError::DataRoot {
                root: default[0].clone(),
                reason: format!("cannot create it: {e}"),
            })?;
            &default[..]
        } else {
            dirs
        };
        let mut secrets = vec![data_dir.to_path_buf()];
        secrets.extend_from_slice(other_secrets);
        DataRoots::new(dirs, &secrets)
    }

    /// The roots after symlinks, in order (none: any path).
    pub fn dirs(&self) -> Vec<&Path> {
        self.roots
            .iter()
            .flatten()
            .map(|r| r.canonical.as_path())
            .collect()
    }

    /// Whether `path` lies inside a root before symlinks are resolved: what a server can tell
    /// at submission without touching the file system of the nodes.
    pub fn admits(&self, path: &str) -> bool {
        match &self.roots {
            None => true,
            Some(roots) => {
                let lexical = fold(&roots[0].canonical, Path::new(path));
                roots
                    .iter()
                    .any(|r| lexical.starts_with(&r.given) || lexical.starts_with(&r.canonical))
            }
        }
    }

    /// `spec`'s first input field whose path `admits` refuses.
    pub fn refused_input(&self, spec: &JobSpec) -> Option<&'static str> {
        spec_inputs(spec)
            .into_iter()
            .find(|(_, path)| !self.admits(path))
            .map(|(field, _)| field)
    }

    /// The file `path` names, resolved (see the module documentation); `field` is the spec
    /// field it came from, for errors.
    pub fn resolve(&self, field: &'static str, path: &str) -> Result<PathBuf, RootsError> {
        let Some(roots) = &self.roots else {
            return Path::new(path)
                .canonicalize()
                .map_err(|e| RootsError::Data {
                    what: describe(field, path),
                    reason: format!("cannot open: {}", e.kind()),
                });
        };
        let outside = RootsError::OutsideDataRoots { field };
        if !self.admits(path) {
            return Err(outside);
        }
        let lexical = fold(&roots[0].canonical, Path::new(path));
        let inside = |p: &Path| roots.iter().any(|r| p.starts_with(&r.canonical));
        match lexical.canonicalize() {
            Ok(real) if inside(&real) => Ok(real),
            Ok(_) => Err(outside),
            // Missing is worth saying only when nothing on the way leads outside: the deepest
            // ancestor that exists resolves inside a root and is not the path itself (which
            // would then be a dangling link).
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let existing = lexical.ancestors().find(|a| a.symlink_metadata().is_ok());
                let missing_inside = existing
                    .is_some_and(|a| a != lexical && a.canonicalize().is_ok_and(|a| inside(&a)));
                if missing_inside {
                    Err(RootsError::Data {
                        what: describe(field, path),
                        reason: "no such file under the data roots".into(),
                    })
                } else {
                    Err(outside)
                }
            }
            Err(_) => Err(outside),
        }
    }

    /// `resolve`, then opens it: a regular file or an error.
    pub fn open(&self, field: &'static str, path: &str) -> Result<(PathBuf, File), RootsError> {
        let resolved = self.resolve(field, path)?;
        let file = open_regular(&resolved, &describe(field, path))?;
        Ok((resolved, file))
    }

    /// The regular files a glob pattern matches, sorted, each resolved inside the roots (a
    /// match leading outside fails the whole pattern); a pattern without wildcards is one file.
    pub fn glob(&self, field: &'static str, pattern: &str) -> Result<Vec<PathBuf>, RootsError> {
        if glob::Pattern::escape(pattern) == pattern {
            return Ok(vec![self.resolve(field, pattern)?]);
        }
        let what = describe(field, pattern);
        let fail = |reason: String| RootsError::Data {
            what: what.clone(),
            reason,
        };
        let folded = match &self.roots {
            None => PathBuf::from(pattern),
            Some(roots) => {
                if !self.admits(pattern) {
                    return Err(RootsError::OutsideDataRoots { field });
                }
                fold(&roots[0].canonical, Path::new(pattern))
            }
        };
        let folded = folded
            .to_str()
            .ok_or_else(|| fail("not valid UTF-8".into()))?;
        let entries = glob::glob(folded).map_err(|e| fail(format!("invalid glob pattern: {e}")))?;
        let mut files = Vec::new();
        for entry in entries {
            let path = entry.map_err(|_| fail("a directory it matches cannot be read".into()))?;
            let path = path
                .to_str()
                .ok_or_else(|| fail("a name it matches is not valid UTF-8".into()))?;
            let resolved = self.resolve(field, path)?;
            if resolved.symlink_metadata().is_ok_and(|m| m.is_file()) {
                files.push(resolved);
            }
        }
        if files.is_empty() {
            return Err(fail("the pattern matches no files".into()));
        }
        files.sort();
        Ok(files)
    }
}

/// How errors name an input: its spec field and the path as the spec wrote it (never what it
/// resolved to).
pub fn describe(field: &str, path: &str) -> String {
    format!("{field} {path:?}")
}

/// Opens a resolved path for reading if it is a regular file: checked before opening (no
/// FIFO or device is ever opened), opened without following a symlink put in its place and
/// without blocking, and checked again on the handle.
pub fn open_regular(path: &Path, what: &str) -> Result<File, RootsError> {
    let fail = |reason: String| RootsError::Data {
        what: what.to_string(),
        reason,
    };
    let not_regular = || fail("not a regular file".into());
    let before = path
        .symlink_metadata()
        .map_err(|e| fail(format!("cannot open: {}", e.kind())))?;
    if !before.is_file() {
        return Err(not_regular());
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| fail(format!("cannot open: {}", e.kind())))?;
    let after = file
        .metadata()
        .map_err(|e| fail(format!("cannot open: {}", e.kind())))?;
    if !after.is_file() {
        return Err(not_regular());
    }
    Ok(file)
}

/// `path` made absolute against `base` with `.` and `..` folded, never above the root.
fn fold(base: &Path, path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    let full = if path.is_absolute() {
        path.to_path_buf()
    } else {
        base.join(path)
    };
    for c in full.components() {
        match c {
            Component::Prefix(_) | Component::RootDir | Component::Normal(_) => out.push(c),
            Component::CurDir => {}
            Component::ParentDir => {
                if out.parent().is_some() {
                    out.pop();
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::fold;
    use std::path::Path;

    #[test]
    fn folding_removes_dots_and_never_climbs_above_the_root() {
        let base = Path::new("/data");
        assert_eq!(fold(base, Path::new("a/./b/../c")), Path::new("/data/a/c"));
        assert_eq!(
            fold(base, Path::new("../etc/passwd")),
            Path::new("/etc/passwd")
        );
        assert_eq!(fold(base, Path::new("/../../x")), Path::new("/x"));
        assert_eq!(fold(base, Path::new("/d/*/../../e")), Path::new("/e"));
    }
}
