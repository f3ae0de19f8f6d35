//! TLS set-up shared by the clients that build their TLS on rustls's
//! process-wide crypto provider (redis-rs, async-nats).

/// Installs ring as rustls's process-wide crypto provider unless the
/// application installed one already. rustls cannot pick one by itself when
/// more than one is compiled into the program (sqlx brings ring, the AWS SDK
/// aws-lc-rs), and the clients that rely on the default then panic.
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: one is installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}
