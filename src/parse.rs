//! Parsing of the values people write in flags and environment variables: byte sizes,
//! durations in seconds, on/off switches. A leaf: the CLI, the communicator's configuration and
//! the compression policy all read the same spellings through here.
#![forbid(unsafe_code)]

use std::time::Duration;

/// A byte size: a number with an optional K, M or G suffix (powers of 1024, as nccl-tests),
/// optionally followed by B: `8`, `1K`, `64M`, `1.5G`, `512KB`. None for anything else,
/// negative numbers, and sizes beyond `usize`.
pub fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim();
    let t = t.strip_suffix(['B', 'b']).unwrap_or(t);
    let (num, mult) = match t.chars().last()? {
        'k' | 'K' => (&t[..t.len() - 1], 1u64 << 10),
        'm' | 'M' => (&t[..t.len() - 1], 1u64 << 20),
        'g' | 'G' => (&t[..t.len() - 1], 1u64 << 30),
        _ => (t, 1u64),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).and_then(|v| usize::try_from(v).ok());
    }
    let f: f64 = num.parse().ok()?;
    if !(f.is_finite() && f >= 0.0) {
        return None;
    }
    let v = f * mult as f64;
    (v < usize::MAX as f64).then_some(v as usize)
}

/// The longest wait any setting may ask for: a year. Longer values are refused rather than
/// overflowing a deadline (`Instant + Duration` panics past the clock's range).
pub const MAX_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// A positive number of seconds (`300`, `0.5`, `1e3`) up to [`MAX_WAIT`]. None for zero,
/// negative, non-finite or larger values and for anything that is not a number.
pub fn parse_seconds(s: &str) -> Option<Duration> {
    let secs: f64 = s.trim().parse().ok()?;
    if !(secs.is_finite() && secs > 0.0 && secs <= MAX_WAIT.as_secs_f64()) {
        return None;
    }
    Some(Duration::from_secs_f64(secs))
}

/// An on/off switch: `1`, `true`, `yes`, `on` (any case) are on; `0`, `false`, `no`, `off`
/// and the empty string are off; anything else is None.
pub fn parse_switch(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" | "" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("8"), Some(8));
        assert_eq!(parse_size("1K"), Some(1024));
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("512KB"), Some(512 << 10));
        assert_eq!(parse_size("1.5k"), Some(1536));
        assert_eq!(parse_size(" 32768K\n"), Some(32 << 20));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size("x12K"), None);
        assert_eq!(parse_size("-1"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999999999999G"), None);
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_seconds("300"), Some(Duration::from_secs(300)));
        assert_eq!(parse_seconds("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(parse_seconds("1e3"), Some(Duration::from_secs(1000)));
        for bad in ["0", "-1", "1e20", "inf", "NaN", "", "ten"] {
            assert_eq!(parse_seconds(bad), None, "{bad}");
        }
        assert_eq!(
            parse_seconds(&MAX_WAIT.as_secs().to_string()),
            Some(MAX_WAIT)
        );
    }

    #[test]
    fn switches() {
        for on in ["1", "true", "YES", "On"] {
            assert_eq!(parse_switch(on), Some(true), "{on}");
        }
        for off in ["0", "false", "no", "OFF", ""] {
            assert_eq!(parse_switch(off), Some(false), "{off}");
        }
        assert_eq!(parse_switch("maybe"), None);
    }
}
