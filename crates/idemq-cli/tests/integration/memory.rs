//! Bounded input, measured: a 200 MB JSON line is dead-lettered as
//! `too_large` without the process ever holding it. Alone in its test binary
//! because it reads the peak resident size of this process's waited-for
//! children (`getrusage(RUSAGE_CHILDREN)`), which other tests' children
//! would disturb.

use std::io::Write;
use std::process::Command;

/// The largest peak resident size, in bytes, of the children waited for so far.
fn children_peak_rss() -> u64 {
    // SAFETY: getrusage only writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    assert_eq!(rc, 0, "getrusage failed");
    // Linux reports ru_maxrss in KiB.
    usage.ru_maxrss as u64 * 1024
}

fn consume(dir: &std::path::Path, consumer: &str, input: &std::path::Path) -> String {
    let store = format!("sqlite://{}", dir.join("idemq.db").display());
    let out = Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(["consume", "--consumer", consumer, "--store", &store])
        .args(["--key", "json:/payment_id", "--print", "--no-checkpoint"])
        .arg(input)
        .output()
        .expect("spawn idemq");
    assert!(out.status.success(), "{out:#?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// How many messages `--print` applied.
fn applied(out: &str) -> usize {
    out.lines().filter(|l| l.starts_with(r#"{"key""#)).count()
}

fn write_payments(path: &std::path::Path, account_bytes: usize) {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    writeln!(file, r#"{{"payment_id":"p-1","account":"a","amount":1}}"#).unwrap();
    write!(file, r#"{{"payment_id":"p-big","account":""#).unwrap();
    let chunk = vec![b'a'; 1 << 20];
    let mut left = account_bytes;
    while left > 0 {
        let n = left.min(chunk.len());
        file.write_all(&chunk[..n]).unwrap();
        left -= n;
    }
    writeln!(file, r#"","amount":1}}"#).unwrap();
    writeln!(file, r#"{{"payment_id":"p-2","account":"a","amount":1}}"#).unwrap();
    file.flush().unwrap();
}

/// The same run with a 1 KB and a 200 MB middle line (the default limit is
/// 4 MiB): the second is dead-lettered, the lines around it are applied,
/// and its peak resident size exceeds the first's by less than 32 MiB —
/// a few copies of the limit, nothing near the line's size.
#[test]
fn a_200_mb_line_is_dead_lettered_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.jsonl");
    let big = dir.path().join("big.jsonl");
    write_payments(&small, 1_000);
    write_payments(&big, 200 * 1024 * 1024);

    let out = consume(dir.path(), "small", &small);
    assert_eq!(applied(&out), 3, "{out}");
    let baseline = children_peak_rss();

    let out = consume(dir.path(), "big", &big);
    assert_eq!(applied(&out), 2, "the lines around it are applied: {out}");
    assert!(out.contains("dead_lettered=1"), "{out}");
    let peak = children_peak_rss();
    std::fs::remove_file(&big).unwrap();

    let letters = Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(["dlq", "list", "--consumer", "big", "--json", "--store"])
        .arg(format!(
            "sqlite://{}",
            dir.path().join("idemq.db").display()
        ))
        .output()
        .unwrap();
    let letters: serde_json::Value = serde_json::from_slice(&letters.stdout).unwrap();
    assert_eq!(letters[0]["reason"], "too_large", "{letters}");

    let grown = peak.saturating_sub(baseline);
    eprintln!(
        "peak resident: {} MiB with a 1 KB line, {} MiB with a 200 MB line",
        baseline >> 20,
        peak >> 20
    );
    assert!(
        grown < 32 << 20,
        "the 200 MB line grew the peak by {} MiB",
        grown >> 20
    );
}
