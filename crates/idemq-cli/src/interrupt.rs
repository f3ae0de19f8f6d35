//! Ctrl-C: the first one asks for a graceful stop, a second one exits at once.

use tokio::sync::watch;

use crate::exit;

/// Whether Ctrl-C was pressed; cheap to clone.
#[derive(Debug, Clone)]
pub struct Interrupt {
    pressed: watch::Receiver<bool>,
}

impl Interrupt {
    /// Starts listening for Ctrl-C. Must run inside the Tokio runtime.
    pub fn listen() -> Self {
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            if let Err(e) = tokio::signal::ctrl_c().await {
                tracing::warn!(error = %e, "cannot listen for Ctrl-C");
                return;
            }
            eprintln!("idemq: stopping after the messages in flight (Ctrl-C again to quit now)");
            let _ = tx.send(true);
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(i32::from(exit::INTERRUPTED));
            }
        });
        Self { pressed: rx }
    }

    /// Whether Ctrl-C was pressed.
    pub fn is_set(&self) -> bool {
        *self.pressed.borrow()
    }

    /// Completes when Ctrl-C is pressed (never, if it cannot be listened for).
    pub async fn wait(&self) {
        let mut rx = self.pressed.clone();
        if rx.wait_for(|pressed| *pressed).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
