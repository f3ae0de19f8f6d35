//! What every broker's folder shares: a configuration parsed from a URL, a
//! source and a publisher connected from that configuration, the generic
//! functions that open them for the [registry](super::registry), and the
//! broker error that keeps the client's error as its `source()`.
//!
//! A broker implements [`BrokerConfig`] for its configuration and
//! [`ConnectWith`] for its source and its publisher; its registration is then
//! one [`Broker::of`](super::registry::Broker) value. Its acknowledger holds
//! what it settles in an [`Unsettled`], which settles once and hands the
//! delivery back ([`Redeliver`]) when dropped unsettled.

use std::future::Future;

use futures_util::future::BoxFuture;

use super::health::{BrokerHealth, Horizon};
use super::registry::{same_url, transport_key_or_id, Broker};
use super::{Publisher, Source};
use crate::error::{BoxError, SourceError};
use crate::key::KeySpec;

impl Broker {
    /// A broker whose configuration `C` parses its URLs and whose source `S`
    /// and publisher `P` connect from it. Until a `with_…` says otherwise:
    /// no offset-watermark mode, messages published before a subscription
    /// are kept, the key is the transport key or else the message id, and
    /// competing consumers share one URL.
    pub const fn of<C, S, P>(
        id: &'static str,
        name: &'static str,
        schemes: &'static [&'static str],
    ) -> Self
    where
        C: BrokerConfig,
        S: Source + ConnectWith<C> + 'static,
        P: Publisher + ConnectWith<C> + 'static,
    {
        Self {
            id,
            name,
            schemes,
            watermarks: false,
            subscribe_before_publish: false,
            default_key: transport_key_or_id,
            check: check_url::<C>,
            competing_url: same_url,
            open_source: open_source::<C, S>,
            open_publisher: open_publisher::<C, P>,
            remove: remove::<C>,
            inspect: inspect::<C>,
        }
    }

    /// Offset-watermark mode can consume it ([`Broker::watermarks`]).
    pub const fn with_watermarks(self) -> Self {
        Self {
            watermarks: true,
            ..self
        }
    }

    /// Consumers must subscribe before the first publish
    /// ([`Broker::subscribe_before_publish`]).
    pub const fn with_subscribe_before_publish(self) -> Self {
        Self {
            subscribe_before_publish: true,
            ..self
        }
    }

    /// Another default key ([`Broker::default_key`]).
    pub const fn with_default_key(self, default_key: fn() -> KeySpec) -> Self {
        Self {
            default_key,
            ..self
        }
    }

    /// Competing consumers need URLs of their own ([`Broker::competing_url`]).
    pub const fn with_competing_url(self, competing_url: fn(&str, usize) -> String) -> Self {
        Self {
            competing_url,
            ..self
        }
    }
}

/// A broker's configuration, parsed from its URL without connecting.
pub trait BrokerConfig: Sized + Send {
    /// Parses `url` (errors of kind `Config`, never showing a secret).
    fn parse(url: &str) -> Result<Self, SourceError>;

    /// The URL a publisher parses, given a consumer's: parameters only a
    /// consumer needs get defaults, a consumer's identity is replaced. The
    /// URL itself by default.
    fn publisher_url(url: &str) -> String {
        url.to_owned()
    }

    /// Deletes what opening this configuration may have created on the
    /// broker (a queue, a stream, a topic) with the messages in it: for
    /// tests and benchmarks. Nothing by default.
    fn remove(self) -> impl Future<Output = Result<(), SourceError>> + Send {
        async { Ok(()) }
    }

    /// What the broker says of this configuration, read without consuming
    /// or creating anything ([`super::health`]). By default: nothing read.
    fn inspect(self) -> impl Future<Output = Result<BrokerHealth, SourceError>> + Send {
        async {
            Ok(BrokerHealth::new(Horizon::Unknown {
                why: "this broker's retention is not read".into(),
            }))
        }
    }
}

/// A source or publisher that connects from a parsed configuration `C`.
pub trait ConnectWith<C>: Sized {
    /// Connects.
    fn connect_with(config: C) -> impl Future<Output = Result<Self, SourceError>> + Send;
}

/// What a broker does with a delivery whose acknowledger was dropped
/// before any act settled it (its task was cancelled, its consumer crashed):
/// a drop is never an ack.
pub trait Redeliver: Send + Sync {
    /// Hands the delivery back: requeue it, hand it out again, or leave it
    /// to the broker's own timeout. Runs in `Drop`: no waiting here.
    fn redeliver(self);
}

/// The skeleton of every broker's acknowledger: what a delivery is settled
/// with, held until the one act that settles it [takes](Self::take) it.
/// Dropped while still held, the delivery is [redelivered](Redeliver).
///
/// ```
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
/// use idemq::source::kit::{Redeliver, Unsettled};
///
/// struct Held(Arc<AtomicBool>);
/// impl Redeliver for Held {
///     fn redeliver(self) {
///         self.0.store(true, Ordering::SeqCst);
///     }
/// }
///
/// let redelivered = Arc::new(AtomicBool::new(false));
/// let mut settled = Unsettled::new(Held(Arc::clone(&redelivered)));
/// assert!(settled.take().is_some(), "the first act settles");
/// assert!(settled.take().is_none(), "a delivery settles once");
/// drop(settled);
/// assert!(!redelivered.load(Ordering::SeqCst));
///
/// drop(Unsettled::new(Held(Arc::clone(&redelivered))));
/// assert!(redelivered.load(Ordering::SeqCst), "dropped unsettled: redelivered");
/// ```
#[derive(Debug)]
pub struct Unsettled<T: Redeliver>(Option<T>);

impl<T: Redeliver> Unsettled<T> {
    /// Holds `pending` until it is taken or dropped.
    pub fn new(pending: T) -> Self {
        Self(Some(pending))
    }

    /// Takes it to settle; `None` if an act settled it already.
    pub fn take(&mut self) -> Option<T> {
        self.0.take()
    }

    /// What is held, while it is.
    pub fn get(&self) -> Option<&T> {
        self.0.as_ref()
    }
}

impl<T: Redeliver> Drop for Unsettled<T> {
    fn drop(&mut self) {
        if let Some(pending) = self.0.take() {
            pending.redeliver();
        }
    }
}

/// [`Broker::check`](super::registry::Broker::check): parses, connects nothing.
pub fn check_url<C: BrokerConfig>(url: &str) -> Result<(), SourceError> {
    C::parse(url).map(|_| ())
}

/// [`Broker::open_source`](super::registry::Broker::open_source) of a broker
/// whose configuration is `C` and whose source is `S`.
pub fn open_source<C, S>(url: &str) -> BoxFuture<'_, Result<Box<dyn Source>, SourceError>>
where
    C: BrokerConfig,
    S: Source + ConnectWith<C> + 'static,
{
    Box::pin(async move {
        let config = C::parse(url)?;
        Ok(Box::new(S::connect_with(config).await?) as Box<dyn Source>)
    })
}

/// [`Broker::open_publisher`](super::registry::Broker::open_publisher) of a
/// broker whose configuration is `C` and whose publisher is `P`: the URL
/// goes through [`BrokerConfig::publisher_url`] first.
pub fn open_publisher<C, P>(url: &str) -> BoxFuture<'_, Result<Box<dyn Publisher>, SourceError>>
where
    C: BrokerConfig,
    P: Publisher + ConnectWith<C> + 'static,
{
    Box::pin(async move {
        let config = C::parse(&C::publisher_url(url))?;
        Ok(Box::new(P::connect_with(config).await?) as Box<dyn Publisher>)
    })
}

/// [`Broker::remove`](super::registry::Broker::remove) of a broker whose
/// configuration is `C`.
pub fn remove<C: BrokerConfig>(url: &str) -> BoxFuture<'_, Result<(), SourceError>> {
    Box::pin(async move { C::parse(url)?.remove().await })
}

/// [`Broker::inspect`](super::registry::Broker::inspect) of a broker whose
/// configuration is `C`.
pub fn inspect<C: BrokerConfig>(url: &str) -> BoxFuture<'_, Result<BrokerHealth, SourceError>> {
    Box::pin(async move { C::parse(url)?.inspect().await })
}

/// An error of kind `Broker` from `broker`'s client while doing `what`:
/// the message reads `"{broker} {what}: {err}"` and `err` stays its `source()`.
pub fn broker_error(broker: &str, what: &str, err: impl Into<BoxError>) -> SourceError {
    let err = err.into();
    SourceError::broker(format!("{broker} {what}: {err}")).with_source(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_error_keeps_the_client_error_as_its_source() {
        let err = broker_error("X", "connect", std::io::Error::other("boom"));
        assert_eq!(err.kind(), crate::SourceErrorKind::Broker);
        assert!(err.to_string().contains("X connect: boom"), "{err}");
        assert!(std::error::Error::source(&err).is_some(), "{err:?}");
    }
}
