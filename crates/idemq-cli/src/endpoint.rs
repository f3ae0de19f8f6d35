//! Where messages come from (`consume`) and go to (`produce`): a JSON-lines
//! file, stdin/stdout, or a broker URL.

use std::fmt;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{Context, Result};
use async_trait::async_trait;
use idemq::source::jsonl::JsonLinesSource;
use idemq::source::{Publisher, Source};
use idemq::{KeySpec, Message, SourceError};
use tokio::io::AsyncWriteExt;

/// A parsed source or destination.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// A JSON-lines file.
    File(PathBuf),
    /// `-`: stdin (consume) or stdout (produce).
    Std,
    /// `kafka://host:port/topic?group=NAME`.
    #[cfg(feature = "kafka")]
    Kafka(String),
    /// `amqp://user:pass@host:port/vhost?queue=NAME`.
    #[cfg(feature = "amqp")]
    Amqp(String),
    /// `sqs://queue?endpoint=…&region=…`.
    #[cfg(feature = "sqs")]
    Sqs(String),
    /// `nats://host:4222/STREAM/CONSUMER?subject=…`.
    #[cfg(feature = "nats")]
    Nats(String),
    /// `redis-stream://host:6379/STREAM?group=NAME`.
    #[cfg(feature = "redis-streams")]
    RedisStream(String),
    /// `mqtt://host:1883/TOPIC?client_id=ID`.
    #[cfg(feature = "mqtt")]
    Mqtt(String),
    /// `rocketmq://namesrv:9876/TOPIC?group=NAME`.
    #[cfg(feature = "rocketmq")]
    RocketMq(String),
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::File(path) => write!(f, "{}", path.display()),
            Endpoint::Std => f.write_str("-"),
            #[cfg(feature = "kafka")]
            Endpoint::Kafka(url) => f.write_str(url),
            #[cfg(feature = "amqp")]
            Endpoint::Amqp(url) => f.write_str(&crate::backend::redact(url)),
            #[cfg(feature = "sqs")]
            Endpoint::Sqs(url) => f.write_str(url),
            #[cfg(feature = "nats")]
            Endpoint::Nats(url) => f.write_str(&crate::backend::redact(url)),
            #[cfg(feature = "redis-streams")]
            Endpoint::RedisStream(url) => f.write_str(&crate::backend::redact(url)),
            #[cfg(feature = "mqtt")]
            Endpoint::Mqtt(url) => f.write_str(&crate::backend::redact(url)),
            #[cfg(feature = "rocketmq")]
            Endpoint::RocketMq(url) => f.write_str(url),
        }
    }
}

impl FromStr for Endpoint {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text == "-" {
            return Ok(Endpoint::Std);
        }
        let Some((scheme, _)) = text.split_once("://") else {
            return Ok(Endpoint::File(PathBuf::from(text)));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "kafka" => {
                #[cfg(feature = "kafka")]
                return Ok(Endpoint::Kafka(text.to_owned()));
                #[cfg(not(feature = "kafka"))]
                return Err(crate::backend::compiled_out("Kafka", "kafka"));
            }
            "amqp" | "amqps" => {
                #[cfg(feature = "amqp")]
                return Ok(Endpoint::Amqp(text.to_owned()));
                #[cfg(not(feature = "amqp"))]
                return Err(crate::backend::compiled_out("RabbitMQ", "amqp"));
            }
            "sqs" => {
                #[cfg(feature = "sqs")]
                return Ok(Endpoint::Sqs(text.to_owned()));
                #[cfg(not(feature = "sqs"))]
                return Err(crate::backend::compiled_out("SQS", "sqs"));
            }
            "nats" => {
                #[cfg(feature = "nats")]
                return Ok(Endpoint::Nats(text.to_owned()));
                #[cfg(not(feature = "nats"))]
                return Err(crate::backend::compiled_out("NATS", "nats"));
            }
            "redis-stream" => {
                #[cfg(feature = "redis-streams")]
                return Ok(Endpoint::RedisStream(text.to_owned()));
                #[cfg(not(feature = "redis-streams"))]
                return Err(crate::backend::compiled_out("Redis Streams", "redis-streams"));
            }
            "mqtt" => {
                #[cfg(feature = "mqtt")]
                return Ok(Endpoint::Mqtt(text.to_owned()));
                #[cfg(not(feature = "mqtt"))]
                return Err(crate::backend::compiled_out("MQTT", "mqtt"));
            }
            "rocketmq" => {
                #[cfg(feature = "rocketmq")]
                return Ok(Endpoint::RocketMq(text.to_owned()));
                #[cfg(not(feature = "rocketmq"))]
                return Err(crate::backend::compiled_out("RocketMQ", "rocketmq"));
            }
            "file" => Ok(Endpoint::File(PathBuf::from(&text["file://".len()..]))),
            other => Err(format!(
                "unknown scheme {other:?}: expected a file path, `-`, kafka://, amqp://, sqs://, nats://, \
                 redis-stream://, mqtt:// or rocketmq://"
            )),
        }
    }
}

impl Endpoint {
    /// The key spec `consume` uses when `--key` is not given: Kafka's
    /// `event_id` header, else the record key; RocketMQ's message keys, else
    /// the producer's unique id; elsewhere the transport key, else the
    /// message id.
    pub fn default_key(&self) -> KeySpec {
        match self {
            #[cfg(feature = "kafka")]
            Endpoint::Kafka(_) => idemq::source::kafka::default_key_spec(),
            #[cfg(feature = "rocketmq")]
            Endpoint::RocketMq(_) => idemq::source::rocketmq::default_key_spec(),
            _ => KeySpec::transport_key().or(KeySpec::id()),
        }
    }

    /// Opens the endpoint as a source. Files keep a checkpoint next to them
    /// unless `no_checkpoint`.
    pub async fn open_source(
        &self,
        consumer: &str,
        no_checkpoint: bool,
    ) -> Result<Box<dyn Source>> {
        match self {
            Endpoint::Std => {
                if std::io::stdin().is_terminal() {
                    eprintln!(
                        "idemq: reading JSON lines from the terminal (Ctrl-D ends the input)"
                    );
                }
                Ok(Box::new(JsonLinesSource::stdin()))
            }
            Endpoint::File(path) => {
                let checkpoint = (!no_checkpoint).then(|| checkpoint_path(path, consumer));
                let source = JsonLinesSource::open_with_checkpoint(path, checkpoint)
                    .await
                    .with_context(|| format!("opening {}", path.display()))?;
                Ok(Box::new(source))
            }
            #[cfg(feature = "kafka")]
            Endpoint::Kafka(url) => {
                use idemq::source::kafka::{KafkaConfig, KafkaSource};
                let config = KafkaConfig::from_url(url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, KafkaSource::connect(config)).await?,
                ))
            }
            #[cfg(feature = "amqp")]
            Endpoint::Amqp(url) => {
                use idemq::source::amqp::{AmqpConfig, AmqpSource};
                let config = AmqpConfig::from_url(url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, AmqpSource::connect(config)).await?,
                ))
            }
            #[cfg(feature = "sqs")]
            Endpoint::Sqs(url) => {
                use idemq::source::sqs::{SqsConfig, SqsSource};
                let config = SqsConfig::from_url(url).map_err(crate::exit::usage)?;
                Ok(Box::new(connected(self, SqsSource::connect(config)).await?))
            }
            #[cfg(feature = "nats")]
            Endpoint::Nats(url) => {
                use idemq::source::nats::{NatsConfig, NatsSource};
                let config = NatsConfig::from_url(url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, NatsSource::connect(config)).await?,
                ))
            }
            #[cfg(feature = "redis-streams")]
            Endpoint::RedisStream(url) => {
                use idemq::source::redis_stream::{RedisStreamConfig, RedisStreamSource};
                let config = RedisStreamConfig::from_url(url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, RedisStreamSource::connect(config)).await?,
                ))
            }
            #[cfg(feature = "mqtt")]
            Endpoint::Mqtt(url) => {
                use idemq::source::mqtt::{MqttConfig, MqttSource};
                let config = MqttConfig::from_url(url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, MqttSource::connect(config)).await?,
                ))
            }
            #[cfg(feature = "rocketmq")]
            Endpoint::RocketMq(url) => {
                use idemq::source::rocketmq::{RocketMqConfig, RocketMqSource};
                let config = RocketMqConfig::from_url(url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, RocketMqSource::connect(config)).await?,
                ))
            }
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
            #[cfg(feature = "kafka")]
            Endpoint::Kafka(url) => {
                use idemq::source::kafka::{KafkaConfig, KafkaPublisher};
                // A producer belongs to no consumer group: the URL may omit it.
                let url = with_default_param(url, "group", "idemq-produce");
                let config = KafkaConfig::from_url(&url).map_err(crate::exit::usage)?;
                if let Some(partitions) = config.create_partitions {
                    idemq::source::kafka::create_topic(&config.brokers, &config.topic, partitions)
                        .await
                        .with_context(|| format!("creating the topic of {self}"))?;
                }
                Ok(Box::new(
                    connected(
                        self,
                        KafkaPublisher::connect(&config.brokers, &config.topic),
                    )
                    .await?,
                ))
            }
            #[cfg(feature = "amqp")]
            Endpoint::Amqp(url) => {
                use idemq::source::amqp::{AmqpConfig, AmqpPublisher};
                let config = AmqpConfig::from_url(url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, AmqpPublisher::connect(config)).await?,
                ))
            }
            #[cfg(feature = "sqs")]
            Endpoint::Sqs(url) => {
                use idemq::source::sqs::{SqsConfig, SqsPublisher};
                let config = SqsConfig::from_url(url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, SqsPublisher::connect(config)).await?,
                ))
            }
            #[cfg(feature = "nats")]
            Endpoint::Nats(url) => {
                use idemq::source::nats::{NatsConfig, NatsPublisher};
                let config = NatsConfig::from_url(url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, NatsPublisher::connect(config)).await?,
                ))
            }
            #[cfg(feature = "redis-streams")]
            Endpoint::RedisStream(url) => {
                use idemq::source::redis_stream::{RedisStreamConfig, RedisStreamPublisher};
                // A producer belongs to no consumer group: the URL may omit it.
                let url = with_default_param(url, "group", "idemq-produce");
                let config = RedisStreamConfig::from_url(&url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, RedisStreamPublisher::connect(&config)).await?,
                ))
            }
            #[cfg(feature = "mqtt")]
            Endpoint::Mqtt(url) => {
                use idemq::source::mqtt::{MqttConfig, MqttPublisher};
                let client = format!("idemq-produce-{}", std::process::id());
                let url = with_default_param(url, "client_id", &client);
                let config = MqttConfig::from_url(&url).map_err(crate::exit::usage)?;
                Ok(Box::new(
                    connected(self, MqttPublisher::connect(&config)).await?,
                ))
            }
            #[cfg(feature = "rocketmq")]
            Endpoint::RocketMq(url) => {
                use idemq::source::rocketmq::RocketMqPublisher;
                Ok(Box::new(
                    connected(self, RocketMqPublisher::from_url(url)).await?,
                ))
            }
        }
    }
}

/// Waits for a broker client to connect; a failure names the endpoint.
#[cfg(any(
    feature = "kafka",
    feature = "amqp",
    feature = "sqs",
    feature = "nats",
    feature = "redis-streams",
    feature = "mqtt",
    feature = "rocketmq"
))]
async fn connected<T>(
    endpoint: &Endpoint,
    connecting: impl std::future::Future<Output = Result<T, SourceError>>,
) -> Result<T> {
    connecting
        .await
        .with_context(|| format!("connecting to {endpoint}"))
}

/// `url` with `name=value` added to its query unless it already sets `name`.
#[allow(dead_code)] // unused in builds without the brokers that need it
fn with_default_param(url: &str, name: &str, value: &str) -> String {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    if query
        .split('&')
        .any(|pair| pair.split('=').next() == Some(name))
    {
        return url.to_owned();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{name}={value}")
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
    fn default_params_do_not_override() {
        assert_eq!(
            with_default_param("k://h/t", "group", "g"),
            "k://h/t?group=g"
        );
        assert_eq!(
            with_default_param("k://h/t?a=1", "group", "g"),
            "k://h/t?a=1&group=g"
        );
        assert_eq!(
            with_default_param("k://h/t?group=x", "group", "g"),
            "k://h/t?group=x"
        );
        assert_eq!(
            with_default_param("k://h/t?mygroup=x", "group", "g"),
            "k://h/t?mygroup=x&group=g"
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
