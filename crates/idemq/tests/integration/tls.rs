//! The SQL stores over TLS, verified against the certificates the local
//! services were started with (`scripts/services.sh` writes them to
//! `$IDEMQ_TOOLS/postgres/root.crt` and `$IDEMQ_TOOLS/mariadb/root.crt`):
//! PostgreSQL with `sslmode=verify-full&sslrootcert=…` and MariaDB with
//! `ssl-mode=VERIFY_IDENTITY&ssl-ca=…`, each running duplicates through a
//! consumer exactly once on connections the server reports as encrypted. A
//! server certificate that does not verify is refused with a configuration
//! error; without TLS the same check reports a plain connection. The Redis
//! store over `rediss://` with `cacert` on the local Redis's TLS port; Redis
//! Streams with `cacert`; NATS JetStream over TLS with a password, an nkey
//! or a token, against `nats-server`s this file starts with the local
//! certificate (`$IDEMQ_TOOLS/nats/root.crt`); MQTT over `mqtts://` against
//! a Mosquitto this file starts; RabbitMQ over `amqps://` on the local
//! RabbitMQ's TLS port; Kafka over SASL_SSL (PLAIN and SCRAM) and mutual
//! TLS on the local broker's TLS listeners (`scripts/kafka.sh`); RocketMQ
//! with ACL credentials on the local broker with authentication
//! (`scripts/rocketmq.sh`).
#![cfg(all(feature = "postgres", feature = "mysql"))]

use crate::support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::support::{workload, Ledger, Plan};
use idemq::source::queue::MemoryQueue;
use idemq::store::sql::mysql::{MySqlStore, MySqlTx};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::SqlOptions;
use idemq::store::StoreAdmin;
use idemq::{handler_fn, Consumer, HandlerError, KeySpec, OutcomeKind, StoreErrorKind};

/// Where the scripts keep the services' files.
fn tools() -> PathBuf {
    std::env::var_os("IDEMQ_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".idemq-tools")
        })
}

/// The CA that signed `service`'s certificate (it is self-signed).
fn root_cert(service: &str) -> String {
    let path = tools().join(service).join("root.crt");
    assert!(
        path.exists(),
        "{} is missing: run scripts/services.sh",
        path.display()
    );
    path.display().to_string()
}

/// The client certificate and key the scripts made for `service`, signed
/// by the CA of its server's certificate (CN `idemq-client`).
fn client_cert(service: &str) -> (String, String) {
    let dir = tools().join(service);
    let cert = dir.join("client.crt");
    assert!(
        cert.exists(),
        "{} is missing: run scripts/services.sh",
        cert.display()
    );
    (
        cert.display().to_string(),
        dir.join("client.key").display().to_string(),
    )
}

/// PostgreSQL on `localhost` (the certificate's name), verifying it with `ca`.
fn postgres_verified(ca: &str) -> String {
    format!("postgres://postgres@localhost:5432/test?sslmode=verify-full&sslrootcert={ca}")
}

/// MariaDB on `localhost`, verifying its certificate and name with `ca`.
fn mariadb_verified(ca: &str) -> String {
    format!("mysql://root@localhost:3306/test?ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}")
}

/// Handler calls per key.
type Calls = Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>;

/// A handler over lease `Tx` that counts its calls per key in `calls`.
#[cfg(any(
    feature = "redis",
    feature = "nats",
    feature = "mqtt",
    feature = "amqp"
))]
fn counting<Tx: Send + 'static>(calls: &Calls) -> impl idemq::Handler<Tx> {
    let calls = Arc::clone(calls);
    handler_fn(move |ctx, _lease: &mut Tx| {
        *calls.lock().unwrap().entry(ctx.key.to_owned()).or_default() += 1;
        Box::pin(async { Ok(None) })
    })
}

/// Every one of `expected` keys was handled, each exactly once.
#[cfg(any(
    feature = "redis",
    feature = "nats",
    feature = "mqtt",
    feature = "amqp"
))]
fn assert_each_once(calls: &Calls, expected: usize) {
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), expected, "{calls:?}");
    assert!(
        calls.values().all(|&n| n == 1),
        "a payment handled twice: {calls:?}"
    );
}

/// A closed in-memory queue holding `messages`.
fn queue_of(messages: &[idemq::Message]) -> MemoryQueue {
    let queue = MemoryQueue::new("tls");
    for m in messages {
        queue.push(m.clone());
    }
    queue.close();
    queue
}

async fn postgres_encrypted(store: &PostgresStore) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .expect("read pg_stat_ssl")
}

async fn mariadb_cipher(store: &MySqlStore) -> String {
    let (_, cipher): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .fetch_one(store.pool())
        .await
        .expect("read Ssl_cipher");
    cipher
}

/// Duplicated payments through the PostgreSQL store at `url`, over a
/// connection the server reports encrypted: each effect applied once.
async fn postgres_round(url: &str) {
    let ledger = Ledger::at(url).await;
    assert!(
        postgres_encrypted(&ledger.store).await,
        "the connection is not encrypted"
    );

    let w = workload(20, 0);
    let queue = queue_of(&w.messages);
    let consumer = ledger
        .consumer("tls", Arc::new(Plan::default()))
        .concurrency(4)
        .build()
        .unwrap();
    let summary = consumer.run(queue.source()).await.unwrap();
    assert_eq!(
        summary.count(OutcomeKind::Processed) as usize,
        w.expected.len(),
        "{summary}"
    );
    ledger.assert_exactly_once(&w.expected).await;
    ledger.cleanup().await;
}

#[tokio::test]
async fn postgres_verify_full_applies_each_effect_once() {
    postgres_round(&postgres_verified(&root_cert("postgres"))).await;

    // The check can tell: without TLS the server reports a plain connection.
    let plain = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
        .await
        .unwrap();
    assert!(!postgres_encrypted(&plain).await);
}

/// PostgreSQL role `idemq-client`, which the local server lets in only with
/// a client certificate of its CA (`cert` in pg_hba.conf): with
/// `sslcert`/`sslkey`, each effect applied once; without them, refused.
#[tokio::test]
async fn postgres_with_a_client_certificate_applies_each_effect_once() {
    let (cert, key) = client_cert("postgres");
    let url = format!(
        "postgres://idemq-client@localhost:5432/test?sslmode=verify-full&sslrootcert={}",
        root_cert("postgres")
    );
    postgres_round(&format!("{url}&sslcert={cert}&sslkey={key}")).await;
    let refused = PostgresStore::connect(&url).await;
    assert!(refused.is_err(), "connected without a client certificate");
}

#[tokio::test]
async fn mariadb_verify_identity_applies_each_effect_once() {
    mariadb_round(&mariadb_verified(&root_cert("mariadb"))).await;
}

/// MariaDB user `idemq-client`, which logs in only with a client certificate
/// of the local CA (`REQUIRE SUBJECT '/CN=idemq-client'`): with
/// `ssl-cert`/`ssl-key`, each effect applied once; without them, refused.
#[tokio::test]
async fn mariadb_with_a_client_certificate_applies_each_effect_once() {
    let (cert, key) = client_cert("mariadb");
    let url = format!(
        "mysql://idemq-client@localhost:3306/test?ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
        root_cert("mariadb")
    );
    mariadb_round(&format!("{url}&ssl-cert={cert}&ssl-key={key}")).await;
    let refused = MySqlStore::connect(&url).await;
    assert!(refused.is_err(), "connected without a client certificate");
}

/// Duplicated payments through the MariaDB store at `url`, over a
/// connection the server reports encrypted: each effect applied once.
async fn mariadb_round(url: &str) {
    let prefix = format!("{}_", support::unique("tls"));
    let store = MySqlStore::connect_with(url, SqlOptions::default().table_prefix(&prefix))
        .await
        .expect("connect to MariaDB over verified TLS");
    store.migrate().await.unwrap();
    assert!(
        !mariadb_cipher(&store).await.is_empty(),
        "the connection is not encrypted"
    );
    let ledger = format!("{prefix}ledger");
    sqlx::query(&format!(
        "CREATE TABLE {ledger} (seq BIGINT AUTO_INCREMENT PRIMARY KEY, msg_key VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)"
    ))
    .execute(store.pool())
    .await
    .unwrap();

    let w = workload(20, 0);
    let queue = queue_of(&w.messages);
    let insert: Arc<str> = format!("INSERT INTO {ledger} (msg_key, amount) VALUES (?, ?)").into();
    let consumer = Consumer::builder("tls", store.clone())
        .key(KeySpec::json("/payment_id"))
        .concurrency(4)
        .handler(handler_fn(move |ctx, tx: &mut MySqlTx| {
            let insert = Arc::clone(&insert);
            Box::pin(async move {
                let payload: serde_json::Value =
                    ctx.message.json().map_err(HandlerError::permanent)?;
                sqlx::query(&insert)
                    .bind(ctx.key)
                    .bind(payload["amount"].as_i64().unwrap_or_default())
                    .execute(&mut **tx)
                    .await?;
                Ok(None)
            })
        }))
        .build()
        .unwrap();
    let summary = consumer.run(queue.source()).await.unwrap();
    assert_eq!(
        summary.count(OutcomeKind::Processed) as usize,
        w.expected.len(),
        "{summary}"
    );
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT msg_key, amount FROM {ledger} ORDER BY msg_key"
    ))
    .fetch_all(store.pool())
    .await
    .unwrap();
    let expected: Vec<(String, i64)> = w.expected.clone().into_iter().collect();
    assert_eq!(rows, expected, "every effect exactly once");
    for table in support::TEST_TABLES {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {prefix}{table}"))
            .execute(store.pool())
            .await;
    }
}

#[tokio::test]
async fn a_certificate_that_does_not_verify_is_refused() {
    // Each server's certificate checked against the other's: neither verifies.
    let postgres = PostgresStore::connect(&postgres_verified(&root_cert("mariadb"))).await;
    let err = postgres.expect_err("PostgreSQL with a foreign CA");
    assert_eq!(err.kind(), StoreErrorKind::Config, "{err:?}");
    let mariadb = MySqlStore::connect(&mariadb_verified(&root_cert("postgres"))).await;
    let err = mariadb.expect_err("MariaDB with a foreign CA");
    assert_eq!(err.kind(), StoreErrorKind::Config, "{err:?}");
}

/// The Redis lease store over `rediss://` on the TLS port of the local
/// Redis, verified against its CA (`cacert`): duplicated payments, each
/// handled once. The same server checked against another CA is refused.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_rediss_with_cacert_handles_each_payment_once() {
    use idemq::store::redis::{RedisLease, RedisOptions, RedisStore};

    let url = |ca: &str| format!("rediss://localhost:6380/?cacert={ca}");
    let store = RedisStore::connect_with(
        &url(&root_cert("redis")),
        RedisOptions::default().prefix(support::unique("tls")),
    )
    .await
    .expect("connect to Redis over verified TLS");
    let w = workload(20, 0);
    let calls = Calls::default();
    let consumer = Consumer::builder("tls", store)
        .key(KeySpec::json("/payment_id"))
        .concurrency(4)
        .handler(counting::<RedisLease>(&calls))
        .build()
        .unwrap();
    let summary = consumer.run(queue_of(&w.messages).source()).await.unwrap();
    assert_eq!(
        summary.count(OutcomeKind::Processed) as usize,
        w.expected.len(),
        "{summary}"
    );
    assert_each_once(&calls, w.expected.len());

    let foreign = RedisStore::connect_with(
        &url(&root_cert("postgres")),
        RedisOptions::default().timeouts(Duration::from_secs(2), Duration::from_secs(2)),
    )
    .await;
    assert!(foreign.is_err(), "a foreign CA was accepted");
}

/// The Redis lease store showing a client certificate (`cert`/`key`) to the
/// local Redis, which verifies any it is shown: each payment handled once
/// with its own CA's certificate; one of another CA is refused.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_with_a_client_certificate_handles_each_payment_once() {
    use idemq::store::redis::{RedisLease, RedisOptions, RedisStore};

    let url = |(cert, key): (String, String)| {
        format!(
            "rediss://localhost:6380/?cacert={}&cert={cert}&key={key}",
            root_cert("redis")
        )
    };
    let store = RedisStore::connect_with(
        &url(client_cert("redis")),
        RedisOptions::default().prefix(support::unique("tls")),
    )
    .await
    .expect("connect to Redis with a client certificate");
    let w = workload(12, 0);
    let calls = Calls::default();
    let consumer = Consumer::builder("tls", store)
        .key(KeySpec::json("/payment_id"))
        .handler(counting::<RedisLease>(&calls))
        .build()
        .unwrap();
    consumer.run(queue_of(&w.messages).source()).await.unwrap();
    assert_each_once(&calls, w.expected.len());

    let foreign = RedisStore::connect_with(
        &url(client_cert("postgres")),
        RedisOptions::default().timeouts(Duration::from_secs(2), Duration::from_secs(2)),
    )
    .await;
    assert!(
        foreign.is_err(),
        "a client certificate of a foreign CA was accepted"
    );
}

/// The Redis Streams source and publisher over TLS (`cacert` in a
/// `redis-stream://` URL, then with a client certificate too): duplicated
/// payments published and consumed through the TLS port, each handled
/// once, and the stream removed.
#[cfg(all(feature = "redis", feature = "redis-streams"))]
#[tokio::test]
async fn redis_streams_over_tls_delivers_each_payment_once() {
    let stream = support::unique("tls");
    let url = format!(
        "redis-stream://localhost:6380/{stream}?group=g&cacert={}",
        root_cert("redis")
    );
    tls_round(&url).await;
    let (cert, key) = client_cert("redis");
    tls_round(&format!("{url}&cert={cert}&key={key}")).await;
}

/// A broker process this file starts on a free loopback port, with its
/// files in a temporary directory; killed when dropped.
#[cfg(any(feature = "nats", feature = "mqtt"))]
struct Spawned {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

#[cfg(any(feature = "nats", feature = "mqtt"))]
impl Spawned {
    /// A free port and a directory for a broker about to start.
    fn prepare() -> (u16, tempfile::TempDir) {
        (
            support::free_port(),
            tempfile::tempdir().expect("a temporary directory"),
        )
    }

    /// Runs `program` with `args` and waits until it listens on `port`.
    async fn start(
        program: &str,
        args: &[&std::ffi::OsStr],
        port: u16,
        dir: tempfile::TempDir,
    ) -> Self {
        let child = std::process::Command::new(program)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {program} (scripts/services.sh installs it): {e}"));
        let spawned = Self {
            child,
            port,
            _dir: dir,
        };
        let started = std::time::Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "{program} did not start"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        spawned
    }
}

#[cfg(any(feature = "nats", feature = "mqtt"))]
impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The local certificate and key made for `service` by the scripts.
#[cfg(any(feature = "nats", feature = "mqtt"))]
fn server_cert(service: &str) -> (PathBuf, PathBuf) {
    let tls = tools().join(service).join("tls");
    assert!(
        tls.join("server.crt").exists(),
        "{} is missing: run scripts/services.sh",
        tls.display()
    );
    (tls.join("server.crt"), tls.join("server.key"))
}

/// A `nats-server` with JetStream serving TLS with the local certificate
/// and the given `authorization { … }` block; asking every client for a
/// certificate of the local CA when `verify_clients`.
#[cfg(feature = "nats")]
async fn nats_server(authorization: &str, verify_clients: bool) -> Spawned {
    let (cert, key) = server_cert("nats");
    let (port, dir) = Spawned::prepare();
    let conf = dir.path().join("nats.conf");
    let verify = if verify_clients {
        format!(", ca_file: \"{}\", verify: true", root_cert("nats"))
    } else {
        String::new()
    };
    let text = format!(
        "listen: 127.0.0.1:{port}\n\
         jetstream {{ store_dir: \"{store}\" }}\n\
         tls {{ cert_file: \"{cert}\", key_file: \"{key}\"{verify} }}\n\
         authorization {{ {authorization} }}\n",
        store = dir.path().join("js").display(),
        cert = cert.display(),
        key = key.display(),
    );
    std::fs::write(&conf, text).expect("write nats.conf");
    Spawned::start("nats-server", &["-c".as_ref(), conf.as_os_str()], port, dir).await
}

/// A `nats://` URL of a fresh stream on `server`, with `auth` before the
/// host and `params` after the stream's own.
#[cfg(feature = "nats")]
fn nats_url(server: &Spawned, auth: &str, params: &str) -> String {
    let run = support::unique("tls");
    format!(
        "nats://{auth}localhost:{}/{run}/{run}_c?subject={run}.in&create=true&wait=1s{params}",
        server.port
    )
}

/// Duplicated payments published and consumed over broker `url`, each
/// handled once; what the URL created is removed.
#[cfg(any(
    feature = "nats",
    feature = "mqtt",
    feature = "amqp",
    feature = "redis-streams",
    feature = "kafka",
    feature = "rocketmq"
))]
async fn tls_round(url: &str) {
    use idemq::source::registry;
    use idemq::store::memory::{Lease, MemoryStore};

    let broker = registry::lookup(url)
        .unwrap()
        .expect("the broker is registered");
    let open_source = || async {
        (broker.open_source)(url)
            .await
            .unwrap_or_else(|e| panic!("source on {url}: {e}"))
    };
    // Subscribe first where the broker keeps only what arrives afterwards.
    let early = if broker.subscribe_before_publish {
        Some(open_source().await)
    } else {
        None
    };
    let publisher = (broker.open_publisher)(url)
        .await
        .unwrap_or_else(|e| panic!("publisher on {url}: {e}"));
    let w = workload(12, 0);
    support::publish_all(&*publisher, &w.messages).await;
    let source = match early {
        Some(source) => source,
        None => open_source().await,
    };
    let calls = Calls::default();
    let consumer = Consumer::builder("tls", MemoryStore::new())
        .key(KeySpec::json("/payment_id"))
        .handler(counting::<Lease>(&calls))
        .build()
        .unwrap();
    let expected = w.expected.len();
    support::run_until(&consumer, source, Duration::from_secs(30), || {
        calls.lock().unwrap().len() == expected
    })
    .await;
    assert_each_once(&calls, expected);
    (broker.remove)(url)
        .await
        .expect("remove what the URL created");
}

/// Opening a source on `url` fails with a configuration error that does not
/// show `secret`.
#[cfg(any(
    feature = "nats",
    feature = "mqtt",
    feature = "amqp",
    feature = "redis-streams",
    feature = "kafka",
    feature = "rocketmq"
))]
async fn assert_refused(url: &str, secret: &str) {
    let broker = idemq::source::registry::lookup(url).unwrap().unwrap();
    let err = match (broker.open_source)(url).await {
        Ok(_) => panic!("{secret}: connected"),
        Err(e) => e,
    };
    assert_eq!(err.kind(), idemq::SourceErrorKind::Config, "{err}");
    assert!(!format!("{err} {err:?}").contains(secret), "{err:?}");
}

/// NATS over TLS with each kind of credential the NATS tools take — a user
/// and password, an nkey seed file, a token — verified against the local
/// CA: every payment handled once, also with a client certificate to a
/// server that asks for one. A wrong password, an unknown CA, a wrong token
/// and a missing client certificate are configuration errors that do not
/// show the secret.
#[cfg(feature = "nats")]
#[tokio::test]
async fn nats_over_tls_with_a_password_an_nkey_or_a_token_delivers_once() {
    let ca = format!("&tls=true&cacert={}", root_cert("nats"));
    let user = nkeys::KeyPair::new_user();
    let seed_dir = tempfile::tempdir().unwrap();
    let seed_file = seed_dir.path().join("user.nk");
    std::fs::write(&seed_file, user.seed().unwrap()).unwrap();
    let users = nats_server(
        &format!(
            "users = [ {{ user: idemq, password: \"pw-s3cret\" }}, {{ nkey: {} }} ]",
            user.public_key()
        ),
        false,
    )
    .await;
    tls_round(&nats_url(&users, "idemq:pw-s3cret@", &ca)).await;
    tls_round(&nats_url(
        &users,
        "",
        &format!("{ca}&nkey={}", seed_file.display()),
    ))
    .await;

    assert_refused(
        &nats_url(&users, "idemq:wrong-s3cret@", &ca),
        "wrong-s3cret",
    )
    .await;
    let foreign_ca = format!("&tls=true&cacert={}", root_cert("redis"));
    assert_refused(
        &nats_url(&users, "idemq:pw-s3cret@", &foreign_ca),
        "pw-s3cret",
    )
    .await;
    drop(users);

    let token = nats_server("token: \"tok-s3cret\"", false).await;
    tls_round(&nats_url(&token, "tok-s3cret@", &ca)).await;
    assert_refused(&nats_url(&token, "tok-wrong@", &ca), "tok-wrong").await;
    drop(token);

    let mutual = nats_server("token: \"tok-s3cret\"", true).await;
    let (cert, key) = client_cert("nats");
    let identity = format!("{ca}&cert={cert}&key={key}");
    tls_round(&nats_url(&mutual, "tok-s3cret@", &identity)).await;
    assert_refused(&nats_url(&mutual, "tok-s3cret@", &ca), "tok-s3cret").await;
}

/// A Mosquitto with one TLS listener (the local certificate) that takes
/// only user `idemq` with password `pw-s3cret`.
#[cfg(feature = "mqtt")]
async fn mosquitto_tls(require_certificate: bool) -> Spawned {
    let (cert, key) = server_cert("mosquitto");
    let (port, dir) = Spawned::prepare();
    let passwords = dir.path().join("passwords");
    let made = std::process::Command::new("mosquitto_passwd")
        .args(["-b", "-c"])
        .arg(&passwords)
        .args(["idemq", "pw-s3cret"])
        .status()
        .expect("run mosquitto_passwd");
    assert!(made.success(), "mosquitto_passwd failed");
    let user = std::env::var("USER").unwrap_or_else(|_| "root".into());
    let conf = dir.path().join("mosquitto.conf");
    let text = format!(
        "listener {port} 127.0.0.1\n\
         certfile {cert}\n\
         keyfile {key}\n\
         allow_anonymous false\n\
         password_file {passwords}\n\
         persistence false\n\
         user {user}\n\
         {mutual}",
        cert = cert.display(),
        key = key.display(),
        passwords = passwords.display(),
        mutual = if require_certificate {
            format!(
                "cafile {}\nrequire_certificate true\n",
                root_cert("mosquitto")
            )
        } else {
            String::new()
        },
    );
    std::fs::write(&conf, text).expect("write mosquitto.conf");
    Spawned::start("mosquitto", &["-c".as_ref(), conf.as_os_str()], port, dir).await
}

/// MQTT over TLS (`mqtts://` with `cacert`) with a user and password:
/// every payment handled once. A wrong password and an unknown CA are
/// configuration errors that do not show the secret.
#[cfg(feature = "mqtt")]
#[tokio::test]
async fn mqtts_with_a_password_delivers_once() {
    let broker = mosquitto_tls(false).await;
    let url = |auth: &str, ca: &str| {
        let run = support::unique("tls");
        format!(
            "mqtts://{auth}localhost:{}/{run}/orders?client_id={run}&cacert={ca}",
            broker.port
        )
    };
    let ca = root_cert("mosquitto");
    tls_round(&url("idemq:pw-s3cret@", &ca)).await;
    assert_refused(&url("idemq:wrong-s3cret@", &ca), "wrong-s3cret").await;
    assert_refused(&url("idemq:pw-s3cret@", &root_cert("redis")), "pw-s3cret").await;
}

/// MQTT over mutual TLS: a Mosquitto that requires a client certificate of
/// the local CA takes `cert`/`key` (every payment handled once) and refuses
/// a client without one.
#[cfg(feature = "mqtt")]
#[tokio::test]
async fn mqtts_with_a_client_certificate_delivers_once() {
    let broker = mosquitto_tls(true).await;
    let url = |params: &str| {
        let run = support::unique("tls");
        format!(
            "mqtts://idemq:pw-s3cret@localhost:{}/{run}/orders?client_id={run}&cacert={}{params}",
            broker.port,
            root_cert("mosquitto")
        )
    };
    let (cert, key) = client_cert("mosquitto");
    tls_round(&url(&format!("&cert={cert}&key={key}"))).await;
    assert_refused(&url(""), "pw-s3cret").await;
}

/// RabbitMQ over TLS (`amqps://` with `cacert`, the local RabbitMQ's TLS
/// port): every payment handled once, also with a client certificate. A
/// wrong password and an unknown CA are configuration errors that do not
/// show the password; a client certificate of a foreign CA is refused.
#[cfg(feature = "amqp")]
#[tokio::test]
async fn amqps_with_cacert_delivers_once() {
    let url = |password: &str, ca: &str| {
        let run = support::unique("tls");
        format!("amqps://guest:{password}@localhost:5671/%2f?queue={run}&cacert={ca}")
    };
    let ca = root_cert("rabbitmq");
    tls_round(&url("guest", &ca)).await;
    assert_refused(&url("wrong-s3cret", &ca), "wrong-s3cret").await;
    assert_refused(&url("guest", &root_cert("redis")), ":guest@").await;

    // The local RabbitMQ verifies a client certificate it is shown.
    let (cert, key) = client_cert("rabbitmq");
    tls_round(&format!("{}&cert={cert}&key={key}", url("guest", &ca))).await;
    // Refused by the server during or right after the handshake: an alert
    // or a reset, depending on timing, so only the refusal is certain.
    let (cert, key) = client_cert("redis");
    let foreign = format!("{}&certfile={cert}&keyfile={key}", url("guest", &ca));
    let broker = idemq::source::registry::lookup(&foreign).unwrap().unwrap();
    match (broker.open_source)(&foreign).await {
        Ok(_) => panic!("a client certificate of a foreign CA was accepted"),
        Err(e) => assert!(!format!("{e} {e:?}").contains(":guest@"), "{e:?}"),
    }
}

/// A `kafka://` URL of a fresh two-partition topic on the local broker's
/// listener `port` (a certificate for `localhost`), with `params` after the
/// topic's own.
#[cfg(feature = "kafka")]
fn kafka_url(port: u16, params: &str) -> String {
    let run = support::unique("tls");
    format!("kafka://localhost:{port}/{run}?group={run}&create_partitions=2{params}")
}

/// Kafka over SASL_SSL with each mechanism the local broker offers (PLAIN,
/// SCRAM-SHA-256, SCRAM-SHA-512), verified against the local CA: every
/// payment handled once. A wrong password and an unknown CA are
/// configuration errors that do not show the secret.
#[cfg(feature = "kafka")]
#[tokio::test]
async fn kafka_over_sasl_ssl_with_plain_or_scram_delivers_once() {
    let sasl = |mechanism: &str, password: &str, ca: &str| {
        kafka_url(
            9094,
            &format!(
                "&security.protocol=SASL_SSL&sasl.mechanism={mechanism}\
                 &sasl.username=idemq&sasl.password={password}&ssl.ca.location={ca}"
            ),
        )
    };
    let ca = root_cert("kafka");
    for mechanism in ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] {
        tls_round(&sasl(mechanism, "idemq-secret", &ca)).await;
    }
    assert_refused(&sasl("SCRAM-SHA-512", "wrong-s3cret", &ca), "wrong-s3cret").await;
    assert_refused(
        &sasl("PLAIN", "idemq-secret", &root_cert("redis")),
        "idemq-secret",
    )
    .await;
}

/// Kafka over mutual TLS (`security.protocol=SSL` with a client
/// certificate, the listener that asks for one): every payment handled
/// once; without the client certificate the connection is refused with a
/// configuration error.
#[cfg(feature = "kafka")]
#[tokio::test]
async fn kafka_over_mutual_tls_delivers_once() {
    let (cert, key) = client_cert("kafka");
    let ca = format!(
        "&security.protocol=SSL&ssl.ca.location={}",
        root_cert("kafka")
    );
    let identity = format!("&ssl.certificate.location={cert}&ssl.key.location={key}");
    tls_round(&kafka_url(9095, &format!("{ca}{identity}"))).await;
    assert_refused(&kafka_url(9095, &ca), "client.key").await;
}

/// RocketMQ with ACL credentials (the access key and secret key as the
/// URL's user and password) on the local broker with authentication: every
/// payment handled once. A wrong secret key, an unknown access key and no
/// credentials at all are configuration errors when the consumer starts
/// that do not show the secret.
#[cfg(feature = "rocketmq")]
#[tokio::test]
async fn rocketmq_with_acl_credentials_delivers_once() {
    let topic = support::unique("tls").replace('-', "_");
    let url = |auth: &str| format!("rocketmq://{auth}127.0.0.1:9877/{topic}?group={topic}_g");
    tls_round(&url("idemq:idemq-secret@")).await;
    assert_refused(&url("idemq:wrong-s3cret@"), "wrong-s3cret").await;
    assert_refused(&url("stranger:idemq-secret@"), "idemq-secret").await;
    assert_refused(&url(""), "idemq-secret").await;
}
