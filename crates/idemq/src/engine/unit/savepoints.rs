//! The SQL batch unit: many keys claimed in one statement, in one
//! transaction ([`BatchStore`]), committed once.
//!
//! The first run of a unit takes no savepoints (two round trips fewer per
//! member): a failing member rolls the whole transaction back, and the
//! pipeline runs the unit again *carefully*, with a savepoint per member, so
//! that a failing member is rolled back to its savepoint and gives up its
//! claim while the rest stay.

use async_trait::async_trait;

use super::{roll_back, Answer, Claimant, Mode, Undone, Unit};
use crate::engine::consumer::Consumer;
use crate::error::StoreError;
use crate::store::{BatchClaim, BatchStore};

/// Batch mode over a [`BatchStore`] (the SQL stores).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SqlBatch;

impl<S: BatchStore> Mode<S> for SqlBatch {
    type Unit = Savepoints<S>;

    fn open(&self, consumer: &Consumer<S>, careful: bool) -> Savepoints<S> {
        Savepoints {
            consumer: consumer.clone(),
            tx: None,
            careful,
        }
    }
}

/// One batch transaction.
pub(crate) struct Savepoints<S: BatchStore> {
    consumer: Consumer<S>,
    tx: Option<S::Tx>,
    careful: bool,
}

impl<S: BatchStore> Savepoints<S> {
    fn tx_mut(&mut self) -> Result<&mut S::Tx, StoreError> {
        self.tx
            .as_mut()
            .ok_or_else(|| StoreError::transient("the batch transaction is gone"))
    }

    async fn rollback(&mut self) {
        roll_back(&self.consumer, &mut self.tx).await;
    }
}

#[async_trait]
impl<S: BatchStore> Unit<S> for Savepoints<S> {
    async fn claim(&mut self, claims: &[Claimant<'_>]) -> Result<Vec<Answer>, StoreError> {
        let inner = &*self.consumer.inner;
        let pairs: Vec<(&str, &str)> = claims
            .iter()
            .map(|c| (c.req.key, c.req.fingerprint))
            .collect();
        let (tx, answers) = inner.store.claim_batch(&inner.name, &pairs).await?;
        self.tx = Some(tx);
        Ok(answers
            .into_iter()
            .map(|answer| match answer {
                BatchClaim::New => Answer::New,
                BatchClaim::Done(record) => Answer::Done(record),
                BatchClaim::Busy => {
                    Answer::Busy("the key is being committed by another worker".into())
                }
            })
            .collect())
    }

    fn tx(&mut self, _n: usize) -> Option<&mut S::Tx> {
        self.tx.as_mut()
    }

    async fn isolate(&mut self, _n: usize) -> Result<(), StoreError> {
        if !self.careful {
            return Ok(());
        }
        let store = std::sync::Arc::clone(&self.consumer.inner.store);
        store.savepoint(self.tx_mut()?).await
    }

    async fn keep(&mut self, _n: usize) -> Result<(), StoreError> {
        if !self.careful {
            return Ok(());
        }
        let store = std::sync::Arc::clone(&self.consumer.inner.store);
        store.release_savepoint(self.tx_mut()?).await
    }

    async fn undo(&mut self, _n: usize, claim: &Claimant<'_>) -> Result<Undone, StoreError> {
        if !self.careful {
            self.rollback().await;
            return Ok(Undone::Unit);
        }
        let store = std::sync::Arc::clone(&self.consumer.inner.store);
        store
            .rollback_message(self.tx_mut()?, claim.req.consumer, claim.req.key)
            .await?;
        Ok(Undone::Member)
    }

    async fn complete(
        mut self,
        claims: &[Claimant<'_>],
        done: &[(usize, Option<&serde_json::Value>)],
    ) -> Result<Vec<bool>, StoreError> {
        let Some(tx) = self.tx.take() else {
            return Err(StoreError::transient("the batch transaction is gone"));
        };
        let results: Vec<(&str, Option<&serde_json::Value>)> = done
            .iter()
            .filter_map(|&(n, result)| claims.get(n).map(|c| (c.req.key, result)))
            .collect();
        let inner = &*self.consumer.inner;
        inner.store.commit_batch(tx, &inner.name, &results).await?;
        Ok(vec![true; done.len()])
    }

    async fn abort(mut self) {
        self.rollback().await;
    }
}
