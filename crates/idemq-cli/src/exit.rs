//! Exit codes, usage errors and logging setup.

use std::fmt;
use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Result;
use tracing_subscriber::EnvFilter;

/// Runtime error: the store or the source failed.
pub const RUNTIME: u8 = 1;
/// Usage or configuration error.
pub const USAGE: u8 = 2;
/// The thing asked about does not exist.
pub const NOT_FOUND: u8 = 3;
/// Stopped by Ctrl-C.
pub const INTERRUPTED: u8 = 130;

/// Log filter when neither `IDEMQ_LOG` nor `RUST_LOG` is set: warnings only,
/// and the engine's per-message warnings (duplicates, retries) are left to the
/// summary so that a terminal run stays quiet.
const DEFAULT_FILTER: &str = "warn,idemq::engine=error";

/// A usage or configuration error: exits with [`USAGE`].
#[derive(Debug)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Wraps anything displayable as a [`UsageError`].
pub fn usage(err: impl fmt::Display) -> anyhow::Error {
    anyhow::Error::new(UsageError(err.to_string()))
}

/// The exit code for an error: [`USAGE`] for configuration errors, else [`RUNTIME`].
pub fn code_for(err: &anyhow::Error) -> u8 {
    let is_usage = err.chain().any(|cause| {
        cause.is::<UsageError>()
            || cause.is::<idemq::ConfigError>()
            || cause
                .downcast_ref::<idemq::StoreError>()
                .is_some_and(|e| e.kind() == idemq::StoreErrorKind::Config)
    });
    if is_usage {
        USAGE
    } else {
        RUNTIME
    }
}

/// Prints the error (with its causes, each once) to stderr and returns its exit code.
pub fn report(err: &anyhow::Error) -> ExitCode {
    let mut text = err.to_string();
    for cause in err.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    eprintln!("idemq: error: {text}");
    ExitCode::from(code_for(err))
}

/// Logs to stderr, filtered by `IDEMQ_LOG`, else `RUST_LOG`, else warnings only.
pub fn init_logging() -> Result<()> {
    let (source, directives) = match (std::env::var("IDEMQ_LOG"), std::env::var("RUST_LOG")) {
        (Ok(v), _) if !v.trim().is_empty() => ("IDEMQ_LOG", v),
        (_, Ok(v)) if !v.trim().is_empty() => ("RUST_LOG", v),
        _ => ("default", DEFAULT_FILTER.to_owned()),
    };
    let filter = EnvFilter::try_new(&directives).map_err(|e| {
        usage(format!(
            "invalid log filter in {source} ({directives:?}): {e}"
        ))
    })?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init()
        .map_err(|e| anyhow::anyhow!("cannot set up logging: {e}"))
}
