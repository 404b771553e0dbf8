//! Byte sizes as operators write them: `64MiB`, `1GiB`, `4096`, `1.5GB`.

#![forbid(unsafe_code)]

use std::fmt;

/// A size in bytes, parsed from strings such as `16MiB` or `1GiB`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

/// Why a byte size could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid size {input:?}: expected a number with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 64MiB")]
pub struct ByteSizeError {
    input: String,
}

impl std::str::FromStr for ByteSize {
    type Err = ByteSizeError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = || ByteSizeError { input: input.to_string() };
        let trimmed = input.trim();
        let split = trimmed.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" => 1 << 10,
            "m" | "mib" => 1 << 20,
            "g" | "gib" => 1 << 30,
            "t" | "tib" => 1 << 40,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            _ => return Err(err()),
        };
        if number.is_empty() {
            return Err(err());
        }
        if let Ok(whole) = number.parse::<u64>() {
            return whole.checked_mul(multiplier).map(ByteSize).ok_or_else(err);
        }
        let value: f64 = number.parse().map_err(|_| err())?;
        let bytes = value * multiplier as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(err());
        }
        Ok(ByteSize(bytes.round() as u64))
    }
}

impl serde::Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for ByteSize {
    /// Accepts a string with a unit ("64MiB") or a plain number of bytes.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Number(bytes) => Ok(ByteSize(bytes)),
            Raw::Text(text) => text.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
        for (name, size) in UNITS {
            if self.0 >= size && self.0.is_multiple_of(size) {
                return write!(f, "{}{}", self.0 / size, name);
            }
        }
        for (name, size) in UNITS {
            if self.0 >= size {
                return write!(f, "{:.2}{}", self.0 as f64 / size as f64, name);
            }
        }
        write!(f, "{}B", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_and_decimal_units() {
        let cases = [
            ("4096", 4096),
            ("1KiB", 1024),
            ("64MiB", 64 << 20),
            ("1gib", 1 << 30),
            ("1.5MiB", 3 << 19),
            ("2GB", 2_000_000_000),
            (" 16 MiB ", 16 << 20),
        ];
        for (text, bytes) in cases {
            assert_eq!(text.parse::<ByteSize>(), Ok(ByteSize(bytes)), "{text}");
        }
    }

    #[test]
    fn rejects_garbage_and_overflow() {
        for text in ["", "MiB", "12XB", "-1", "99999999999TiB", "1e3"] {
            assert!(text.parse::<ByteSize>().is_err(), "{text} should be rejected");
        }
    }

    #[test]
    fn displays_round_units() {
        assert_eq!(ByteSize(1 << 30).to_string(), "1GiB");
        assert_eq!(ByteSize(3 << 19).to_string(), "1536KiB");
        assert_eq!(ByteSize((3 << 19) + 1).to_string(), "1.50MiB");
        assert_eq!(ByteSize(100).to_string(), "100B");
    }
}
