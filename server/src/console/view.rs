//! What every page shares: the layout's links and who is signed in, and how numbers and times
//! read.

use time::OffsetDateTime;
use time::macros::format_description;

use super::assets;
use crate::auth::Caller;

/// The frame around every page.
pub struct Layout {
    /// Which navigation entry is current, and which of the console script's parts runs.
    pub page: &'static str,
    pub user: String,
    pub role: &'static str,
    pub htmx: String,
    pub uplot_js: String,
    pub uplot_css: String,
    pub js: String,
    pub css: String,
}

impl Layout {
    pub fn new(page: &'static str, caller: &Caller) -> Layout {
        Layout {
            page,
            user: caller.name.clone(),
            role: caller.role.as_str(),
            htmx: assets::url("htmx.min.js"),
            uplot_js: assets::url("uPlot.iife.min.js"),
            uplot_css: assets::url("uPlot.min.css"),
            js: assets::url("console.js"),
            css: assets::url("console.css"),
        }
    }
}

/// Unix ms as `2026-12-01 12:34:56` (UTC).
pub fn time(ms: i64) -> String {
    let format = format_description!("[year]-[month]-[day] [hour]:[minute]:[second]");
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&format).ok())
        .unwrap_or_else(|| ms.to_string())
}

/// Bytes in decimal units, as the estimate CLI prints them.
pub fn bytes(b: u64) -> String {
    scheduler::bytes::human(b)
}

/// The last 8 characters of a UUIDv7, its random part (the first ones are the time, alike
/// for jobs submitted together): enough to tell jobs apart on a page.
pub fn short_id(id: &str) -> &str {
    id.get(id.len().saturating_sub(8)..).unwrap_or(id)
}
