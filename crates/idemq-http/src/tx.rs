//! Handing the claim's transaction (SQL stores) or lease (lease stores) to
//! the handler, through the request's extensions.

use std::sync::Arc;

use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use crate::error::TxError;

/// The claim of this request's key, as the handler gets it: for a SQL store
/// the open `sqlx::Transaction` in which the key was claimed (write the
/// business rows through it, and they commit with the stored response), for
/// a lease store the lease (its fencing token).
///
/// The layer puts it in the request's extensions; with the `axum` feature it
/// is also an extractor. Take it with [`lock`](Self::lock), and let the guard
/// go before the handler returns: the layer takes the transaction back to
/// commit it with the response.
#[derive(Debug)]
pub struct InboxTx<Tx> {
    slot: Arc<Mutex<Option<Tx>>>,
}

impl<Tx> Clone for InboxTx<Tx> {
    fn clone(&self) -> Self {
        Self {
            slot: Arc::clone(&self.slot),
        }
    }
}

/// A locked [`InboxTx`]: derefs to the transaction or lease. It owns its
/// lock (no borrow of the handle), which keeps handler futures `Send`
/// without higher-ranked lifetime trouble.
pub type TxGuard<Tx> = OwnedMappedMutexGuard<Option<Tx>, Tx>;

impl<Tx: Send> InboxTx<Tx> {
    pub(crate) fn new(tx: Tx) -> Self {
        Self {
            slot: Arc::new(Mutex::new(Some(tx))),
        }
    }

    /// The transaction (or lease), for as long as the guard lives.
    ///
    /// ```no_run
    /// # #[cfg(feature = "sqlite")]
    /// # async fn demo(inbox: idemq_http::InboxTx<idemq::store::sql::sqlite::SqliteTx>) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = inbox.lock().await?;
    /// idemq::sqlx::query("INSERT INTO orders (item) VALUES ('book')")
    ///     .execute(&mut **tx)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn lock(&self) -> Result<TxGuard<Tx>, TxError> {
        let slot = Arc::clone(&self.slot).lock_owned().await;
        OwnedMutexGuard::try_map(slot, Option::as_mut).map_err(|_| TxError::Gone)
    }

    /// Takes the transaction back, if no guard is held: `None` when it is
    /// gone or still locked by a task that outlived the handler.
    pub(crate) fn take(&self) -> Option<Tx> {
        self.slot.try_lock().ok().and_then(|mut slot| slot.take())
    }
}
