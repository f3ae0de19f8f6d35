//! The connection: a single Redis or a Redis Cluster, and the mapping of
//! Redis errors to store errors.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, RedisError, RedisFuture, ServerErrorKind, Value};

use super::RedisOptions;
use crate::error::{StoreError, StoreErrorKind};

/// A connection to a single Redis (auto-reconnecting `ConnectionManager`) or
/// to a Redis Cluster; cheap to clone, shared by the clones.
#[derive(Clone)]
pub struct RedisConnection(pub(super) Conn);

#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Conn::Single(_) => "RedisConnection::Single",
            Conn::Cluster(_) => "RedisConnection::Cluster",
        })
    }
}

impl RedisConnection {
    /// Connects to one Redis at `url` (`redis://[user:pass@]host:port[/db]`).
    /// The connection reconnects by itself after an outage.
    pub async fn connect(url: &str, options: &RedisOptions) -> Result<Self, StoreError> {
        let client = crate::redis_client::client(url).map_err(StoreError::config)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connection_timeout))
            .set_response_timeout(Some(options.response_timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(map_err)?;
        Ok(Self(Conn::Single(manager)))
    }

    /// Connects to a Redis Cluster through any of its `nodes` (`redis://host:port`).
    pub async fn connect_cluster(
        nodes: &[&str],
        options: &RedisOptions,
    ) -> Result<Self, StoreError> {
        let client = redis::cluster::ClusterClient::builder(nodes.iter().copied())
            .connection_timeout(options.connection_timeout)
            .response_timeout(options.response_timeout)
            .build()
            .map_err(|e| StoreError::config(format!("bad Redis Cluster nodes: {e}")))?;
        let conn = client.get_async_connection().await.map_err(map_err)?;
        Ok(Self(Conn::Cluster(conn)))
    }
}

impl RedisConnection {
    /// Whether this is a connection to one Redis (not a Cluster), where
    /// keys of any slot go together in one script or pipeline.
    pub(super) fn is_single(&self) -> bool {
        matches!(self.0, Conn::Single(_))
    }

    /// `WAIT`s for `ack.replicas` replicas to acknowledge this connection's
    /// writes: on a single Redis on the shared connection that wrote them;
    /// on a Cluster at the master of `key`'s slot, or at every master (the
    /// fewest acknowledgements counting) when `key` is `None`. Fewer within
    /// the timeout is a transient error.
    pub(super) async fn wait_for_replicas(
        &self,
        key: Option<&str>,
        ack: &super::ReplicaAck,
    ) -> Result<(), StoreError> {
        let timeout_ms = u64::try_from(ack.timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut wait = redis::cmd("WAIT");
        wait.arg(ack.replicas).arg(timeout_ms);
        let acknowledged: i64 = match (&self.0, key) {
            (Conn::Cluster(conn), Some(key)) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = Route::with_key(key, SlotAddr::Master);
                let reply = conn
                    .clone()
                    .route_command(
                        wait,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    )
                    .await
                    .map_err(map_err)?;
                redis::from_redis_value(reply).map_err(|e| map_err(e.into()))?
            }
            _ => wait.query_async(&mut self.clone()).await.map_err(map_err)?,
        };
        if acknowledged < i64::from(ack.replicas) {
            return Err(StoreError::new(
                StoreErrorKind::Transient,
                format!(
                    "{acknowledged} of {} replicas acknowledged the write within {timeout_ms} ms (WAIT)",
                    ack.replicas
                ),
            ));
        }
        Ok(())
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.0 {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.0 {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.0 {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Maps a Redis error to a store error: transient when a retry may help.
pub(crate) fn map_err(e: RedisError) -> StoreError {
    let transient = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::ReadOnly
                )
        );
    let kind = if transient {
        StoreErrorKind::Transient
    } else {
        StoreErrorKind::Other
    };
    StoreError::new(kind, format!("redis: {e}")).with_source(e)
}
