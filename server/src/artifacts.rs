//! A job's files in the store the server owns (`object_store`: a local directory,
//! `<data dir>/artifacts` by default, or S3 and S3-compatible stores). Agents upload each file
//! as it is written — every rank its own file of a checkpoint, rank 0 the manifest and the
//! final export — under `jobs/ID/attempts/N/NAME`, so no two attempts write the same object,
//! and the store records each upload's size and SHA-256. What a job *has* is decided from those records: the files
//! of its committed checkpoints (complete: the manifest and one file per rank, reported by
//! rank 0 after all were uploaded) and the export of the attempt that succeeded. A node that
//! dies loses nothing committed, and a job resumes on any node from here.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use futures::{Stream, StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path as Key;
use object_store::prefix::PrefixStore;
use object_store::{GetOptions, GetRange, ObjectStore, WriteMultipart};
use sha2::{Digest, Sha256};
use wire::artifact::Artifact;

use crate::domain::{Job, JobId, JobState};
use crate::settings::S3Options;
use crate::state::App;
use crate::store::{ArtifactRecord, CheckpointRecord, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("artifact store: {0}")]
    Store(#[from] object_store::Error),
    #[error("reading the upload: {0}")]
    Body(String),
    #[error("cannot create the artifact directory {path}: {source}")]
    Dir {
        path: String,
        source: std::io::Error,
    },
}

/// Where artifacts live.
#[derive(Debug, Clone)]
pub struct Artifacts {
    store: Arc<dyn ObjectStore>,
}

/// What an upload wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub bytes: u64,
    pub sha256: String,
}

impl Artifacts {
    /// The store at `location`: `s3://bucket/prefix`, configured by `s3`, or a directory.
    pub fn open(location: &str, s3: &S3Options) -> Result<Artifacts, ArtifactError> {
        let Some(rest) = location.strip_prefix("s3://") else {
            return Artifacts::local(Path::new(location));
        };
        let mut builder = AmazonS3Builder::new();
        for (key, value) in &s3.0 {
            if let Ok(key) = key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                builder = builder.with_config(key, value);
            }
        }
        let bucket = builder.with_url(location).build()?;
        let prefix = rest
            .split_once('/')
            .map_or("", |(_, p)| p.trim_matches('/'));
        let store: Arc<dyn ObjectStore> = if prefix.is_empty() {
            Arc::new(bucket)
        } else {
            Arc::new(PrefixStore::new(bucket, prefix))
        };
        Ok(Artifacts { store })
    }

    /// A local directory (created if missing).
    pub fn local(dir: &Path) -> Result<Artifacts, ArtifactError> {
        std::fs::create_dir_all(dir).map_err(|source| ArtifactError::Dir {
            path: dir.display().to_string(),
            source,
        })?;
        Ok(Artifacts {
            store: Arc::new(LocalFileSystem::new_with_prefix(dir)?),
        })
    }

    /// Streams `body` into the object of `name` by `attempt` of `job_id`, hashing it on the
    /// way; the object appears only once complete (a failed upload leaves none).
    pub async fn put<E: std::fmt::Display>(
        &self,
        job_id: &JobId,
        attempt: u32,
        name: &str,
        body: impl Stream<Item = Result<axum::body::Bytes, E>> + Unpin,
    ) -> Result<Written, ArtifactError> {
        let key = key(job_id, attempt, name);
        let upload = self
            .store
            .put_multipart_opts(&key, Default::default())
            .await?;
        let mut out = WriteMultipart::new(upload);
        let (mut bytes, mut sha) = (0u64, Sha256::new());
        let mut body = body;
        while let Some(chunk) = body.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    out.abort().await?;
                    return Err(ArtifactError::Body(e.to_string()));
                }
            };
            bytes += chunk.len() as u64;
            sha.update(&chunk);
            out.write(&chunk);
        }
        out.finish().await?;
        Ok(Written {
            bytes,
            sha256: hex::encode(sha.finalize()),
        })
    }

    /// The bytes of `a` (those in `range`, when given), as a stream.
    pub async fn get(
        &self,
        job_id: &JobId,
        a: &ArtifactRecord,
        range: Option<Range<u64>>,
    ) -> Result<impl Stream<Item = Result<axum::body::Bytes, ArtifactError>> + use<>, ArtifactError>
    {
        let options = GetOptions {
            range: range.map(GetRange::Bounded),
            ..Default::default()
        };
        let got = self
            .store
            .get_opts(&key(job_id, a.attempt, &a.name), options)
            .await?;
        Ok(got.into_stream().map_err(ArtifactError::from))
    }

    /// Removes every object of `job_id` that `keep` does not hold; how many went.
    pub async fn remove(
        &self,
        job_id: &JobId,
        keep: impl Fn(&str) -> bool,
    ) -> Result<usize, ArtifactError> {
        let prefix = Key::from(format!("jobs/{job_id}"));
        let doomed: Vec<Key> = self
            .store
            .list(Some(&prefix))
            .map_ok(|meta| meta.location)
            .try_filter(|k| std::future::ready(!keep(k.as_ref())))
            .try_collect()
            .await?;
        let n = doomed.len();
        let stream = futures::stream::iter(doomed.into_iter().map(Ok)).boxed();
        self.store
            .delete_stream(stream)
            .try_collect::<Vec<_>>()
            .await?;
        Ok(n)
    }
}

/// The object of `name` by `attempt` of `job_id`.
pub fn key(job_id: &JobId, attempt: u32, name: &str) -> Key {
    Key::from(format!("jobs/{job_id}/attempts/{attempt}/{name}"))
}

/// The files `job` has, as [`listed`] decides from the store's records.
pub async fn of_job(app: &App, job: &Job) -> Result<Vec<ArtifactRecord>, StoreError> {
    Ok(listed(
        job,
        &app.store.artifacts(&job.id).await?,
        &app.store.checkpoints(&job.id).await?,
    ))
}

/// The files `job` has: those of its committed checkpoints and, once it succeeded, its
/// export; one per name, the newest attempt's, in name order.
fn listed(
    job: &Job,
    uploads: &[ArtifactRecord],
    committed: &[CheckpointRecord],
) -> Vec<ArtifactRecord> {
    let mut out: std::collections::BTreeMap<&str, &ArtifactRecord> = Default::default();
    for a in uploads {
        let counts = match Artifact::parse(&a.name).map(Artifact::step) {
            Some(Some(step)) => committed
                .iter()
                .any(|c| (c.attempt, c.step) == (a.attempt, step)),
            Some(None) => job.state == JobState::Succeeded && a.attempt == job.attempt,
            None => false,
        };
        if counts
            && out
                .get(a.name.as_str())
                .is_none_or(|o| o.attempt < a.attempt)
        {
            out.insert(&a.name, a);
        }
    }
    out.into_values().cloned().collect()
}

/// The first file of the checkpoint of `step` by `attempt` with `world_size` ranks that
/// `uploads` lack; `None` when it is complete.
pub fn missing_from_checkpoint(
    uploads: &[ArtifactRecord],
    attempt: u32,
    step: u32,
    world_size: usize,
) -> Option<String> {
    Artifact::checkpoint(step, world_size)
        .map(Artifact::name)
        .find(|name| {
            !uploads
                .iter()
                .any(|a| a.attempt == attempt && &a.name == name)
        })
}
