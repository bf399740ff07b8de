//! Reading a native spec block by block, so that one answer names every mistake: serde stops
//! at the first error of a document, so each top-level member is read on its own (beside a
//! stand-in model, the one required member), and within it, after each mistake, the offending
//! member is dropped and the rest read again. A block read that way (its offending members at
//! their defaults) is still range-checked, so a type error does not hide the block's other
//! mistakes. `resume_from` is read as given (a [`JobArtifact`]) and kept apart from the spec:
//! validation reads the checkpoint it names, and reports a name that is none with the rest.

use std::collections::BTreeSet;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use super::{HfConfig, JobArtifact, JobSpec, from_value};
use crate::error::{Error, FieldError, Problems};

/// What [`read`] found: the top-level members in error, and those of them read again without
/// their offending members (so their other fields can still be checked).
pub(super) struct Blocks {
    pub(super) failed: BTreeSet<String>,
    pub(super) repaired: BTreeSet<String>,
    /// `resume_from` as given, when it was read.
    pub(super) resume_from: Option<JobArtifact>,
}

/// `resume_from` alone, as given.
#[derive(Deserialize)]
struct ResumeFromDoc {
    #[serde(default)]
    resume_from: Option<JobArtifact>,
}

impl Blocks {
    /// Whether `block`'s fields were read as the user gave them (the offending ones aside).
    pub(super) fn read(&self, block: &str) -> bool {
        !self.failed.contains(block) || self.repaired.contains(block)
    }
}

/// The top-level members of `spec` that are in error, after recording every mistake found in
/// them, and the spec read from the rest (offending members, or failed members whole, left to
/// their defaults, a failed `model` replaced by a stand-in): `None` when not even that reads.
pub(super) fn read(spec: &Map<String, Value>, p: &mut Problems) -> (Blocks, Option<JobSpec>) {
    let mut failed = BTreeSet::new();
    let mut repaired = Map::new();
    if !spec.contains_key("model") {
        p.note::<()>(Err(Error::spec("model", "missing field `model`")));
        failed.insert("model".to_string());
    }
    for (key, value) in spec {
        // A config's mistakes are all read at once, each at its own field.
        if let Some(Value::Object(config)) = value.get("config").filter(|_| key == "model")
            && p.note(HfConfig::read(config.clone())).is_none()
        {
            failed.insert(key.clone());
            continue;
        }
        let (errors, read) = if key == "resume_from" {
            mistakes::<ResumeFromDoc>(json!({ "resume_from": value }))
        } else {
            let mut alone = Map::new();
            if key != "model" {
                alone.insert("model".into(), stand_in_model());
            }
            alone.insert(key.clone(), value.clone());
            mistakes::<JobSpec>(Value::Object(alone))
        };
        if !errors.is_empty() {
            failed.insert(key.clone());
            p.note::<()>(Err(Error::InvalidSpec(errors)));
            if let Some(block) = read.get(key).filter(|_| key != "model") {
                repaired.insert(key.clone(), block.clone());
            }
        }
    }
    let mut rest = spec.clone();
    rest.retain(|k, _| !failed.contains(k));
    if failed.contains("model") {
        rest.insert("model".into(), stand_in_model());
    }
    // The repaired blocks if the whole reads with them, else their defaults.
    let mut with_repaired = rest.clone();
    with_repaired.extend(repaired.clone());
    let resume_from = with_repaired.remove("resume_from");
    rest.remove("resume_from");
    let (spec, repaired) = match from_value(Value::Object(with_repaired)) {
        Ok(spec) => (Some(spec), repaired.keys().cloned().collect()),
        Err(_) => (p.note(from_value(Value::Object(rest))), BTreeSet::new()),
    };
    let mut blocks = Blocks {
        failed,
        repaired,
        resume_from: None,
    };
    if let Some(given) = resume_from.filter(|_| blocks.read("resume_from")) {
        let doc: ResumeFromDoc = serde_json::from_value(json!({ "resume_from": given }))
            .expect("resume_from read above without mistakes");
        blocks.resume_from = doc.resume_from;
    }
    (blocks, spec)
}

/// A model every block can be read beside; never validated in place of a user's.
fn stand_in_model() -> Value {
    json!({"preset": "gpt2-tiny"})
}

/// Every mistake in `doc` read as a `T`, reading it again without each offending member until
/// it reads, and `doc` without them. A mistake at the member just dropped or at a block holding
/// it ends the search: it may be the drop's consequence (a required member missing, a shape
/// left incomplete), not the user's.
fn mistakes<T: DeserializeOwned>(mut doc: Value) -> (Vec<FieldError>, Value) {
    let mut found: Vec<FieldError> = Vec::new();
    loop {
        let Err(Error::InvalidSpec(mut errors)) = from_value::<T>(doc.clone()) else {
            return (found, doc);
        };
        let e = errors.remove(0);
        if let Some(last) = found.last() {
            let dropped = member_path(&last.field);
            if dropped == e.field || dropped.starts_with(&format!("{}.", e.field)) {
                return (found, Value::Null);
            }
        }
        let removed = remove(&mut doc, &member_path(&e.field));
        found.push(e);
        if !removed {
            return (found, Value::Null);
        }
    }
}

/// The object member a field path lies in: `optimizer.betas[1]` → `optimizer.betas`.
fn member_path(field: &str) -> String {
    field.split('[').next().unwrap_or(field).to_string()
}

/// Removes the member at the dotted `path`; false if there is none.
fn remove(doc: &mut Value, path: &str) -> bool {
    let mut keys: Vec<&str> = path.split('.').collect();
    let Some(last) = keys.pop() else {
        return false;
    };
    let mut at = doc;
    for k in keys {
        match at.get_mut(k) {
            Some(v) => at = v,
            None => return false,
        }
    }
    at.as_object_mut().and_then(|m| m.remove(last)).is_some()
}
