//! The same exactly-once scenarios against every store: real PostgreSQL,
//! MariaDB and SQLite servers/files, the in-memory lease store and (feature
//! `redis`) the Redis lease store.
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
}

mod memory {
    crate::scenarios::suite!(crate::backend::MemoryBackend);
}
