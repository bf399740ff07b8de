//! `zerotrain pull JOB [--to DIR] [--all]`: download a job's files into a folder — by default
//! the final export (`config.json` + `model.safetensors`, or for a sharded export
//! `model-KKKKK-of-NNNNN.safetensors` + `model.safetensors.index.json`), which `transformers`'
//! `from_pretrained(DIR)` loads as it is; for a LoRA job its adapter (`adapter_config.json` +
//! `adapter_model.safetensors`), which PEFT's `PeftModel.from_pretrained(base, DIR)` loads,
//! and the merged model under `merged/`. Each file streams into `.NAME.part` beside its place,
//! hashed on the way, and is renamed into place only once its size and SHA-256 match the
//! server's listing; an interrupted pull leaves the part, and the next one asks for the rest.

use std::path::{Component, Path, PathBuf};

use anyhow::{Context, bail};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use reqwest::{Method, StatusCode, header};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt, BufWriter};
use wire::artifact::{
    ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE, Artifact, CONFIG_FILE, INDEX_FILE, MERGED_CONFIG_FILE,
    MERGED_MODEL_FILE, MODEL_FILE, shard_file, url_segment,
};

use crate::client::{Client, Connection, check_id};

#[derive(clap::Args)]
pub struct Args {
    /// The job's id.
    job: String,
    /// The folder to write into (created if missing) [default: ./JOB].
    #[arg(long, value_name = "DIR")]
    to: Option<PathBuf>,
    /// Every file the job has, checkpoints included, each in the subfolder its name says;
    /// what is there is enough (a job that has not succeeded has checkpoints but no model).
    #[arg(long)]
    all: bool,
    #[command(flatten)]
    conn: Connection,
}

/// One file of a job, as the server lists it.
#[derive(Debug, Clone, Deserialize)]
struct Listed {
    name: String,
    bytes: u64,
    sha256: String,
}

#[derive(Deserialize)]
struct Listing {
    artifacts: Vec<Listed>,
}

/// What was written, for the summary.
#[derive(Debug)]
struct Pulled {
    name: String,
    bytes: u64,
    sha256: String,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let id = check_id(&args.job)?;
    let dir = args.to.clone().unwrap_or_else(|| Path::new(".").join(id));
    let client = Client::new(&args.conn)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let pulled = runtime.block_on(async {
        let listing: Listing = client
            .json(client.request(Method::GET, &format!("/v1/jobs/{id}/artifacts")))
            .await?;
        let wanted = select(id, &listing.artifacts, args.all)?;
        // Every name is checked before anything is written.
        let targets = wanted
            .iter()
            .map(|a| Ok(((*a).clone(), local_path(&dir, &a.name)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        tokio::fs::create_dir_all(&dir)
            .await
            .with_context(|| format!("creating {}", dir.display()))?;
        let mut pulled = Vec::with_capacity(targets.len());
        for (a, path) in &targets {
            pulled.push(download(&client, id, a, path).await?);
        }
        anyhow::Ok(pulled)
    })?;
    for p in &pulled {
        println!("{}  {}  sha256:{}", p.name, p.bytes, p.sha256);
    }
    println!("{}", dir.display());
    Ok(())
}

/// The files to download: the export (`config.json` and the weights: `model.safetensors`, or
/// a sharded export's shards and index; a LoRA job's two adapter files and its merged model),
/// or with `all` every file the job has.
fn select<'a>(id: &str, listed: &'a [Listed], all: bool) -> anyhow::Result<Vec<&'a Listed>> {
    let has = || {
        if listed.is_empty() {
            "nothing".to_string()
        } else {
            listed
                .iter()
                .map(|a| a.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    if all {
        if listed.is_empty() {
            bail!("job {id} has no files yet");
        }
        return Ok(listed.iter().collect());
    }
    let missing = |name: &str| {
        anyhow::anyhow!(
            "job {id} has no {name} yet (it has: {}); a job's model is there once it succeeded",
            has()
        )
    };
    // A LoRA job's export is its adapter, as PEFT saves one, and its merged model: every
    // file or none.
    let lora = [
        ADAPTER_CONFIG_FILE,
        ADAPTER_MODEL_FILE,
        MERGED_CONFIG_FILE,
        MERGED_MODEL_FILE,
    ];
    let found = lora.map(|name| listed.iter().find(|a| a.name == name));
    if found.iter().any(Option::is_some) {
        return lora
            .into_iter()
            .zip(found)
            .map(|(name, found)| found.ok_or_else(|| missing(name)))
            .collect();
    }
    let config = listed
        .iter()
        .find(|a| a.name == CONFIG_FILE)
        .ok_or_else(|| missing(CONFIG_FILE))?;
    let weights: Vec<&Listed> = listed
        .iter()
        .filter(|a| Artifact::parse(&a.name).is_some_and(Artifact::is_weights))
        .collect();
    let names: Vec<&str> = weights.iter().map(|a| a.name.as_str()).collect();
    if !names.contains(&MODEL_FILE) && !names.contains(&INDEX_FILE) {
        return Err(missing(MODEL_FILE));
    }
    if let Some(absent) = absent_shard(&names) {
        bail!(
            "job {id}'s sharded model lacks {absent} (it has: {})",
            has()
        );
    }
    // By name: the shards before their index.
    Ok(std::iter::once(config).chain(weights).collect())
}

/// The first shard a sharded export of `names` (the job's weights files) lacks; `None` when
/// every shard its count calls for is there, or it is one file.
fn absent_shard(names: &[&str]) -> Option<String> {
    let shards: Vec<(u32, u32)> = names
        .iter()
        .filter_map(|n| match Artifact::parse(n) {
            Some(Artifact::Shard { index, count }) => Some((index, count)),
            _ => None,
        })
        .collect();
    if !names.contains(&INDEX_FILE) {
        return None;
    }
    let count = shards.iter().map(|&(_, n)| n).max().unwrap_or(2);
    (1..=count)
        .find(|&k| !shards.contains(&(k, count)))
        .map(|k| shard_file(k, count))
}

/// Where the file `name` goes under `dir`: refused unless it is a relative path of plain
/// components, so that no name can land outside `dir`.
fn local_path(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let plain = !name.is_empty()
        && !name.contains(['\\', '\0'])
        && name
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
        && Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        bail!("refusing the file name {name:?}: it would not land inside the folder");
    }
    Ok(dir.join(name))
}

/// `.NAME.part` beside `path`, where its bytes arrive.
fn part_path(path: &Path) -> PathBuf {
    let file = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(".{file}.part"))
}

/// What to do with the part file an interrupted pull left.
#[derive(Debug, PartialEq, Eq)]
enum Transfer {
    /// Nothing usable is there: download from the start.
    Fresh,
    /// Its first bytes are there: ask for the rest, from this offset.
    Resume(u64),
    /// The whole file is there and checks out: only the rename is left.
    Complete,
}

/// The plan for a part file of `part_bytes` bytes hashing to `part_sha256`.
fn transfer(part_bytes: u64, part_sha256: &str, want: &Listed) -> Transfer {
    if part_bytes == 0 || part_bytes > want.bytes {
        Transfer::Fresh
    } else if part_bytes < want.bytes {
        Transfer::Resume(part_bytes)
    } else if part_sha256.eq_ignore_ascii_case(&want.sha256) {
        Transfer::Complete
    } else {
        Transfer::Fresh
    }
}

/// How the body of an answer fits the part file.
#[derive(Debug, PartialEq, Eq)]
enum Body {
    /// The whole file (the server ignored the range, or none was asked): start over.
    Whole,
    /// The rest after the bytes asked from.
    Rest,
}

/// Reads the answer to a request for the bytes from `from` on (`from` 0: no range asked).
fn body_kind(status: StatusCode, content_range: Option<&str>, from: u64) -> anyhow::Result<Body> {
    match status {
        StatusCode::OK => Ok(Body::Whole),
        StatusCode::PARTIAL_CONTENT => {
            // `bytes START-END/TOTAL`; without one the final hash still catches a wrong body.
            if let Some(range) = content_range {
                let start = range
                    .strip_prefix("bytes ")
                    .and_then(|r| r.split_once('-'))
                    .and_then(|(start, _)| start.trim().parse::<u64>().ok())
                    .with_context(|| {
                        format!("the server sent a malformed Content-Range {range:?}")
                    })?;
                if start != from {
                    bail!("asked for the bytes from {from} on, the server sent them from {start}");
                }
            }
            Ok(Body::Rest)
        }
        other => bail!("unexpected answer {other} to a download"),
    }
}

/// Downloads `a` to `path` through its part file, resuming one that is there.
async fn download(client: &Client, id: &str, a: &Listed, path: &Path) -> anyhow::Result<Pulled> {
    let part = part_path(path);
    if let Some(parent) = path.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let (mut bytes, mut sha) = hash_part(&part).await?;
    let mut from = match transfer(bytes, &hex::encode(sha.clone().finalize()), a) {
        Transfer::Complete => return finish(a, &part, path, bytes, sha).await,
        Transfer::Resume(from) => from,
        Transfer::Fresh => 0,
    };
    let mut req = client.request(
        Method::GET,
        &format!("/v1/jobs/{id}/artifacts/{}", url_segment(&a.name)),
    );
    if from > 0 {
        req = req.header(header::RANGE, format!("bytes={from}-"));
    }
    let resp = client.send(req).await?;
    let content_range = resp
        .headers()
        .get(header::CONTENT_RANGE)
        .and_then(|v| v.to_str().ok());
    if body_kind(resp.status(), content_range, from)? == Body::Whole {
        (bytes, sha, from) = (0, Sha256::new(), 0);
    }
    let mut file = tokio::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&part)
        .await
        .with_context(|| format!("opening {}", part.display()))?;
    file.set_len(from).await?;
    file.seek(std::io::SeekFrom::Start(from)).await?;
    let mut out = BufWriter::new(file);

    let bar = ProgressBar::new(a.bytes)
        .with_style(
            ProgressStyle::with_template(
                "{msg} {bar:30} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .expect("a valid template"),
        )
        .with_message(a.name.clone())
        .with_position(from);
    let mut body = resp.bytes_stream();
    let streamed = async {
        while let Some(chunk) = body.next().await {
            let chunk = chunk.with_context(|| format!("downloading {}", a.name))?;
            bytes += chunk.len() as u64;
            if bytes > a.bytes {
                bail!("{} is longer than the {} bytes listed", a.name, a.bytes);
            }
            sha.update(&chunk);
            out.write_all(&chunk)
                .await
                .with_context(|| format!("writing {}", part.display()))?;
            bar.set_position(bytes);
        }
        Ok(())
    }
    .await;
    // What arrived stays in the part file, for the next pull to resume.
    let flushed = out.flush().await;
    bar.finish_and_clear();
    streamed?;
    flushed.with_context(|| format!("writing {}", part.display()))?;
    out.into_inner().sync_all().await?;
    finish(a, &part, path, bytes, sha).await
}

/// The byte count and hash state of the part file at `part` (zero when there is none).
async fn hash_part(part: &Path) -> anyhow::Result<(u64, Sha256)> {
    let (mut bytes, mut sha) = (0u64, Sha256::new());
    let mut file = match tokio::fs::File::open(part).await {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((bytes, sha)),
        Err(e) => return Err(e).with_context(|| format!("opening {}", part.display())),
    };
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .await
            .with_context(|| format!("reading {}", part.display()))?;
        if n == 0 {
            return Ok((bytes, sha));
        }
        bytes += n as u64;
        sha.update(&buf[..n]);
    }
}

/// Checks the part file against the listing and renames it into place; a part that does not
/// match is deleted.
async fn finish(
    a: &Listed,
    part: &Path,
    path: &Path,
    bytes: u64,
    sha: Sha256,
) -> anyhow::Result<Pulled> {
    let sha256 = hex::encode(sha.finalize());
    if bytes != a.bytes || !sha256.eq_ignore_ascii_case(&a.sha256) {
        let _ = tokio::fs::remove_file(part).await;
        bail!(
            "{} does not match the server's listing: got {bytes} bytes, sha256:{sha256}; \
             listed {} bytes, sha256:{} (the partial file was deleted)",
            a.name,
            a.bytes,
            a.sha256
        );
    }
    tokio::fs::rename(part, path)
        .await
        .with_context(|| format!("moving {} to {}", part.display(), path.display()))?;
    Ok(Pulled {
        name: a.name.clone(),
        bytes,
        sha256,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(selected: Vec<&Listed>) -> Vec<String> {
        selected.into_iter().map(|a| a.name.clone()).collect()
    }

    fn listed(name: &str, bytes: u64, sha256: &str) -> Listed {
        Listed {
            name: name.into(),
            bytes,
            sha256: sha256.into(),
        }
    }

    #[test]
    fn names_of_plain_components_land_inside_the_folder() {
        let dir = Path::new("out");
        assert_eq!(
            local_path(dir, "model.safetensors").unwrap(),
            dir.join("model.safetensors")
        );
        assert_eq!(
            local_path(dir, "checkpoints/step-00000020/rank-00001.safetensors").unwrap(),
            dir.join("checkpoints")
                .join("step-00000020")
                .join("rank-00001.safetensors")
        );
    }

    #[test]
    fn names_that_could_leave_the_folder_are_refused() {
        for name in [
            "",
            "/etc/passwd",
            "../model.safetensors",
            "checkpoints/../../x",
            "checkpoints/..",
            "..",
            ".",
            "./config.json",
            "checkpoints//x",
            "checkpoints/",
            "..\\x",
            "a\0b",
        ] {
            assert!(local_path(Path::new("out"), name).is_err(), "{name:?}");
        }
    }

    #[test]
    fn part_files_sit_beside_their_file_hidden() {
        assert_eq!(
            part_path(Path::new("out/checkpoints/step-00000020/manifest.json")),
            Path::new("out/checkpoints/step-00000020/.manifest.json.part")
        );
        assert_eq!(
            part_path(Path::new("out/model.safetensors")),
            Path::new("out/.model.safetensors.part")
        );
    }

    #[test]
    fn a_short_part_resumes_from_its_length() {
        let want = listed("model.safetensors", 100, "ab");
        assert_eq!(transfer(40, "ignored", &want), Transfer::Resume(40));
        assert_eq!(transfer(99, "ignored", &want), Transfer::Resume(99));
    }

    #[test]
    fn no_part_an_empty_one_or_a_too_long_one_starts_over() {
        let want = listed("model.safetensors", 100, "ab");
        assert_eq!(transfer(0, "", &want), Transfer::Fresh);
        assert_eq!(transfer(101, "ab", &want), Transfer::Fresh);
    }

    #[test]
    fn a_full_part_is_kept_only_if_its_hash_matches() {
        let want = listed("model.safetensors", 100, "ABCD");
        assert_eq!(transfer(100, "abcd", &want), Transfer::Complete);
        assert_eq!(transfer(100, "abce", &want), Transfer::Fresh);
    }

    #[test]
    fn a_200_to_a_range_request_starts_over_and_a_206_continues() {
        assert_eq!(body_kind(StatusCode::OK, None, 40).unwrap(), Body::Whole);
        assert_eq!(
            body_kind(StatusCode::PARTIAL_CONTENT, Some("bytes 40-99/100"), 40).unwrap(),
            Body::Rest
        );
        assert_eq!(
            body_kind(StatusCode::PARTIAL_CONTENT, None, 40).unwrap(),
            Body::Rest
        );
    }

    #[test]
    fn a_206_from_the_wrong_offset_is_an_error() {
        assert!(body_kind(StatusCode::PARTIAL_CONTENT, Some("bytes 0-99/100"), 40).is_err());
        assert!(body_kind(StatusCode::PARTIAL_CONTENT, Some("items 40-99"), 40).is_err());
        assert!(body_kind(StatusCode::NO_CONTENT, None, 0).is_err());
    }

    #[test]
    fn the_export_is_selected_and_a_missing_model_names_what_the_job_has() {
        let all = [
            listed("config.json", 1, "a"),
            listed("model.safetensors", 2, "b"),
            listed("checkpoints/step-00000020/manifest.json", 3, "c"),
        ];
        assert_eq!(
            names(select("j1", &all, false).unwrap()),
            ["config.json", "model.safetensors"]
        );
        assert_eq!(names(select("j1", &all, true).unwrap()).len(), 3);

        let e = select("j1", &[all[0].clone(), all[2].clone()], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("job j1 has no model.safetensors yet"), "{e}");
        assert!(
            e.contains("config.json, checkpoints/step-00000020/manifest.json"),
            "{e}"
        );
        let e = select("j1", &[], false).unwrap_err().to_string();
        assert!(
            e.contains("has no config.json yet (it has: nothing)"),
            "{e}"
        );
        assert!(select("j1", &[], true).is_err());
    }

    #[test]
    fn a_lora_job_s_export_is_its_adapter_and_merged_model_and_a_missing_file_is_named() {
        let all = [
            listed("adapter_model.safetensors", 2, "b"),
            listed("adapter_config.json", 1, "a"),
            listed("merged/config.json", 1, "d"),
            listed("merged/model.safetensors", 4, "e"),
            listed("checkpoints/step-00000020/manifest.json", 3, "c"),
        ];
        assert_eq!(
            names(select("j1", &all, false).unwrap()),
            [
                "adapter_config.json",
                "adapter_model.safetensors",
                "merged/config.json",
                "merged/model.safetensors"
            ]
        );
        let e = select("j1", &all[1..], false).unwrap_err().to_string();
        assert!(
            e.contains("job j1 has no adapter_model.safetensors yet"),
            "{e}"
        );
    }

    #[test]
    fn a_sharded_export_is_selected_whole_its_index_last_and_a_missing_shard_is_named() {
        let all = [
            listed("checkpoints/step-00000020/manifest.json", 3, "c"),
            listed("config.json", 1, "a"),
            listed("model-00001-of-00002.safetensors", 2, "b"),
            listed("model-00002-of-00002.safetensors", 2, "d"),
            listed("model.safetensors.index.json", 2, "e"),
        ];
        assert_eq!(
            names(select("j1", &all, false).unwrap()),
            [
                "config.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "model.safetensors.index.json"
            ]
        );
        let without_second = [&all[..3], &all[4..]].concat();
        let e = select("j1", &without_second, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("job j1's sharded model lacks model-00002-of-00002.safetensors"),
            "{e}"
        );
        // Shards without their index are no model yet.
        let e = select("j1", &all[..4], false).unwrap_err().to_string();
        assert!(e.contains("job j1 has no model.safetensors yet"), "{e}");
    }

    /// A stand-in for the server's download route: serves `file` at
    /// `/v1/jobs/ab12/artifacts/SEGMENT`, honouring `Range: bytes=N-` when `ranges`, and
    /// records each request's range header.
    async fn stub(
        segment: &'static str,
        file: Vec<u8>,
        ranges: bool,
    ) -> (
        Client,
        std::sync::Arc<std::sync::Mutex<Vec<Option<String>>>>,
    ) {
        use axum::http::{HeaderMap, StatusCode as S, Uri};
        use axum::response::IntoResponse;
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap| {
            let (file, log) = (file.clone(), log.clone());
            async move {
                if uri.path() != format!("/v1/jobs/ab12/artifacts/{segment}") {
                    return S::NOT_FOUND.into_response();
                }
                let range = headers
                    .get(header::RANGE)
                    .map(|v| v.to_str().unwrap().to_string());
                log.lock().unwrap().push(range.clone());
                match range.filter(|_| ranges) {
                    Some(r) => {
                        let from: usize = r["bytes=".len()..r.len() - 1].parse().unwrap();
                        let end = file.len() - 1;
                        (
                            S::PARTIAL_CONTENT,
                            [(
                                header::CONTENT_RANGE,
                                format!("bytes {from}-{end}/{}", file.len()),
                            )],
                            file[from..].to_vec(),
                        )
                            .into_response()
                    }
                    None => file.into_response(),
                }
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let conn = Connection {
            url,
            token: Some("t".into()),
        };
        (Client::new(&conn).unwrap(), seen)
    }

    fn file_of(len: usize) -> (Vec<u8>, String) {
        let file: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let sha = hex::encode(Sha256::digest(&file));
        (file, sha)
    }

    #[tokio::test]
    async fn an_interrupted_pull_resumes_with_a_range_and_lands_in_place() {
        let (file, sha) = file_of(300_000);
        for ranges in [true, false] {
            let (client, seen) = stub("checkpoints%2Fx%2Fa.bin", file.clone(), ranges).await;
            let dir = tempfile::tempdir().unwrap();
            let a = listed("checkpoints/x/a.bin", file.len() as u64, &sha);
            let path = local_path(dir.path(), &a.name).unwrap();
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(part_path(&path), &file[..123_456]).unwrap();

            let got = download(&client, "ab12", &a, &path).await.unwrap();

            assert_eq!(
                seen.lock().unwrap().as_slice(),
                [Some("bytes=123456-".into())]
            );
            assert_eq!((got.bytes, got.sha256), (file.len() as u64, sha.clone()));
            assert_eq!(
                std::fs::read(&path).unwrap(),
                file,
                "ranges honoured: {ranges}"
            );
            assert!(!part_path(&path).exists());
        }
    }

    #[tokio::test]
    async fn a_download_that_does_not_match_the_listing_is_deleted() {
        let (file, _) = file_of(1000);
        let (client, _) = stub("model.safetensors", file.clone(), true).await;
        let dir = tempfile::tempdir().unwrap();
        let a = listed("model.safetensors", 1000, &"0".repeat(64));
        let path = local_path(dir.path(), &a.name).unwrap();

        let e = download(&client, "ab12", &a, &path)
            .await
            .unwrap_err()
            .to_string();

        assert!(e.contains("got 1000 bytes"), "{e}");
        assert!(e.contains(&format!("sha256:{}", "0".repeat(64))), "{e}");
        assert!(!path.exists() && !part_path(&path).exists());
    }
}
