//! An SQS queue resolved to its URL (created if asked), and SQS errors as [`SourceError`]s.

use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::QueueAttributeName;
use aws_sdk_sqs::Client;

use crate::error::SourceError;

pub(super) fn broker_error<E: std::error::Error + Send + Sync + 'static>(
    what: &str,
    err: E,
) -> SourceError {
    SourceError::broker(format!("SQS {what}: {}", DisplayErrorContext(&err))).with_source(err)
}

/// A queue resolved to its URL.
#[derive(Debug, Clone)]
pub(super) struct QueueRef {
    pub(super) name: String,
    pub(super) url: String,
    pub(super) fifo: bool,
}

pub(super) async fn resolve_queue(
    client: &Client,
    name: &str,
    create: bool,
) -> Result<QueueRef, SourceError> {
    let fifo = name.ends_with(".fifo");
    let url = match client.get_queue_url().queue_name(name).send().await {
        Ok(out) => out.queue_url().map(str::to_owned),
        Err(e) if create && e.as_service_error().is_some() => {
            tracing::info!(queue = name, fifo, "creating the SQS queue");
            let mut request = client.create_queue().queue_name(name);
            if fifo {
                request = request
                    .attributes(QueueAttributeName::FifoQueue, "true")
                    .attributes(QueueAttributeName::ContentBasedDeduplication, "false");
            }
            request
                .send()
                .await
                .map_err(|e| broker_error(&format!("CreateQueue {name}"), e))?
                .queue_url()
                .map(str::to_owned)
        }
        Err(e) => return Err(broker_error(&format!("GetQueueUrl {name}"), e)),
    };
    let url =
        url.ok_or_else(|| SourceError::broker(format!("SQS returned no URL for queue {name}")))?;
    Ok(QueueRef {
        name: name.to_owned(),
        url,
        fifo,
    })
}

#[cfg(test)]
mod broker_error_tests {
    use super::*;

    #[test]
    fn a_broker_error_keeps_the_client_error_as_its_source() {
        let err = broker_error("x", std::io::Error::other("boom"));
        assert_eq!(err.kind(), crate::SourceErrorKind::Broker);
        assert!(std::error::Error::source(&err).is_some(), "{err:?}");
    }
}
