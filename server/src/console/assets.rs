//! The console's static files, embedded in the binary: htmx and uPlot as vendored
//! (`assets/vendor/VENDOR.md`) and the console's own script and style sheet. Pages link them
//! as `/assets/NAME?v=HASH`, so they are cached for a year and a new build's files get new
//! URLs; the ETag answers revalidations with 304.

use std::sync::LazyLock;

use axum::extract::Path;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

struct Asset {
    name: &'static str,
    content_type: &'static str,
    bytes: &'static [u8],
}

const FILES: [Asset; 5] = [
    Asset {
        name: "htmx.min.js",
        content_type: "text/javascript; charset=utf-8",
        bytes: include_bytes!("assets/vendor/htmx.min.js"),
    },
    Asset {
        name: "uPlot.iife.min.js",
        content_type: "text/javascript; charset=utf-8",
        bytes: include_bytes!("assets/vendor/uPlot.iife.min.js"),
    },
    Asset {
        name: "uPlot.min.css",
        content_type: "text/css; charset=utf-8",
        bytes: include_bytes!("assets/vendor/uPlot.min.css"),
    },
    Asset {
        name: "console.js",
        content_type: "text/javascript; charset=utf-8",
        bytes: include_bytes!("assets/console.js"),
    },
    Asset {
        name: "console.css",
        content_type: "text/css; charset=utf-8",
        bytes: include_bytes!("assets/console.css"),
    },
];

/// Each file's SHA-256 (hex), computed once.
static HASHES: LazyLock<Vec<String>> = LazyLock::new(|| {
    FILES
        .iter()
        .map(|f| {
            Sha256::digest(f.bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        })
        .collect()
});

/// `/assets/NAME?v=HASH`: the URL pages link a file at.
pub fn url(name: &str) -> String {
    let i = FILES
        .iter()
        .position(|f| f.name == name)
        .unwrap_or_else(|| panic!("no embedded asset {name}"));
    format!("/assets/{name}?v={}", &HASHES[i][..16])
}

/// `GET /assets/{name}`.
pub async fn serve(Path(name): Path<String>, headers: HeaderMap) -> Response {
    let Some(i) = FILES.iter().position(|f| f.name == name) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let etag = format!("\"{}\"", &HASHES[i][..32]);
    let cache = [
        (
            header::CACHE_CONTROL,
            HeaderValue::from_static("public, max-age=31536000, immutable"),
        ),
        (
            header::ETAG,
            HeaderValue::from_str(&etag).expect("hex is a valid header"),
        ),
    ];
    let matches = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    if matches {
        return (StatusCode::NOT_MODIFIED, cache).into_response();
    }
    let file = &FILES[i];
    (
        cache,
        [(header::CONTENT_TYPE, file.content_type)],
        file.bytes,
    )
        .into_response()
}

/// `GET /favicon.ico`: there is none (pages say so with an empty `data:` icon).
pub async fn no_icon() -> Response {
    (
        StatusCode::NO_CONTENT,
        [(header::CACHE_CONTROL, "public, max-age=86400")],
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendored_files_match_the_hashes_in_vendor_md() {
        let table = include_str!("assets/vendor/VENDOR.md");
        for (file, hash) in FILES.iter().zip(HASHES.iter()) {
            if table.contains(&format!("`{}`", file.name)) {
                assert!(
                    table.contains(&format!("`{hash}`")),
                    "{}: sha256 {hash} is not in VENDOR.md",
                    file.name
                );
            }
        }
        assert!(table.contains("`htmx.min.js`") && table.contains("`uPlot.iife.min.js`"));
    }
}
