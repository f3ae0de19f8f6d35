//! The run loop: pull deliveries from a source, keep N in flight, count outcomes.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::consumer::Consumer;
use crate::error::SourceError;
use crate::outcome::{OutcomeKind, Summary};
use crate::source::Source;
use crate::store::Store;

impl<S: Store> Consumer<S> {
    /// Runs `source` until it ends, with up to
    /// [`concurrency`](super::ConsumerBuilder::concurrency) messages in flight,
    /// and returns the outcome counts. Every delivery is settled before it returns.
    pub async fn run(&self, source: impl Source) -> Result<Summary, SourceError> {
        self.run_until(source, std::future::pending::<()>()).await
    }

    /// Like [`run`](Self::run), but stops taking new deliveries when
    /// `shutdown` completes, finishes the ones in flight, and returns.
    pub async fn run_until(
        &self,
        source: impl Source,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Summary, SourceError> {
        let consumer = self.clone();
        self.run_with(source, shutdown, move |delivery| {
            let consumer = consumer.clone();
            async move { consumer.process(delivery).await }
        })
        .await
    }

    /// The loop of every per-delivery mode: keeps up to `concurrency`
    /// deliveries in flight through `process`, until the source ends or
    /// `shutdown` completes, then waits for those in flight.
    pub(crate) async fn run_with<F, Fut>(
        &self,
        mut source: impl Source,
        shutdown: impl Future<Output = ()>,
        process: F,
    ) -> Result<Summary, SourceError>
    where
        F: Fn(crate::source::Delivery) -> Fut,
        Fut: Future<Output = crate::outcome::Outcome> + Send + 'static,
    {
        let permits = Arc::new(Semaphore::new(self.inner.concurrency));
        let mut tasks: JoinSet<OutcomeKind> = JoinSet::new();
        let mut summary = Summary::default();
        let mut failure = None;
        tokio::pin!(shutdown);
        loop {
            while let Some(done) = tasks.try_join_next() {
                count(&mut summary, done);
            }
            let permit = tokio::select! {
                permit = Arc::clone(&permits).acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => break,
                },
                _ = &mut shutdown => break,
            };
            let next = tokio::select! {
                next = source.next() => next,
                _ = &mut shutdown => break,
            };
            match next {
                Ok(Some(delivery)) => {
                    let work = process(delivery);
                    tasks.spawn(async move {
                        let outcome = work.await;
                        drop(permit);
                        outcome.kind()
                    });
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(consumer = %self.inner.name, error = %e, "source failed");
                    failure = Some(e);
                    break;
                }
            }
        }
        while let Some(done) = tasks.join_next().await {
            count(&mut summary, done);
        }
        source.close().await;
        match failure {
            Some(e) => Err(e),
            None => Ok(summary),
        }
    }
}

fn count(summary: &mut Summary, done: Result<OutcomeKind, tokio::task::JoinError>) {
    match done {
        Ok(kind) => summary.record(kind),
        // The delivery was dropped unsettled: its source redelivers it.
        Err(e) => tracing::error!(error = %e, "a message task failed"),
    }
}
