//! The same exactly-once scenarios against every store: real PostgreSQL,
//! MariaDB and SQLite servers/files, the in-memory lease store and (feature
//! `redis`) the Redis lease store, on one Redis and on a Redis Cluster, and
//! (feature `mongodb`) the Mongo lease store on FerretDB.
//!
//! Every scenario applies messages to a ledger table that has **no** unique
//! constraint, so a message applied twice shows up as two rows.

mod backend;
mod batch;
mod scenarios;

/// SQL-only scenarios of one store.
macro_rules! sql_only {
    ($store:ty) => {
        #[tokio::test]
        async fn attempts_counted_elsewhere_do_not_make_a_processed_key_failing() {
            crate::backends::scenarios::attempts_counted_elsewhere::<$store>().await
        }
    };
}

#[cfg(feature = "mysql")]
mod mysql {
    crate::backends::scenarios::suite!(
        crate::backends::backend::SqlBackend<idemq::store::sql::mysql::MySqlStore>
    );
    crate::backends::batch::batch_suite!(
        crate::backends::backend::SqlBackend<idemq::store::sql::mysql::MySqlStore>
    );
    sql_only!(idemq::store::sql::mysql::MySqlStore);
    crate::backends::batch::batch_suite!(set_based: crate::backends::backend::SetBasedBackend<idemq::store::sql::mysql::MySqlStore>);
}

#[cfg(feature = "postgres")]
mod postgres {
    crate::backends::scenarios::suite!(
        crate::backends::backend::SqlBackend<idemq::store::sql::postgres::PostgresStore>
    );
    crate::backends::batch::batch_suite!(
        crate::backends::backend::SqlBackend<idemq::store::sql::postgres::PostgresStore>
    );
    sql_only!(idemq::store::sql::postgres::PostgresStore);
    crate::backends::batch::batch_suite!(set_based: crate::backends::backend::SetBasedBackend<idemq::store::sql::postgres::PostgresStore>);
}

/// The same scenarios on a time-partitioned inbox of one-second
/// partitions: claims and their duplicates cross partition boundaries.
#[cfg(feature = "postgres")]
mod postgres_partitioned {
    crate::backends::scenarios::suite!(
        crate::backends::backend::Partitioned<idemq::store::sql::postgres::PostgresStore>
    );
    mod batch {
        crate::backends::batch::batch_scenarios!(
            crate::backends::backend::Partitioned<idemq::store::sql::postgres::PostgresStore>
        );
    }
}

/// The same on MariaDB's partitioned inbox.
#[cfg(feature = "mysql")]
mod mysql_partitioned {
    crate::backends::scenarios::suite!(
        crate::backends::backend::Partitioned<idemq::store::sql::mysql::MySqlStore>
    );
    mod batch {
        crate::backends::batch::batch_scenarios!(
            crate::backends::backend::Partitioned<idemq::store::sql::mysql::MySqlStore>
        );
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    crate::backends::scenarios::suite!(
        crate::backends::backend::SqlBackend<idemq::store::sql::sqlite::SqliteStore>
    );
    crate::backends::batch::batch_suite!(
        crate::backends::backend::SqlBackend<idemq::store::sql::sqlite::SqliteStore>
    );
    sql_only!(idemq::store::sql::sqlite::SqliteStore);
    crate::backends::batch::batch_suite!(set_based: crate::backends::backend::SetBasedBackend<idemq::store::sql::sqlite::SqliteStore>);
}

#[cfg(feature = "redis")]
mod redis {
    crate::backends::scenarios::suite!(crate::backends::backend::RedisBackend);

    /// Batch mode over the Redis lease store keeps the order per key
    /// across batches in flight, as the SQL batch suite checks for SQL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_first_copy_in_order_wins_across_lease_batches() {
        crate::backends::scenarios::first_copies_win::<crate::backends::backend::RedisBackend>(
            8,
            |consumer, queue| {
                Box::pin(async move {
                    let options =
                        idemq::engine::BatchOptions::new(20, std::time::Duration::from_millis(5));
                    consumer.run_batched(queue.source(), options).await
                })
            },
        )
        .await
    }
}

/// The same scenarios on a Redis Cluster (three masters, three replicas:
/// `scripts/redis-cluster.sh`): keys spread over the masters' slots.
#[cfg(feature = "redis")]
mod redis_cluster {
    crate::backends::scenarios::suite!(crate::backends::backend::RedisClusterBackend);

    /// Batch mode on a cluster, where each key's scripts go to its own
    /// slot's master: the order per key still holds across batches.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_first_copy_in_order_wins_across_lease_batches() {
        crate::backends::scenarios::first_copies_win::<crate::backends::backend::RedisClusterBackend>(
            8,
            |consumer, queue| {
                Box::pin(async move {
                    let options =
                        idemq::engine::BatchOptions::new(20, std::time::Duration::from_millis(5));
                    consumer.run_batched(queue.source(), options).await
                })
            },
        )
        .await
    }
}

/// The Mongo lease store on FerretDB (`scripts/ferretdb.sh`): the same
/// scenarios, and batch mode over its units.
#[cfg(feature = "mongodb")]
mod mongo {
    crate::backends::scenarios::suite!(crate::backends::backend::MongoBackend);

    /// Batch mode over the Mongo lease store keeps the order per key
    /// across batches in flight, as the SQL batch suite checks for SQL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_first_copy_in_order_wins_across_lease_batches() {
        crate::backends::scenarios::first_copies_win::<crate::backends::backend::MongoBackend>(
            8,
            |consumer, queue| {
                Box::pin(async move {
                    let options =
                        idemq::engine::BatchOptions::new(20, std::time::Duration::from_millis(5));
                    consumer.run_batched(queue.source(), options).await
                })
            },
        )
        .await
    }

    /// Stores, leases and units dropped after their runtime ended (without
    /// `close()`), or dropped inside it while held, do not panic: the
    /// driver's clean-up and the store's background releases need a
    /// runtime, and must do nothing when there is none.
    #[test]
    fn dropping_stores_and_leases_outside_the_runtime_does_not_panic() {
        use crate::backends::backend::Backend;
        use idemq::store::mongo::{MongoOptions, MongoStore};
        use idemq::store::unit::{MemberClaim, UnitOptions, WorkUnit};
        use idemq::store::{Claim, ClaimRequest, Store, UnitStore};
        use std::sync::Arc;
        use std::time::Duration;

        let runtime = |threads| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .enable_all()
                .build()
                .unwrap()
        };
        let main = runtime(1);
        let backend = main.block_on(crate::backends::backend::MongoBackend::fresh());
        let prefix = backend.store().options().prefix.clone();
        let url = std::env::var("IDEMQ_TEST_MONGODB")
            .unwrap_or_else(|_| "mongodb://127.0.0.1:27017".into());
        let options = MongoOptions::default()
            .database("idemq_test")
            .prefix(prefix);
        let req = |key| ClaimRequest {
            consumer: "drop",
            key,
            fingerprint: "f",
            lease: Duration::from_secs(30),
        };

        // Held lease, unit and store outlive their runtime.
        let other = runtime(2);
        let (store, lease, unit) = other.block_on(async {
            let store = MongoStore::connect_with(&url, options.clone())
                .await
                .unwrap();
            let Claim::New(lease) = store.claim(&req("a")).await.unwrap() else {
                panic!("a fresh key is new")
            };
            let shared = Arc::new(store.clone());
            let mut unit = shared.begin(UnitOptions::new(
                false,
                Duration::from_secs(30),
                idemq::InFlightPolicy::Reject,
            ));
            let claims = [MemberClaim::Key(req("b"))];
            unit.claim(&claims).await.unwrap();
            (store, lease, unit)
        });
        drop(other);
        drop(lease);
        drop(unit);
        drop(store);

        // A store dropped inside its runtime, unclosed, with a lease held;
        // then the runtime ends while the background release may still run.
        let third = runtime(2);
        third.block_on(async {
            let store = MongoStore::connect_with(&url, options.clone())
                .await
                .unwrap();
            let Claim::New(lease) = store.claim(&req("c")).await.unwrap() else {
                panic!("a fresh key is new")
            };
            drop(store);
            drop(lease);
        });
        drop(third);

        main.block_on(backend.cleanup());
    }

    /// A holder whose key's records were pruned under it (its lease had
    /// lapsed, say, in a long pause) sees the loss at its next heartbeat
    /// and its completion is refused: no record is left behind, and the
    /// next claim of the key starts afresh.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_holder_whose_key_was_pruned_cannot_complete() {
        use crate::backends::backend::Backend;
        use idemq::store::{Claim, ClaimRequest, Store, StoreAdmin};
        use idemq::StoreErrorKind;
        use std::time::Duration;

        let backend = crate::backends::backend::MongoBackend::fresh().await;
        let store = backend.store();
        let req = ClaimRequest {
            consumer: "pruned",
            key: "k",
            fingerprint: "f",
            lease: Duration::from_millis(900),
        };
        let Claim::New(lease) = store.claim(&req).await.unwrap() else {
            panic!("a fresh key is new")
        };
        // What a prune does to the key's life, behind the holder's back.
        let inbox = store
            .database()
            .collection::<mongodb::bson::Document>(&format!("{}inbox", store.options().prefix));
        inbox
            .delete_many(mongodb::bson::doc! { "consumer": "pruned", "key": "k" })
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(
            lease.lease_lost(),
            "the heartbeat finds the lease's record gone"
        );
        let err = store.commit(lease, &req, None).await.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::LeaseLost);
        assert!(store.inspect("pruned", "k").await.unwrap().inbox.is_none());
        assert!(matches!(store.claim(&req).await.unwrap(), Claim::New(_)));
        backend.cleanup().await;
    }

    /// Keys that cannot be pruned yet (live leases, older than the cutoff)
    /// do not hide the prunable ones behind them: a batch the size of the
    /// live leases still prunes the abandoned keys.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn live_leases_do_not_stall_pruning() {
        use crate::backends::backend::Backend;
        use idemq::store::{now_ms, Claim, ClaimRequest, Store, StoreAdmin};
        use std::time::Duration;

        let backend = crate::backends::backend::MongoBackend::fresh().await;
        let store = backend.store();
        let req = |key| ClaimRequest {
            consumer: "stall",
            key,
            fingerprint: "f",
            lease: Duration::from_secs(60),
        };
        // Three live leases first, then two keys whose claims were released.
        let mut held = Vec::new();
        for key in ["a", "b", "c"] {
            let Claim::New(lease) = store.claim(&req(key)).await.unwrap() else {
                panic!("{key} is new")
            };
            held.push(lease);
        }
        for key in ["d", "e"] {
            let Claim::New(lease) = store.claim(&req(key)).await.unwrap() else {
                panic!("{key} is new")
            };
            store.rollback(lease).await.unwrap();
        }
        let pruned = store.prune_batch(now_ms() + 60_000, 2).await.unwrap();
        assert_eq!(
            pruned, 2,
            "the two released keys, past the three live leases"
        );
        for key in ["a", "b", "c"] {
            assert!(
                store.inspect("stall", key).await.unwrap().in_flight,
                "{key}"
            );
        }
        drop(held);
        backend.cleanup().await;
    }

    /// The idempotent upsert effect (`idemq::effect::mongo`): the first
    /// write inserts, every later one (another payload too) rewrites
    /// nothing, sixteen racing first writes insert once, and a foreign
    /// `_id` or a payload that is not a document is refused, not written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn upsert_once_inserts_a_key_once_under_races() {
        use crate::backends::backend::Backend;
        use idemq::effect::mongo::{document_of, upsert_once, Upserted};
        use idemq::{HandlerErrorKind, Message};
        use mongodb::bson::doc;

        let backend = crate::backends::backend::MongoBackend::fresh().await;
        let store = backend.store();
        let payments = store
            .database()
            .collection::<mongodb::bson::Document>(&format!("{}payments", store.options().prefix));

        let first = doc! { "amount": 10 };
        assert_eq!(
            upsert_once(&payments, "p-1", first).await.unwrap(),
            Upserted::Inserted
        );
        let other = doc! { "amount": 99 };
        assert_eq!(
            upsert_once(&payments, "p-1", other).await.unwrap(),
            Upserted::AlreadyPresent
        );
        let stored = payments
            .find_one(doc! { "_id": "p-1" })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stored.get_i32("amount").unwrap(), 10, "{stored}");

        let racers: Vec<_> = (0..16)
            .map(|i| {
                let payments = payments.clone();
                tokio::spawn(
                    async move { upsert_once(&payments, "p-race", doc! { "writer": i }).await },
                )
            })
            .collect();
        let mut inserted = 0;
        for racer in racers {
            if racer.await.unwrap().unwrap() == Upserted::Inserted {
                inserted += 1;
            }
        }
        assert_eq!(inserted, 1, "exactly one racing write inserts");
        assert_eq!(
            payments
                .count_documents(doc! { "_id": "p-race" })
                .await
                .unwrap(),
            1
        );

        let foreign = upsert_once(&payments, "p-2", doc! { "_id": "p-3", "amount": 1 })
            .await
            .unwrap_err();
        assert_eq!(foreign.kind(), HandlerErrorKind::Permanent, "{foreign}");
        let not_a_document = document_of(&Message::new("[1, 2]")).unwrap_err();
        assert_eq!(
            not_a_document.kind(),
            HandlerErrorKind::InvalidInput,
            "{not_a_document}"
        );
        assert_eq!(payments.count_documents(doc! {}).await.unwrap(), 2);

        payments.drop().await.unwrap();
        backend.cleanup().await;
    }

    /// The batch scenarios that hold for a lease store (whose handler
    /// effects are its own, so a crashed batch's effects are not undone).
    mod batch {
        use crate::backends::backend::MongoBackend;

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn exactly_once_with_duplicates_inside_and_across_batches() {
            crate::backends::batch::exactly_once_with_duplicates_inside_and_across_batches::<
                MongoBackend,
            >()
            .await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_failing_message_rolls_back_alone() {
            crate::backends::batch::a_failing_message_rolls_back_alone::<MongoBackend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_retry_in_place_inside_a_batch() {
            crate::backends::batch::a_retry_in_place_inside_a_batch::<MongoBackend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn lost_acks_after_the_commit_are_duplicates() {
            crate::backends::batch::lost_acks_after_the_commit_are_duplicates::<MongoBackend>()
                .await
        }
    }
}

mod memory {
    crate::backends::scenarios::suite!(crate::backends::backend::MemoryBackend);
}
