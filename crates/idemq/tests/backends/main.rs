//! The same exactly-once scenarios against every store: real PostgreSQL,
//! MariaDB and SQLite servers/files, the in-memory lease store and (feature
//! `redis`) the Redis lease store, on one Redis and on a Redis Cluster.
//!
//! Every scenario applies messages to a ledger table that has **no** unique
//! constraint, so a message applied twice shows up as two rows.

mod backend;
mod batch;
mod scenarios;

#[cfg(feature = "mysql")]
mod mysql {
    crate::scenarios::suite!(crate::backend::SqlBackend<idemq::store::sql::mysql::MySqlStore>);
    crate::batch::batch_suite!(crate::backend::SqlBackend<idemq::store::sql::mysql::MySqlStore>);
}

#[cfg(feature = "postgres")]
mod postgres {
    crate::scenarios::suite!(
        crate::backend::SqlBackend<idemq::store::sql::postgres::PostgresStore>
    );
    crate::batch::batch_suite!(
        crate::backend::SqlBackend<idemq::store::sql::postgres::PostgresStore>
    );
}

#[cfg(feature = "sqlite")]
mod sqlite {
    crate::scenarios::suite!(crate::backend::SqlBackend<idemq::store::sql::sqlite::SqliteStore>);
    crate::batch::batch_suite!(crate::backend::SqlBackend<idemq::store::sql::sqlite::SqliteStore>);
}

#[cfg(feature = "redis")]
mod redis {
    crate::scenarios::suite!(crate::backend::RedisBackend);

    /// Batch mode over the Redis lease store keeps the order per key
    /// across batches in flight, as the SQL batch suite checks for SQL.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_first_copy_in_order_wins_across_lease_batches() {
        crate::scenarios::first_copies_win::<crate::backend::RedisBackend>(8, |consumer, queue| {
            Box::pin(async move {
                let options =
                    idemq::engine::BatchOptions::new(20, std::time::Duration::from_millis(5));
                consumer.run_batched(queue.source(), options).await
            })
        })
        .await
    }
}

/// The same scenarios on a Redis Cluster (three masters, three replicas:
/// `scripts/redis-cluster.sh`): keys spread over the masters' slots.
#[cfg(feature = "redis")]
mod redis_cluster {
    crate::scenarios::suite!(crate::backend::RedisClusterBackend);

    /// Batch mode on a cluster, where each key's scripts go to its own
    /// slot's master: the order per key still holds across batches.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_first_copy_in_order_wins_across_lease_batches() {
        crate::scenarios::first_copies_win::<crate::backend::RedisClusterBackend>(
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

mod memory {
    crate::scenarios::suite!(crate::backend::MemoryBackend);
}
