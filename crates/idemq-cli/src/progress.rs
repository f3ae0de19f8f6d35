//! A live outcome counter on stderr, shown only when stderr is a terminal.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemq::{Outcome, OutcomeKind};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A spinner counting outcomes by kind.
pub struct Progress {
    bar: ProgressBar,
    counts: Arc<[AtomicU64; 5]>,
}

impl Progress {
    /// A hidden spinner labelled `label`, or `None` when stderr is not a terminal.
    pub fn new(label: &str) -> Option<Self> {
        if !std::io::stderr().is_terminal() {
            return None;
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        let style =
            ProgressStyle::with_template("{spinner} {prefix}: {pos} messages [{elapsed}] {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner());
        bar.set_style(style);
        bar.set_prefix(label.to_owned());
        Some(Self {
            bar,
            counts: Arc::new(Default::default()),
        })
    }

    /// Shows the spinner on stderr.
    pub fn show(&self) {
        self.bar.set_draw_target(ProgressDrawTarget::stderr());
        self.bar.enable_steady_tick(Duration::from_millis(120));
    }

    /// The hook for [`ConsumerBuilder::on_outcome`](idemq::ConsumerBuilder::on_outcome).
    pub fn hook(&self) -> impl Fn(&Outcome) + Send + Sync + 'static {
        let bar = self.bar.clone();
        let counts = Arc::clone(&self.counts);
        move |outcome: &Outcome| {
            let kind = outcome.kind();
            if let Some(i) = OutcomeKind::ALL.iter().position(|k| *k == kind) {
                counts[i].fetch_add(1, Ordering::Relaxed);
            }
            let message: Vec<String> = OutcomeKind::ALL
                .iter()
                .zip(counts.iter())
                .map(|(k, n)| format!("{k}={}", n.load(Ordering::Relaxed)))
                .collect();
            bar.inc(1);
            bar.set_message(message.join(" "));
        }
    }

    /// Removes the spinner.
    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}
