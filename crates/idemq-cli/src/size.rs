//! Byte sizes on the command line: `4MiB`, `512KiB`, `1000000`.

/// Parses a byte count of at least 1: a number, optionally followed by
/// `B`, `KiB`/`K`, `MiB`/`M` or `GiB`/`G` (powers of 1024; `KB`, `MB`,
/// `GB` are powers of 1000).
pub fn parse_byte_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: usize = number
        .parse()
        .map_err(|_| format!("expected a size such as 4MiB, got {text:?}"))?;
    let factor: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit {other:?} (B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    match number.checked_mul(factor) {
        Some(0) => Err("must be at least 1 byte".into()),
        Some(bytes) => Ok(bytes),
        None => Err(format!("{text:?} is too large")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_and_without_units() {
        assert_eq!(parse_byte_size("100"), Ok(100));
        assert_eq!(parse_byte_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_byte_size("512 KiB"), Ok(512 << 10));
        assert_eq!(parse_byte_size("2k"), Ok(2048));
        assert_eq!(parse_byte_size("1MB"), Ok(1_000_000));
        assert!(parse_byte_size("0").is_err());
        assert!(parse_byte_size("MiB").is_err());
        assert!(parse_byte_size("3 parsecs").is_err());
        assert!(parse_byte_size("99999999999999999999GiB").is_err());
    }
}
