//! Helpers shared by the integration tests that run the `idemq` binary and
//! talk to its `--http-addr` (`ops.rs`, `lag.rs`, `console.rs`).
#![allow(dead_code)] // a build without some features uses only some helpers

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The binary under test.
const BIN: &str = env!("CARGO_BIN_EXE_idemq");

/// The binary, with none of the environment that would override its flags.
pub fn idemq() -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("IDEMQ_STORE")
        .env_remove("IDEMQ_TABLE_PREFIX")
        .env_remove("IDEMQ_CONSUMER")
        .env_remove("IDEMQ_CONFIG");
    cmd
}

/// A local TCP port free right now, for a server about to be started on
/// it. It is drawn from 28000 up to the start of the kernel's ephemeral range
/// (`ip_local_port_range`, 32768 by default): the OS gives out ports of that
/// range to every outgoing connection, so one taken there (as `bind(0)`
/// does) can be taken by another test's connection before the server binds
/// it; below it only another such draw can, one chance in thousands. Above
/// the ports of the test services (27017 is FerretDB's).
pub fn free_port() -> u16 {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .filter(|low| *low > 28_100)
        .unwrap_or(32_768);
    for _ in 0..1000 {
        let port = fastrand::u16(28_000..ephemeral);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in 28000..{ephemeral}");
}

/// Waits (20 s at most) until something listens on `port`; `what` names
/// it in the failure.
pub fn wait_listening(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} never listened on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `GET path` on `port`: (status, body).
pub fn get(port: u16, path: &str) -> (u16, String) {
    try_get(port, path).expect("an answer from --http-addr")
}

/// [`get`], or `None` when the connection fails or breaks (a process
/// exiting while it is asked).
pub fn try_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// The sum of the series whose `name{labels…` starts with `prefix` (labels
/// in the exporter's order, as written), 0 when there is none: one series
/// when `prefix` is a whole `name{labels}`, the partitions of a topic when
/// it stops before `partition`'s value.
pub fn series(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(prefix)?;
            rest.rsplit_once(' ')?.1.trim().parse::<f64>().ok()
        })
        .sum()
}

/// Scrapes `/metrics` on `port` every 200 ms until `child` exits or `limit`
/// passes: the values of the series that start with `prefix` (summed, as
/// [`series`] does), each change once; nothing while none is exported.
pub fn watch_series(child: &mut Child, port: u16, prefix: &str, limit: Duration) -> Vec<f64> {
    let mut seen = Vec::new();
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        // The child may exit by itself (--idle-exit): a scrape may race it.
        if let Some((_, metrics)) = try_get(port, "/metrics") {
            if metrics.contains(prefix) {
                let value = series(&metrics, prefix);
                if seen.last() != Some(&value) {
                    seen.push(value);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    seen
}
