//! What the client commands share: where the server is and the token (`--url`/`--token`, else
//! `ZEROTRAIN_URL`/`ZEROTRAIN_TOKEN`, else loopback and the admin token `serve`/`up` wrote to
//! the data directory), requests whose problems become readable errors, and a reader of
//! server-sent events.

use anyhow::{Context, anyhow, bail};
use futures::{Stream, StreamExt};
use reqwest::{Method, RequestBuilder, Response};
use scheduler::FieldError;
use serde::de::DeserializeOwned;

use server::settings::default_data_dir;

#[derive(clap::Args, Clone)]
pub struct Connection {
    /// The server's URL.
    #[arg(long, env = "ZEROTRAIN_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Bearer token [default: the admin token `serve`/`up` wrote to the data directory,
    /// ZEROTRAIN_DATA_DIR or ~/.local/share/zerotrain].
    #[arg(long, env = "ZEROTRAIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

pub struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

impl Client {
    pub fn new(c: &Connection) -> anyhow::Result<Client> {
        let token = match &c.token {
            Some(t) => t.clone(),
            None => {
                // Where the server on this machine keeps it: ZEROTRAIN_DATA_DIR or the default.
                let dir = std::env::var_os("ZEROTRAIN_DATA_DIR")
                    .map_or_else(default_data_dir, Into::into);
                let path = dir.join("admin-token");
                std::fs::read_to_string(&path)
                    .map(|t| t.trim().to_string())
                    .with_context(|| {
                        format!(
                            "no token: pass --token, set ZEROTRAIN_TOKEN, or run the server here \
                             so {} exists",
                            path.display()
                        )
                    })?
            }
        };
        Ok(Client {
            http: reqwest::Client::new(),
            base: c.url.trim_end_matches('/').to_string(),
            token,
        })
    }

    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
    }

    /// Sends `req`; a non-2xx answer becomes an error carrying the problem's detail.
    pub async fn send(&self, req: RequestBuilder) -> anyhow::Result<Response> {
        let resp = req
            .send()
            .await
            .with_context(|| format!("cannot reach the server at {}", self.base))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        Err(match serde_json::from_str::<serde_json::Value>(&body) {
            // A spec's mistakes, which the CLI prints one per line.
            Ok(p) if p["errors"].is_array() => {
                match serde_json::from_value::<Vec<FieldError>>(p["errors"].clone()) {
                    Ok(errors) if !errors.is_empty() => {
                        anyhow::Error::new(scheduler::Error::InvalidSpec(errors))
                    }
                    _ => anyhow!("{status}: {body}"),
                }
            }
            Ok(p) if p.get("detail").is_some() => {
                let title = p["title"].as_str().unwrap_or("error");
                let detail = p["detail"].as_str().unwrap_or_default();
                anyhow!("{title} ({}): {detail}", status.as_u16())
            }
            _ => anyhow!("{status}: {body}"),
        })
    }

    pub async fn json<T: DeserializeOwned>(&self, req: RequestBuilder) -> anyhow::Result<T> {
        let resp = self.send(req).await?;
        resp.json().await.context("reading the server's answer")
    }

    /// The server-sent events of `GET path`.
    pub async fn events(
        &self,
        path: &str,
    ) -> anyhow::Result<impl Stream<Item = anyhow::Result<SseEvent>> + use<>> {
        let resp = self
            .send(
                self.request(Method::GET, path)
                    .header("accept", "text/event-stream"),
            )
            .await?;
        let bytes = resp.bytes_stream();
        let parser = SseParser::default();
        Ok(futures::stream::unfold(
            (bytes, parser),
            |(mut bytes, mut parser)| async move {
                loop {
                    if let Some(event) = parser.next_event() {
                        return Some((Ok(event), (bytes, parser)));
                    }
                    match bytes.next().await {
                        Some(Ok(chunk)) => parser.push(&chunk),
                        Some(Err(e)) => {
                            return Some((Err(anyhow!("event stream: {e}")), (bytes, parser)));
                        }
                        None => return None,
                    }
                }
            },
        ))
    }
}

/// Splits a `text/event-stream` into events (comments and `id`/`retry` fields are skipped).
#[derive(Default)]
struct SseParser {
    buffer: String,
}

impl SseParser {
    fn push(&mut self, chunk: &[u8]) {
        self.buffer
            .push_str(&String::from_utf8_lossy(chunk).replace("\r\n", "\n"));
    }

    fn next_event(&mut self) -> Option<SseEvent> {
        loop {
            let end = self.buffer.find("\n\n")?;
            let block: String = self.buffer.drain(..end + 2).collect();
            let mut event = SseEvent::default();
            let mut data = Vec::new();
            for line in block.lines() {
                let (field, value) = line.split_once(':').unwrap_or((line, ""));
                let value = value.strip_prefix(' ').unwrap_or(value);
                match field {
                    "event" => event.event = value.to_string(),
                    "data" => data.push(value),
                    _ => {}
                }
            }
            if !data.is_empty() {
                event.data = data.join("\n");
                if event.event.is_empty() {
                    event.event = "message".into();
                }
                return Some(event);
            }
        }
    }
}

/// Refuses what cannot be a job id, so that it never becomes part of a URL path.
pub fn check_id(id: &str) -> anyhow::Result<&str> {
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
        bail!("{id:?} is not a job id");
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_are_reassembled() {
        let mut p = SseParser::default();
        p.push(b": keep-alive\n\nevent: step\ndata: {\"a\"");
        assert_eq!(p.next_event(), None);
        p.push(b":1}\n\ndata: x\r\ndata: y\r\n\r\n");
        assert_eq!(
            p.next_event(),
            Some(SseEvent {
                event: "step".into(),
                data: "{\"a\":1}".into()
            })
        );
        assert_eq!(
            p.next_event(),
            Some(SseEvent {
                event: "message".into(),
                data: "x\ny".into()
            })
        );
        assert_eq!(p.next_event(), None);
    }
}
