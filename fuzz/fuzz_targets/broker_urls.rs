//! The broker URL parsers (`from_url`) of the sources built into this crate:
//! AMQP and SQS by default, Kafka with `--features kafka`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|url: &str| {
    #[cfg(feature = "amqp")]
    if let Ok(config) = idemq::source::amqp::AmqpConfig::from_url(url) {
        let _ = format!("{config:?}");
    }
    #[cfg(feature = "sqs")]
    if let Ok(config) = idemq::source::sqs::SqsConfig::from_url(url) {
        let _ = format!("{config:?}");
    }
    #[cfg(feature = "kafka")]
    if let Ok(config) = idemq::source::kafka::KafkaConfig::from_url(url) {
        let _ = format!("{config:?}");
    }
    let _ = url;
});
