//! The Python environment `scripts/pyenv` makes (pinned packages from PyPI, the client
//! installed from this checkout), for tests that run Python.

/// The environment's interpreter, made or brought up to date first.
pub fn interpreter() -> String {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let pyenv = std::process::Command::new(format!("{root}/scripts/pyenv"))
        .output()
        .unwrap();
    assert!(
        pyenv.status.success(),
        "scripts/pyenv: {}",
        String::from_utf8_lossy(&pyenv.stderr)
    );
    String::from_utf8(pyenv.stdout).unwrap().trim().to_string()
}
