//! Where messages come from (`consume`) and go to (`produce`): a JSON-lines
//! file, stdin/stdout, or a broker URL.

use std::fmt;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{Context, Result};
use async_trait::async_trait;
use idemq::source::jsonl::JsonLinesSource;
use idemq::source::registry::{self, Broker};
use idemq::source::{Publisher, Source};
use idemq::{KeySpec, Message, SourceError, SourceErrorKind};
use tokio::io::AsyncWriteExt;

/// A parsed source or destination.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// A JSON-lines file.
    File(PathBuf),
    /// `-`: stdin (consume) or stdout (produce).
    Std,
    /// A broker URL; the registry found its broker by the scheme.
    Broker {
        /// The broker.
        broker: &'static Broker,
        /// The URL as given.
        url: String,
    },
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::File(path) => write!(f, "{}", path.display()),
            Endpoint::Std => f.write_str("-"),
            Endpoint::Broker { url, .. } => f.write_str(&crate::backend::redact(url)),
        }
    }
}

impl FromStr for Endpoint {
    type Err = String;

    /// Only the scheme is looked at here: the URL itself is parsed when it
    /// is opened, so that clap never echoes a URL (and its password) back.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text == "-" {
            return Ok(Endpoint::Std);
        }
        match registry::lookup(text).map_err(|e| e.to_string())? {
            Some(broker) => Ok(Endpoint::Broker {
                broker,
                url: text.to_owned(),
            }),
            None => Ok(Endpoint::File(PathBuf::from(
                text.strip_prefix("file://").unwrap_or(text),
            ))),
        }
    }
}

/// The comma-separated `host[:port]` list after a URL's `scheme://` (user
/// info dropped), each with `default_port` where it names none.
fn hosts_of(rest: &str, default_port: u16) -> Vec<String> {
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let hosts = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts);
    hosts
        .split(',')
        .filter(|host| !host.is_empty())
        .map(|host| {
            let has_port = match host.rsplit_once(']') {
                Some((_, after)) => after.starts_with(':'),
                None => host.contains(':'),
            };
            if has_port {
                host.to_owned()
            } else {
                format!("{host}:{default_port}")
            }
        })
        .collect()
}

impl Endpoint {
    /// The broker behind the endpoint; `None` for files and `-`.
    pub fn broker(&self) -> Option<&'static Broker> {
        match self {
            Endpoint::Broker { broker, .. } => Some(broker),
            Endpoint::File(_) | Endpoint::Std => None,
        }
    }

    /// The `host:port` addresses whose reachability `/readyz` checks: the
    /// broker URL's hosts (the port defaulting to the scheme's), or for
    /// `sqs://` its `endpoint=`; `None` where there is nothing to probe (a
    /// file, stdin, SQS on AWS's own endpoint, reached through the SDK).
    pub fn probe_addresses(&self) -> Option<Vec<String>> {
        let Endpoint::Broker { url, .. } = self else {
            return None;
        };
        let (scheme, rest) = url.split_once("://")?;
        let scheme = scheme.to_ascii_lowercase();
        if scheme == "sqs" {
            let query = rest.split_once('?')?.1;
            let endpoint = query
                .split('&')
                .find_map(|pair| pair.strip_prefix("endpoint="))?;
            let endpoint = endpoint.replace("%3A", ":").replace("%2F", "/");
            let (inner, rest) = endpoint.split_once("://")?;
            let port = if inner.eq_ignore_ascii_case("https") {
                443
            } else {
                80
            };
            return Some(hosts_of(rest, port));
        }
        let port = match scheme.as_str() {
            "kafka" => 9092,
            "amqp" => 5672,
            "amqps" => 5671,
            "nats" => 4222,
            "redis-stream" => 6379,
            "mqtt" => 1883,
            "mqtts" => 8883,
            "rocketmq" => 9876,
            _ => return None,
        };
        Some(hosts_of(rest, port))
    }

    /// Whether offset-watermark mode (`--watermark`) can consume it.
    pub fn supports_watermarks(&self) -> bool {
        self.broker().is_some_and(|broker| broker.watermarks)
    }

    /// The key spec `consume` uses when `--key` is not given: the broker's
    /// default (Kafka's `event_id` header, else the record key; RocketMQ's
    /// message keys, else the producer's unique id); elsewhere the
    /// transport key, else the message id.
    pub fn default_key(&self) -> KeySpec {
        match self.broker() {
            Some(broker) => (broker.default_key)(),
            None => registry::transport_key_or_id(),
        }
    }

    /// Opens the endpoint as a source. Files keep a checkpoint next to them
    /// unless `no_checkpoint`.
    pub async fn open_source(
        &self,
        consumer: &str,
        no_checkpoint: bool,
        max_line_bytes: usize,
    ) -> Result<Box<dyn Source>> {
        match self {
            Endpoint::Std => {
                if std::io::stdin().is_terminal() {
                    eprintln!(
                        "idemq: reading JSON lines from the terminal (Ctrl-D ends the input)"
                    );
                }
                Ok(Box::new(
                    JsonLinesSource::stdin().max_line_bytes(max_line_bytes),
                ))
            }
            Endpoint::File(path) => {
                let checkpoint = (!no_checkpoint).then(|| checkpoint_path(path, consumer));
                let source = JsonLinesSource::open_with_checkpoint(path, checkpoint)
                    .await
                    .with_context(|| format!("opening {}", path.display()))?;
                Ok(Box::new(source.max_line_bytes(max_line_bytes)))
            }
            Endpoint::Broker { broker, url } => connected(self, (broker.open_source)(url)).await,
        }
    }

    /// Opens the endpoint as a destination for `produce`: files and stdout
    /// get JSON-lines envelopes, brokers get native messages.
    pub async fn open_publisher(&self) -> Result<Box<dyn Publisher>> {
        match self {
            Endpoint::Std => Ok(Box::new(EnvelopeWriter::stdout())),
            Endpoint::File(path) => Ok(Box::new(
                EnvelopeWriter::append(path)
                    .await
                    .with_context(|| format!("opening {}", path.display()))?,
            )),
            Endpoint::Broker { broker, url } => connected(self, (broker.open_publisher)(url)).await,
        }
    }
}

/// Waits for a broker client to connect: a bad URL is a usage error, a
/// failure to connect names the endpoint.
async fn connected<T>(
    endpoint: &Endpoint,
    connecting: impl std::future::Future<Output = Result<T, SourceError>>,
) -> Result<T> {
    connecting.await.map_err(|err| {
        if err.kind() == SourceErrorKind::Config {
            crate::exit::usage(err)
        } else {
            anyhow::Error::new(err).context(format!("connecting to {endpoint}"))
        }
    })
}

/// `<FILE>.<consumer>.checkpoint`, with characters unsafe in file names replaced.
pub fn checkpoint_path(input: &Path, consumer: &str) -> PathBuf {
    let safe: String = consumer
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let mut name = input.as_os_str().to_owned();
    name.push(format!(".{safe}.checkpoint"));
    PathBuf::from(name)
}

/// Writes messages as JSON-lines envelopes, which `consume` reads back
/// into the same messages.
pub struct EnvelopeWriter {
    out: tokio::sync::Mutex<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>,
}

impl EnvelopeWriter {
    fn stdout() -> Self {
        Self {
            out: tokio::sync::Mutex::new(Box::new(tokio::io::stdout())),
        }
    }

    async fn append(path: &Path) -> std::io::Result<Self> {
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .await?;
        Ok(Self {
            out: tokio::sync::Mutex::new(Box::new(file)),
        })
    }
}

/// The envelope of a message: `{"id","key","headers","payload"}`, with a JSON
/// payload kept as JSON and any other payload as a string.
pub fn envelope(message: &Message) -> serde_json::Value {
    let payload = std::str::from_utf8(&message.payload)
        .ok()
        .map(|text| {
            serde_json::from_str::<serde_json::Value>(text)
                .unwrap_or_else(|_| serde_json::Value::String(text.to_owned()))
        })
        .unwrap_or_else(|| {
            serde_json::Value::String(String::from_utf8_lossy(&message.payload).into_owned())
        });
    let mut env = serde_json::Map::new();
    if let Some(id) = &message.id {
        env.insert("id".into(), id.clone().into());
    }
    if let Some(key) = &message.key {
        env.insert("key".into(), key.clone().into());
    }
    if !message.headers.is_empty() {
        env.insert("headers".into(), message.headers.to_json());
    }
    env.insert("payload".into(), payload);
    serde_json::Value::Object(env)
}

#[async_trait]
impl Publisher for EnvelopeWriter {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let mut line = envelope(message).to_string();
        line.push('\n');
        self.out.lock().await.write_all(line.as_bytes()).await?;
        Ok(())
    }

    async fn flush(&self) -> Result<(), SourceError> {
        self.out.lock().await.flush().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_names() {
        assert_eq!(
            checkpoint_path(Path::new("/tmp/in.jsonl"), "payments"),
            PathBuf::from("/tmp/in.jsonl.payments.checkpoint")
        );
        assert_eq!(
            checkpoint_path(Path::new("in.jsonl"), "a/b c"),
            PathBuf::from("in.jsonl.a_b_c.checkpoint")
        );
    }

    #[test]
    fn endpoints() {
        assert!(matches!("-".parse::<Endpoint>(), Ok(Endpoint::Std)));
        assert!(matches!(
            "in.jsonl".parse::<Endpoint>(),
            Ok(Endpoint::File(_))
        ));
        assert!("ftp://x/y".parse::<Endpoint>().is_err());
    }

    #[test]
    fn probe_addresses_come_from_the_url_with_default_ports() {
        let probe = |url: &str| url.parse::<Endpoint>().unwrap().probe_addresses();
        assert_eq!(
            probe("kafka://k1:9093,k2/orders?group=g"),
            Some(vec!["k1:9093".into(), "k2:9092".into()])
        );
        assert_eq!(
            probe("amqps://u:p@rabbit/%2f?queue=q"),
            Some(vec!["rabbit:5671".into()])
        );
        assert_eq!(
            probe("mqtt://[::1]:1884/t?client_id=c"),
            Some(vec!["[::1]:1884".into()])
        );
        assert_eq!(
            probe("sqs://orders?endpoint=http://127.0.0.1:5000&region=us-east-1"),
            Some(vec!["127.0.0.1:5000".into()])
        );
        assert_eq!(probe("sqs://orders?region=eu-west-1"), None);
        assert_eq!(probe("in.jsonl"), None);
    }

    #[test]
    fn envelopes_round_trip_through_the_jsonl_parser() {
        let original = Message::new(r#"{"amount":5}"#)
            .with_id("m-1")
            .with_key("p-1")
            .with_header("event_id", "e-1");
        let line = envelope(&original).to_string();
        let parsed = idemq::source::jsonl::parse_message(line.as_bytes()).unwrap();
        assert_eq!(parsed, original);
        let text = Message::new("not json").with_id("m-2");
        let parsed =
            idemq::source::jsonl::parse_message(envelope(&text).to_string().as_bytes()).unwrap();
        assert_eq!(parsed.payload, b"not json");
    }
}
