//! Byte sizes as people write them (`80GiB`, `40 GB`, `1.5TiB`) and as the estimate prints
//! them (decimal units, one decimal: `41.3 GB`, as the ZeRO paper prints its table).

use crate::error::Error;

const UNITS: [(&str, u64); 9] = [
    ("B", 1),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
    ("KIB", 1 << 10),
    ("MIB", 1 << 20),
    ("GIB", 1 << 30),
    ("TIB", 1 << 40),
];

/// Parses `80GiB`, `40GB`, `512MiB`, `1.5 TiB` or a plain number of bytes.
pub fn parse_size(input: &str) -> Result<u64, Error> {
    let err = |reason: &str| Error::InvalidSize {
        input: input.to_string(),
        reason: reason.to_string(),
    };
    let (value, unit) = number_and_unit(input)
        .ok_or_else(|| err("expected a number followed by a unit such as GiB or GB"))?;
    let unit = unit.to_ascii_uppercase();
    let scale = match unit.as_str() {
        "" => 1,
        u => UNITS
            .iter()
            .find(|(name, _)| *name == u || (u.len() == 1 && name.starts_with(u)))
            .map(|&(_, scale)| scale)
            .ok_or_else(|| err("unknown unit; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"))?,
    };
    let bytes = value * scale as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(err("too large"));
    }
    Ok(bytes.round() as u64)
}

/// `1.5 TiB` as (1.5, "TiB"): a leading decimal number and the rest, both trimmed; `None` when
/// no number leads. Sizes and durations (`500ms`) are written this way.
pub fn number_and_unit(input: &str) -> Option<(f64, &str)> {
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    Some((number.parse().ok()?, unit.trim()))
}

/// `41.3 GB`: decimal units, one decimal rounded half away from zero.
pub fn human(bytes: u64) -> String {
    const NAMES: [&str; 6] = ["B", "kB", "MB", "GB", "TB", "PB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 999.95 && unit < NAMES.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    format!("{:.1} {}", (value * 10.0).round() / 10.0, NAMES[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_and_decimal_units() {
        assert_eq!(parse_size("80GiB").unwrap(), 80 << 30);
        assert_eq!(parse_size("40GB").unwrap(), 40_000_000_000);
        assert_eq!(parse_size("1.5 TiB").unwrap(), 3 << 39);
        assert_eq!(parse_size("2g").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("80 parsecs").is_err());
        assert!(parse_size("GiB").is_err());
    }

    #[test]
    fn prints_one_decimal_in_decimal_units() {
        assert_eq!(human(41_250_000_000), "41.3 GB");
        assert_eq!(human(40_000_000_000), "40.0 GB");
        assert_eq!(human(117_187_500), "117.2 MB");
        assert_eq!(human(999_960_000), "1.0 GB");
        assert_eq!(human(512), "512 B");
    }
}
