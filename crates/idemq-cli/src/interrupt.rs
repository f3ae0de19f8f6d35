//! Ctrl-C and SIGTERM: the first one asks for a graceful stop (drain), a
//! second one exits at once.

use tokio::sync::watch;

use crate::exit;

/// Whether Ctrl-C or SIGTERM arrived; cheap to clone.
#[derive(Debug, Clone)]
pub struct Interrupt {
    pressed: watch::Receiver<Stop>,
}

/// Whether, and by which signal, the process was asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Not asked.
    Running,
    /// Ctrl-C (SIGINT): the run exits with [`exit::INTERRUPTED`] after draining.
    Interrupted,
    /// SIGTERM: an orderly stop; the run exits 0 after draining.
    Terminated,
}

impl Stop {
    fn name(self) -> &'static str {
        match self {
            Stop::Running => "running",
            Stop::Interrupted => "Ctrl-C",
            Stop::Terminated => "SIGTERM",
        }
    }
}

/// The next Ctrl-C or SIGTERM; `None` if neither can be listened for.
async fn next_signal() -> Option<Stop> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                return tokio::select! {
                    ctrl_c = tokio::signal::ctrl_c() => ctrl_c.ok().map(|()| Stop::Interrupted),
                    _ = term.recv() => Some(Stop::Terminated),
                };
            }
            Err(e) => tracing::warn!(error = %e, "cannot listen for SIGTERM"),
        }
    }
    match tokio::signal::ctrl_c().await {
        Ok(()) => Some(Stop::Interrupted),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for Ctrl-C");
            None
        }
    }
}

impl Interrupt {
    /// Starts listening for Ctrl-C (SIGINT) and, on Unix, SIGTERM — the
    /// signal `docker stop`, systemd and Kubernetes stop a process with.
    /// The first one drains: no new message is taken, the ones in flight
    /// finish and are settled, the summary is printed. A second one quits at
    /// once. Must run inside the Tokio runtime.
    pub fn listen() -> Self {
        let (tx, rx) = watch::channel(Stop::Running);
        tokio::spawn(async move {
            let Some(first) = next_signal().await else {
                return;
            };
            eprintln!(
                "idemq: {}: stopping after the messages in flight (again to quit now)",
                first.name()
            );
            let _ = tx.send(first);
            if next_signal().await.is_some() {
                std::process::exit(i32::from(exit::INTERRUPTED));
            }
        });
        Self { pressed: rx }
    }

    /// Whether Ctrl-C was pressed: the run exits with
    /// [`exit::INTERRUPTED`]. After SIGTERM it is `false`: an orderly stop
    /// exits as a finished run does.
    pub fn is_set(&self) -> bool {
        *self.pressed.borrow() == Stop::Interrupted
    }

    /// Completes when Ctrl-C or SIGTERM arrives (never, if neither can be
    /// listened for).
    pub async fn wait(&self) {
        let mut rx = self.pressed.clone();
        if rx.wait_for(|stop| *stop != Stop::Running).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
