//! Human-readable durations for configuration: `250ms`, `5s`, `2m`, `1h`, `7d` (units ms, s, m, h, d).
//! A number without a unit is refused (is `500` milliseconds or seconds?), except `0`.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// Parses a duration such as `250ms`, `5s`, `1.5s`, `2m`, `1h` or `7d`.
///
/// # Errors
/// A message naming the expected form when `text` is not a duration.
pub fn parse(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().map_err(|_| {
        format!("`{text}` is not a duration: expected a number with a unit, such as 250ms, 5s, 2m, 1h or 7d")
    })?;
    let factor = match unit.trim() {
        "" if value == 0.0 => 1.0,
        "" => {
            return Err(format!(
                "`{text}` has no unit: expected {number}ms, {number}s, {number}m, {number}h or {number}d"
            ))
        }
        "ms" => 0.001,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        other => {
            return Err(format!(
                "`{text}` has an unknown unit `{other}`: expected ms, s, m, h or d"
            ))
        }
    };
    let secs = value * factor;
    if !secs.is_finite() || !(0.0..=1e12).contains(&secs) {
        return Err(format!("`{text}` is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Formats a duration in the shortest exact unit among ms, s, m, h.
pub fn format(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".to_string();
    }
    if ms.is_multiple_of(3_600_000) {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// `#[serde(with = "txoutbox_core::duration::serde_str")]` for `Duration` fields written as text.
pub mod serde_str {
    use super::*;

    /// Serialises as text, such as `5s`.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format(*d))
    }

    /// Deserialises from text with a unit (`5s`); a number is refused, naming the forms to write
    /// instead (`0` alone is accepted).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Secs(f64),
        }
        match Raw::deserialize(d)? {
            Raw::Text(t) => parse(&t).map_err(serde::de::Error::custom),
            Raw::Secs(n) => parse(&n.to_string()).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse("5s").unwrap(), Duration::from_secs(5));
        assert!(
            parse("500").unwrap_err().contains("expected 500ms, 500s"),
            "a number without a unit is refused"
        );
        assert_eq!(parse("0").unwrap(), Duration::ZERO);
        assert_eq!(parse("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse("7d").unwrap(), Duration::from_secs(7 * 86400));
        assert!(parse("5 parsecs").unwrap_err().contains("unknown unit"));
        assert!(parse("soon").unwrap_err().contains("not a duration"));
        assert!(parse("-1s").is_err());
    }

    #[test]
    fn formats_round_trip() {
        for d in [
            Duration::from_millis(250),
            Duration::from_secs(5),
            Duration::from_secs(120),
            Duration::from_secs(7200),
        ] {
            assert_eq!(parse(&format(d)).unwrap(), d);
        }
    }
}

/// `#[serde(default, with = "txoutbox_core::duration::serde_opt", skip_serializing_if = "Option::is_none")]`
/// for optional `Duration` fields written as text (absent: `None`).
pub mod serde_opt {
    use super::*;

    /// Serialises `Some` as text; `None` as nothing.
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => serde_str::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    /// Deserialises as [`serde_str`] does, into `Some`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        serde_str::deserialize(d).map(Some)
    }
}
