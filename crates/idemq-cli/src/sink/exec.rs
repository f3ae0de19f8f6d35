//! `--apply-exec CMD`: run a command per newly claimed message.
//!
//! `CMD` runs through `sh -c` with the payload on stdin and in its
//! environment:
//!
//! - `IDEMQ_KEY`: the business key;
//! - `IDEMQ_IDEMPOTENCY_KEY`: the derived key of step `exec` (a UUID, no
//!   quotes), the same on every redelivery: pass it on to the system the
//!   command calls;
//! - `IDEMQ_MESSAGE_ID`: the message id (unset if the message has none);
//! - `IDEMQ_CONSUMER`: the consumer name.
//!
//! The run goes through the effect journal (step `exec`): once it succeeded
//! its result is journaled, and a redelivery does not run the command again.
//! The exit status maps like the HTTP statuses of `--apply-http`:
//!
//! | exit | like HTTP | outcome |
//! |---|---|---|
//! | 0 | 2xx | processed; stdout is the stored result (JSON if it parses, else text, `null` if empty) |
//! | 75 (EX_TEMPFAIL), 69 (EX_UNAVAILABLE) | 409, 503 | retried with backoff |
//! | 65 (EX_DATAERR) | 422 | conflict: dead letter with the reason `conflict`, counted as `conflict` |
//! | any other code | other 4xx | dead letter (`permanent_failure`) with the code and the end of stderr |
//! | killed by a signal, `--exec-timeout` passed, could not start | timeout, connection error | retried with backoff |
//!
//! On a timeout the command's whole process group is killed.

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use idemq::{Context, Handler, HandlerError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use uuid::Uuid;

use super::HandlerFuture;

/// The effect step of `--apply-exec` (the derived key's step name).
pub const STEP: &str = "exec";

/// `sysexits.h` EX_DATAERR: the input data was incorrect (here: a conflict).
pub const EX_DATAERR: i32 = 65;
/// `sysexits.h` EX_UNAVAILABLE: a service is unavailable (retried).
pub const EX_UNAVAILABLE: i32 = 69;
/// `sysexits.h` EX_TEMPFAIL: a temporary failure (retried).
pub const EX_TEMPFAIL: i32 = 75;

/// How much of stderr goes into an error message, in bytes (the end of it).
const MAX_REASON: usize = 512;

/// Runs one shell command per message through the effect journal.
pub struct ExecSink {
    command: String,
    timeout: Duration,
}

impl ExecSink {
    /// A sink running `command` with `sh -c`, killed after `timeout`.
    pub fn new(command: &str, timeout: Duration) -> Self {
        Self {
            command: command.to_owned(),
            timeout,
        }
    }

    /// Runs the command once for `ctx` with the derived `key`.
    async fn run(&self, ctx: &Context<'_>, key: Uuid) -> Result<serde_json::Value, HandlerError> {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(&self.command)
            .env("IDEMQ_KEY", ctx.key)
            .env("IDEMQ_IDEMPOTENCY_KEY", key.to_string())
            .env("IDEMQ_CONSUMER", ctx.consumer)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        match &ctx.message.id {
            Some(id) => command.env("IDEMQ_MESSAGE_ID", id),
            None => command.env_remove("IDEMQ_MESSAGE_ID"),
        };
        // Its own process group, so that a timeout kills what it started too.
        #[cfg(unix)]
        command.process_group(0);
        let mut child = command.spawn().map_err(|e| {
            HandlerError::retryable(format!("could not start `sh -c {:?}`: {e}", self.command))
        })?;
        // Declared after `child`, so dropped before it: kills the group
        // while its leader is not yet reaped (its id cannot be reused).
        let mut group = KillGroup(child.id());
        let (stdin, stdout, stderr) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take());
        let payload = &ctx.message.payload;
        let work = async {
            let feed = async move {
                if let Some(mut stdin) = stdin {
                    // A command that does not read its input closes the pipe early.
                    let _ = stdin.write_all(payload).await;
                }
            };
            let ((), out, err, status) =
                tokio::join!(feed, read_all(stdout), read_all(stderr), child.wait());
            (out, err, status)
        };
        let (out, err, status) = match tokio::time::timeout(self.timeout, work).await {
            Ok(done) => done,
            Err(_) => {
                return Err(HandlerError::retryable(format!(
                    "the command ran longer than --exec-timeout {} and was killed",
                    humantime::format_duration(self.timeout)
                )))
            }
        };
        group.disarm();
        let status = status
            .map_err(|e| HandlerError::retryable(format!("waiting for the command failed: {e}")))?;
        if out.cut {
            tracing::warn!(
                max_bytes = MAX_OUTPUT,
                "the command's output is longer than a stored result may be; its first bytes are stored"
            );
        }
        classify(status, &out, &err.bytes)
    }
}

/// The most of a command's stdout (its stored result) or stderr kept: 1 MiB.
const MAX_OUTPUT: usize = 1024 * 1024;

/// What was read of a pipe: at most [`MAX_OUTPUT`] bytes, and whether more
/// came (and was read and dropped, so that the command never blocks on a
/// full pipe). An I/O error keeps what was read.
struct Output {
    bytes: Vec<u8>,
    cut: bool,
}

/// Reads a pipe to its end, keeping at most [`MAX_OUTPUT`] bytes of it.
async fn read_all(pipe: Option<impl AsyncRead + Unpin>) -> Output {
    let mut bytes = Vec::new();
    let mut cut = false;
    if let Some(mut pipe) = pipe {
        let limit = MAX_OUTPUT as u64 + 1;
        if let Err(e) = (&mut pipe).take(limit).read_to_end(&mut bytes).await {
            tracing::debug!(error = %e, "reading the command's output");
        }
        if bytes.len() > MAX_OUTPUT {
            bytes.truncate(MAX_OUTPUT);
            cut = true;
            if let Err(e) = tokio::io::copy(&mut pipe, &mut tokio::io::sink()).await {
                tracing::debug!(error = %e, "draining the command's output");
            }
        }
    }
    Output { bytes, cut }
}

/// Kills a process group when dropped, unless disarmed.
struct KillGroup(Option<u32>);

impl KillGroup {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for KillGroup {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Some(pid) = self.0.and_then(|p| i32::try_from(p).ok()) {
            // SAFETY: kill(2) takes plain integers and touches no memory;
            // a negative pid names the process group the child leads.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
    }
}

/// The output as a result value: JSON if it parses, else text, `null` if empty.
/// The stored result of a command's stdout: JSON if it parses, else the
/// text, `null` if empty; output cut at [`MAX_OUTPUT`] is stored as
/// `{"truncated_to_bytes": N, "text": "<its first N bytes>"}`.
fn result_value(out: &Output) -> serde_json::Value {
    if out.cut {
        return serde_json::json!({
            "truncated_to_bytes": out.bytes.len(),
            "text": String::from_utf8_lossy(&out.bytes),
        });
    }
    output_value(&out.bytes)
}

fn output_value(out: &[u8]) -> serde_json::Value {
    if out.iter().all(u8::is_ascii_whitespace) {
        return serde_json::Value::Null;
    }
    serde_json::from_slice(out).unwrap_or_else(|_| {
        let text = String::from_utf8_lossy(out);
        serde_json::Value::String(text.trim_end_matches(['\n', '\r']).to_owned())
    })
}

/// The last [`MAX_REASON`] bytes of stderr, for the error message.
fn stderr_tail(err: &[u8]) -> String {
    let start = err.len().saturating_sub(MAX_REASON);
    let text = String::from_utf8_lossy(&err[start..]);
    match text.trim() {
        "" => String::new(),
        t if start > 0 => format!(": …{t}"),
        t => format!(": {t}"),
    }
}

/// Maps an exit status to the outcome (see the module docs).
fn classify(
    status: ExitStatus,
    out: &Output,
    err: &[u8],
) -> Result<serde_json::Value, HandlerError> {
    let tail = stderr_tail(err);
    match status.code() {
        Some(0) => Ok(result_value(out)),
        Some(code @ (EX_TEMPFAIL | EX_UNAVAILABLE)) => Err(HandlerError::retryable(format!(
            "the command exited with {code} ({}){tail}",
            if code == EX_TEMPFAIL {
                "EX_TEMPFAIL"
            } else {
                "EX_UNAVAILABLE"
            }
        ))),
        Some(EX_DATAERR) => Err(HandlerError::conflict(format!(
            "the command exited with {EX_DATAERR} (EX_DATAERR){tail}"
        ))),
        Some(code) => Err(HandlerError::permanent(format!(
            "the command exited with {code}{tail}"
        ))),
        None => Err(HandlerError::retryable(format!(
            "the command was killed{}{tail}",
            signal(status).map_or_else(String::new, |s| format!(" by signal {s}"))
        ))),
    }
}

#[cfg(unix)]
fn signal(status: ExitStatus) -> Option<i32> {
    std::os::unix::process::ExitStatusExt::signal(&status)
}

#[cfg(not(unix))]
fn signal(_status: ExitStatus) -> Option<i32> {
    None
}

impl<Tx: Send + 'static> Handler<Tx> for ExecSink {
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, _tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            let result = ctx.effect(STEP, |key| self.run(ctx, key)).await?;
            Ok(Some(result))
        })
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn whole(bytes: &[u8]) -> Output {
        Output {
            bytes: bytes.to_vec(),
            cut: false,
        }
    }

    #[tokio::test]
    async fn output_past_the_cap_is_cut_and_drained() {
        let big = vec![b'x'; MAX_OUTPUT + 10];
        let out = read_all(Some(&big[..])).await;
        assert!(out.cut);
        assert_eq!(out.bytes.len(), MAX_OUTPUT);
        let code = |c: i32| ExitStatus::from_raw(c << 8);
        let stored = classify(code(0), &out, b"").unwrap();
        assert_eq!(stored["truncated_to_bytes"], MAX_OUTPUT);
    }

    #[test]
    fn exit_codes_map_as_documented() {
        let code = |c: i32| ExitStatus::from_raw(c << 8);
        assert_eq!(
            classify(code(0), &whole(b"{\"ok\":true}\n"), b"").unwrap(),
            serde_json::json!({ "ok": true })
        );
        assert_eq!(classify(code(0), &whole(b"done\n"), b"").unwrap(), "done");
        assert_eq!(
            classify(code(0), &whole(b""), b"").unwrap(),
            serde_json::Value::Null
        );
        assert!(classify(code(75), &whole(b""), b"")
            .unwrap_err()
            .is_retryable());
        assert!(classify(code(69), &whole(b""), b"")
            .unwrap_err()
            .is_retryable());
        let conflict = classify(code(65), &whole(b""), b"other payload").unwrap_err();
        assert!(
            conflict.kind() == idemq::HandlerErrorKind::Conflict
                && conflict.message().contains("other payload"),
            "{conflict:?}"
        );
        let broken = classify(code(3), &whole(b""), b"no such account\n").unwrap_err();
        assert!(!broken.is_retryable());
        assert!(
            broken
                .to_string()
                .ends_with("exited with 3: no such account"),
            "{broken}"
        );
        let killed = classify(ExitStatus::from_raw(9), &whole(b""), b"").unwrap_err();
        assert!(killed.is_retryable());
        assert!(killed.to_string().contains("signal 9"), "{killed}");
        let long = vec![b'e'; MAX_REASON * 2];
        assert!(stderr_tail(&long).len() < MAX_REASON + 10);
    }
}
