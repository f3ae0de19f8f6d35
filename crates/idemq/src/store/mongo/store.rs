//! The lease store itself ([`MongoStore`]): connecting, and the [`Store`]
//! side: claim, commit, rollback, failures and dead letters.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::TryStreamExt;
use mongodb::bson::{doc, Bson, DateTime, Document};
use mongodb::options::ClientOptions;
use mongodb::{Client, Collection, Database};

use super::clock::ServerClock;
use super::error::{is_duplicate, map_err, MongoError};
use super::ids::esc;
use super::lease::{LeaseCore, MongoLease};
use super::options::MongoOptions;
use super::records::{self, At, Decision, KeyView};
use crate::effect::EffectJournal;
use crate::error::StoreError;
use crate::redact::redact_url;
use crate::store::{now_ms, Claim, ClaimRequest, DeadLetter, Store};

/// How many times a claim reads the key again after losing an insert race
/// before it answers "in flight".
const CLAIM_ROUNDS: usize = 4;

/// How many times a counter-like insert (attempt number, dead-letter id) is
/// tried again after losing a race.
const INSERT_ROUNDS: usize = 8;

/// The MongoDB lease store (see the module docs). Cloning shares the client.
///
/// Call [`close`](Self::close) before the Tokio runtime ends, to end the
/// driver's connections and background tasks cleanly (dropping the last
/// clone without it is safe, inside or outside a runtime).
///
/// ```no_run
/// use idemq::store::mongo::{MongoOptions, MongoStore};
/// use idemq::store::{Claim, ClaimRequest, Store, StoreAdmin};
///
/// # async fn demo() -> Result<(), idemq::StoreError> {
/// // The password, if any, is never shown in errors or logs.
/// let store = MongoStore::connect_with(
///     "mongodb://app:secret@127.0.0.1:27017/billing?maxPoolSize=20",
///     MongoOptions::default().prefix("payments_"),
/// )
/// .await?;
/// store.migrate().await?;
/// let req = ClaimRequest {
///     consumer: "payments",
///     key: "payment-42",
///     fingerprint: "sha256-of-the-payload",
///     lease: std::time::Duration::from_secs(30),
/// };
/// match store.claim(&req).await? {
///     Claim::New(lease) => {
///         // Apply the effect, passing lease.fencing_token() downstream.
///         store.commit(lease, &req, Some(&serde_json::json!({"charged": 42}))).await?;
///     }
///     Claim::Done(record) => println!("already processed: {:?}", record.result),
///     Claim::InFlight => println!("another worker holds it; retry later"),
/// }
/// store.close().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MongoStore {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) client: Client,
    pub(super) db: Database,
    pub(super) options: MongoOptions,
    pub(super) inbox: Collection<Document>,
    pub(super) attempts: Collection<Document>,
    pub(super) dead_letters: Collection<Document>,
    pub(super) effects: Collection<Document>,
    pub(super) clock: ServerClock,
    /// The last dead-letter id this process handed out.
    last_letter_id: AtomicI64,
}

impl std::fmt::Debug for MongoStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MongoStore")
            .field("database", &self.inner.db.name())
            .field("prefix", &self.inner.options.prefix)
            .finish_non_exhaustive()
    }
}

impl MongoStore {
    /// Connects to `url` (`mongodb://[user:password@]host[:port][,…][/database][?options]`)
    /// with default options.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, MongoOptions::default()).await
    }

    /// Connects to `url` with `options`, and checks that the server answers.
    ///
    /// Must run on a Tokio runtime (the driver spawns its monitors there);
    /// elsewhere it answers a configuration error instead of panicking.
    pub async fn connect_with(url: &str, options: MongoOptions) -> Result<Self, StoreError> {
        options.validate()?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(StoreError::config(
                "the MongoDB store needs a Tokio runtime (the driver runs its connection monitors on it)",
            ));
        }
        let mut client_options = ClientOptions::parse(url).await.map_err(|e| {
            StoreError::config(format!(
                "invalid MongoDB URL {}: {}",
                redact_url(url),
                e.kind
            ))
        })?;
        client_options
            .app_name
            .get_or_insert_with(|| "idemq".into());
        client_options
            .connect_timeout
            .get_or_insert(options.connect_timeout);
        client_options
            .server_selection_timeout
            .get_or_insert(options.server_selection_timeout);
        let database = options
            .database
            .clone()
            .or_else(|| client_options.default_database.clone())
            .unwrap_or_else(|| "idemq".into());
        let client = Client::with_options(client_options).map_err(|e| {
            StoreError::config(format!(
                "invalid MongoDB URL {}: {}",
                redact_url(url),
                e.kind
            ))
        })?;
        let store = Self::with_client(client, options.database(database))?;
        store.ping_server().await?;
        // The first measurement of the server's clock, before any claim.
        store.server_now().await;
        tracing::debug!(url = %redact_url(url), database = store.inner.db.name(), "connected to MongoDB");
        Ok(store)
    }

    /// A store over an existing client, in `options.database` (default `idemq`).
    /// The client's URL options are the caller's; only `options.database`
    /// and `options.prefix` are used here.
    pub fn with_client(client: Client, options: MongoOptions) -> Result<Self, StoreError> {
        options.validate()?;
        let db = client.database(options.database.as_deref().unwrap_or("idemq"));
        let coll = |name: &str| db.collection::<Document>(&format!("{}{name}", options.prefix));
        Ok(Self {
            inner: Arc::new(Inner {
                inbox: coll("inbox"),
                attempts: coll("attempts"),
                dead_letters: coll("dead_letters"),
                effects: coll("effects"),
                db: db.clone(),
                client,
                options,
                clock: ServerClock::default(),
                last_letter_id: AtomicI64::new(0),
            }),
        })
    }

    /// The driver's client (to share it).
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The database the collections live in.
    pub fn database(&self) -> &Database {
        &self.inner.db
    }

    /// The options.
    pub fn options(&self) -> &MongoOptions {
        &self.inner.options
    }

    /// Closes the client's connections and stops its background tasks now
    /// (every clone of this store then fails). Dropping the store does the
    /// same in the background; call this to know it is done, e.g. before
    /// the runtime ends.
    pub async fn close(&self) {
        self.inner.client.clone().shutdown().immediate(true).await;
    }

    pub(super) async fn ping_server(&self) -> Result<(), StoreError> {
        self.inner
            .db
            .run_command(doc! { "ping": 1 })
            .await
            .map(|_| ())
            .map_err(map_err)
    }

    /// The server's time now (estimated), in ms.
    pub(super) async fn server_now(&self) -> i64 {
        self.inner.clock.now(&self.inner.client).await
    }

    /// Every slot document of a key (all epochs).
    pub(super) async fn slot_docs(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<Vec<Document>, StoreError> {
        self.inner
            .inbox
            .find(doc! { "consumer": esc(consumer), "key": esc(key) })
            .await
            .map_err(map_err)?
            .try_collect()
            .await
            .map_err(map_err)
    }

    /// The key's current state.
    pub(super) async fn view(&self, consumer: &str, key: &str) -> Result<KeyView, StoreError> {
        let docs = self.slot_docs(consumer, key).await?;
        KeyView::new(consumer, key, &docs).map_err(StoreError::from)
    }

    /// Inserts `doc`: `Ok(true)` if inserted, `Ok(false)` if its `_id` (or
    /// another unique field) was taken.
    pub(super) async fn insert_unique(
        &self,
        coll: &Collection<Document>,
        doc: Document,
    ) -> Result<bool, StoreError> {
        match coll.insert_one(doc).await {
            Ok(_) => Ok(true),
            Err(e) if is_duplicate(&e) => Ok(false),
            Err(e) => Err(map_err(e)),
        }
    }

    /// Claims a key: the lease's core if new (no heartbeat started).
    pub(super) async fn claim_core(
        &self,
        consumer: &str,
        key: &str,
        lease: Duration,
    ) -> Result<Claim<LeaseCore>, StoreError> {
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX).max(1);
        for _ in 0..CLAIM_ROUNDS {
            let view = self.view(consumer, key).await?;
            let now = self.server_now().await;
            match view.decide(consumer, key, now) {
                Decision::Done(record) => return Ok(Claim::Done(record)),
                Decision::Busy => return Ok(Claim::InFlight),
                Decision::Take {
                    epoch,
                    g,
                    first_seen,
                } => {
                    let token = uuid::Uuid::new_v4().simple().to_string();
                    let expires = now.saturating_add(lease_ms);
                    let at = At {
                        consumer,
                        key,
                        epoch: &epoch,
                        g,
                        first_seen,
                    };
                    if self
                        .insert_unique(&self.inner.inbox, at.lease(&token, expires))
                        .await?
                    {
                        return Ok(Claim::New(LeaseCore {
                            consumer: consumer.to_owned(),
                            key: key.to_owned(),
                            epoch,
                            g,
                            token,
                            first_seen,
                            lease,
                            renewed_until: expires,
                        }));
                    }
                    // Another claim (or a completion, a release) got there first.
                }
            }
        }
        Ok(Claim::InFlight)
    }

    /// The `expire_at` stamp of a completion, with a TTL.
    pub(super) fn expire_at(&self) -> Option<DateTime> {
        self.inner.options.ttl.map(|ttl| {
            let ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
            DateTime::from_millis(now_ms().saturating_add(ms))
        })
    }

    /// After a completion was inserted: if the lease may have lapsed (a
    /// heartbeat was missed), checks that the key's head still carries the
    /// lease's epoch, i.e. that the key was not pruned and claimed anew
    /// meanwhile; if it was, removes the stray done record and answers
    /// `false`. Then, with a TTL, stamps the epoch's other slots.
    pub(super) async fn confirm_completion(&self, core: &LeaseCore) -> Result<bool, StoreError> {
        let now = self.server_now().await;
        if core.may_have_lapsed(now) {
            let head = self
                .inner
                .inbox
                .find_one(doc! { "_id": super::ids::head(&core.consumer, &core.key) })
                .await
                .map_err(map_err)?;
            let same_life = head
                .as_ref()
                .and_then(|h| h.get_str("epoch").ok())
                .is_some_and(|epoch| epoch == core.epoch);
            if !same_life {
                tracing::warn!(key = %core.key, "completion refused: the key was pruned and claimed anew while this lease had lapsed");
                let stray = core.next().id();
                if let Err(e) = self.inner.inbox.delete_one(doc! { "_id": &stray }).await {
                    tracing::warn!(key = %core.key, error = %e.kind, "removing a stray completion failed; prune removes it");
                }
                return Ok(false);
            }
        }
        if let Some(at) = self.expire_at() {
            let stamped = self
                .inner
                .inbox
                .update_many(
                    doc! { "consumer": esc(&core.consumer), "key": esc(&core.key), "epoch": &core.epoch },
                    doc! { "$set": { "expire_at": at } },
                )
                .await;
            if let Err(e) = stamped {
                tracing::warn!(key = %core.key, error = %e.kind, "stamping the key's expiry failed; prune removes it");
            }
        }
        Ok(true)
    }

    /// Deletes the failed attempts of `keys` of `consumer`; failures are
    /// logged (the completion stands; stale attempts are pruned).
    pub(super) async fn clear_attempts(&self, consumer: &str, keys: &[&str]) {
        if keys.is_empty() {
            return;
        }
        let filter = match keys {
            [key] => doc! { "consumer": esc(consumer), "key": esc(key) },
            _ => {
                let keys: Vec<Bson> = keys.iter().map(|k| Bson::String(esc(k))).collect();
                doc! { "consumer": esc(consumer), "key": { "$in": keys } }
            }
        };
        if let Err(e) = self.inner.attempts.delete_many(filter).await {
            tracing::warn!(consumer, error = %e.kind, "clearing failed attempts failed");
        }
    }

    /// The next dead-letter id: the worker's clock in ms × 1000, rising
    /// within the process.
    fn next_letter_id(&self) -> i64 {
        let candidate = now_ms().saturating_mul(1000);
        let last = &self.inner.last_letter_id;
        let mut current = last.load(Ordering::SeqCst);
        loop {
            let next = candidate.max(current.saturating_add(1));
            match last.compare_exchange(current, next, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return next,
                Err(seen) => current = seen,
            }
        }
    }

    /// Completes `core` with `fingerprint` and `result`: whether the
    /// completion held (the lease was not taken over).
    pub(super) async fn complete_core(
        &self,
        core: &LeaseCore,
        fingerprint: &str,
        result: Option<&serde_json::Value>,
    ) -> Result<bool, StoreError> {
        let done = core.next().done(fingerprint, result, self.expire_at());
        if !self.insert_unique(&self.inner.inbox, done).await? {
            return Ok(false);
        }
        self.confirm_completion(core).await
    }
}

#[async_trait]
impl Store for MongoStore {
    type Tx = MongoLease;

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim<MongoLease>, StoreError> {
        Ok(
            match self.claim_core(req.consumer, req.key, req.lease).await? {
                Claim::New(core) => Claim::New(MongoLease::held(self, core)),
                Claim::Done(record) => Claim::Done(record),
                Claim::InFlight => Claim::InFlight,
            },
        )
    }

    async fn commit(
        &self,
        mut lease: MongoLease,
        req: &ClaimRequest<'_>,
        result: Option<&serde_json::Value>,
    ) -> Result<(), StoreError> {
        let core = lease.settle();
        if !self.complete_core(&core, req.fingerprint, result).await? {
            lease.mark_lost();
            return Err(StoreError::lease_lost(&core.key));
        }
        self.clear_attempts(&core.consumer, &[core.key.as_str()])
            .await;
        Ok(())
    }

    async fn rollback(&self, mut lease: MongoLease) -> Result<(), StoreError> {
        let core = lease.settle();
        // Taken over already (the insert finds the next generation): nothing to free.
        self.insert_unique(&self.inner.inbox, core.next().free())
            .await?;
        Ok(())
    }

    async fn record_failure(
        &self,
        consumer: &str,
        key: &str,
        error: &str,
    ) -> Result<u32, StoreError> {
        for _ in 0..INSERT_ROUNDS {
            let last: Vec<Document> = self
                .inner
                .attempts
                .find(doc! { "consumer": esc(consumer), "key": esc(key) })
                .projection(doc! { "n": 1 })
                .await
                .map_err(map_err)?
                .try_collect()
                .await
                .map_err(map_err)?;
            let n = last
                .iter()
                .filter_map(|d| records::int(d, "n"))
                .max()
                .unwrap_or(0)
                + 1;
            let attempt = records::attempt_doc(consumer, key, n, error);
            if self.insert_unique(&self.inner.attempts, attempt).await? {
                return Ok(u32::try_from(n).unwrap_or(u32::MAX));
            }
        }
        Err(MongoError::Contended(format!(
            "counting a failed attempt of {key:?}: other workers kept counting at the same time"
        ))
        .into())
    }

    async fn dead_letter(&self, letter: &DeadLetter<'_>) -> Result<(), StoreError> {
        let letter_id = letter.letter_id();
        let mut written = false;
        for _ in 0..INSERT_ROUNDS {
            let seen = self
                .inner
                .dead_letters
                .find_one(doc! { "letter": &letter_id })
                .projection(doc! { "_id": 1 })
                .await
                .map_err(map_err)?;
            if seen.is_some() {
                written = true;
                break;
            }
            let doc = records::dead_letter_doc(self.next_letter_id(), letter);
            if self.insert_unique(&self.inner.dead_letters, doc).await? {
                written = true;
                break;
            }
            // The id was taken (another worker's clock), or the letter was
            // written meanwhile: the next round tells which.
        }
        if !written {
            return Err(MongoError::Contended(format!(
                "writing the dead letter of {:?}: its id kept being taken",
                letter.key.unwrap_or_default()
            ))
            .into());
        }
        if let Some(key) = letter.key {
            self.clear_attempts(letter.consumer, &[key]).await;
        }
        Ok(())
    }

    fn journal(&self) -> Option<&dyn EffectJournal> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Neither the URL's password nor its secret parameters show in the
    /// error of a URL the driver refuses.
    #[tokio::test]
    async fn url_errors_hide_the_password() {
        for url in [
            "mongodb://user:s3cret@127.0.0.1:notaport/db",
            "mongodb://user:s3cret@127.0.0.1/db?authMechanism=BOGUS",
            "mongodb://user:s3cret@127.0.0.1/db?tlsCertificateKeyFilePassword=s3cret&wtimeoutMS=x",
        ] {
            let e = MongoStore::connect(url).await.expect_err(url);
            let shown = format!("{e} {e:?}");
            assert!(!shown.contains("s3cret"), "{shown}");
        }
    }

    /// Outside a Tokio runtime, connecting is an error, not a panic.
    #[test]
    fn connecting_without_a_runtime_is_an_error() {
        let e = futures_util::FutureExt::now_or_never(MongoStore::connect("mongodb://127.0.0.1:1"))
            .expect("answers at once")
            .expect_err("no runtime");
        assert_eq!(e.kind(), crate::StoreErrorKind::Config);
    }
}
