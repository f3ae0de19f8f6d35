//! Where the SQS source finds its credentials and region: the AWS SDK's
//! standard chain, against the local SQS and STS (moto, 127.0.0.1:5000,
//! `scripts/sqs.sh`). One test, because it sets the process's `AWS_*`
//! environment variables, which the chain reads:
//! - a profile of the shared files (`profile=`), with its region;
//! - web identity (`AWS_ROLE_ARN` + `AWS_WEB_IDENTITY_TOKEN_FILE`), the
//!   temporary credentials issued by moto's STS;
//! - keys in the environment;
//! - nothing configured on a local endpoint: the placeholder pair.
//!
//! Each ends with payments published and consumed through the queue.
#![cfg(feature = "sqs")]

#[path = "integration/support.rs"]
mod support;

use std::time::Duration;

use idemq::source::registry;
use idemq::source::sqs::SqsConfig;
use idemq::store::memory::{Lease, MemoryStore};
use idemq::{handler_fn, Consumer, KeySpec};

const ENDPOINT: &str = "http://127.0.0.1:5000";

/// Every variable of the chain this test sets, cleared before each case.
const VARIABLES: [&str; 10] = [
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_SESSION_NAME",
    "AWS_ENDPOINT_URL_STS",
];

fn clear_environment() {
    for v in VARIABLES
        .iter()
        .chain(&["AWS_REGION", "AWS_DEFAULT_REGION"])
    {
        std::env::remove_var(v);
    }
    // No instance metadata service here: do not wait for one.
    std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
}

/// The access key id and session token the configuration resolves to, and its region.
async fn resolved(config: &SqsConfig) -> (String, Option<String>, String) {
    use aws_sdk_sqs::config::ProvideCredentials;
    let (provider, region) = config
        .credentials_and_region()
        .await
        .expect("credentials and a region");
    let credentials = provider.provide_credentials().await.expect("credentials");
    let region = region.to_string();
    (
        credentials.access_key_id().to_owned(),
        credentials.session_token().map(str::to_owned),
        region,
    )
}

/// Payments published and consumed through `url`, each handled once; the queue removed.
async fn round_trip(url: &str) {
    let broker = registry::lookup(url).unwrap().expect("sqs is registered");
    let publisher = (broker.open_publisher)(url)
        .await
        .unwrap_or_else(|e| panic!("publisher on {url}: {e}"));
    let w = support::workload(6, 0);
    support::publish_all(&*publisher, &w.messages).await;
    let source = (broker.open_source)(url).await.expect("source");
    let calls = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::<
        String,
        u32,
    >::new()));
    let counted = std::sync::Arc::clone(&calls);
    let consumer = Consumer::builder("creds", MemoryStore::new())
        .key(KeySpec::json("/payment_id"))
        .handler(handler_fn(move |ctx, _lease: &mut Lease| {
            *counted
                .lock()
                .unwrap()
                .entry(ctx.key.to_owned())
                .or_default() += 1;
            Box::pin(async { Ok(None) })
        }))
        .build()
        .unwrap();
    let expected = w.expected.len();
    support::run_until(&consumer, source, Duration::from_secs(60), || {
        calls.lock().unwrap().len() == expected
    })
    .await;
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), expected, "{calls:?}");
    assert!(calls.values().all(|&n| n == 1), "{calls:?}");
    (broker.remove)(url).await.expect("remove the queue");
}

fn queue_url(params: &str) -> String {
    let queue = support::unique("creds");
    format!("sqs://{queue}?endpoint={ENDPOINT}&create=true&wait=1&visibility=5{params}")
}

#[tokio::test]
async fn the_aws_credential_chain_is_read_profile_web_identity_environment() {
    let dir = tempfile::tempdir().unwrap();

    // A profile of the shared files, named in the URL, with its region.
    clear_environment();
    let credentials = dir.path().join("credentials");
    std::fs::write(
        &credentials,
        "[idemq-test]\naws_access_key_id = AKIDPROFILE0001\naws_secret_access_key = profile-s3cret\n",
    )
    .unwrap();
    let config_file = dir.path().join("config");
    std::fs::write(&config_file, "[profile idemq-test]\nregion = eu-west-3\n").unwrap();
    std::env::set_var("AWS_SHARED_CREDENTIALS_FILE", &credentials);
    std::env::set_var("AWS_CONFIG_FILE", &config_file);
    let url = queue_url("&profile=idemq-test");
    let config = SqsConfig::from_url(&url).unwrap();
    let (key, token, region) = resolved(&config).await;
    assert_eq!(
        (key.as_str(), token, region.as_str()),
        ("AKIDPROFILE0001", None, "eu-west-3")
    );
    // A region in the URL wins over the profile's.
    let chosen = SqsConfig::from_url(&queue_url("&profile=idemq-test&region=ap-south-1")).unwrap();
    assert_eq!(resolved(&chosen).await.2, "ap-south-1");
    round_trip(&url).await;

    // Web identity: moto's STS trades the token for temporary credentials.
    clear_environment();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "eyJhbGciOiJub25lIn0.eyJzdWIiOiJpZGVtcSJ9.").unwrap();
    std::env::set_var("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/idemq");
    std::env::set_var("AWS_WEB_IDENTITY_TOKEN_FILE", &token_file);
    std::env::set_var("AWS_ROLE_SESSION_NAME", "idemq-test");
    std::env::set_var("AWS_ENDPOINT_URL_STS", ENDPOINT);
    std::env::set_var("AWS_REGION", "us-east-1");
    let url = queue_url("");
    let (key, token, _) = resolved(&SqsConfig::from_url(&url).unwrap()).await;
    assert!(
        token.is_some(),
        "temporary credentials carry a session token"
    );
    assert_ne!(key, "test");
    round_trip(&url).await;

    // Keys in the environment.
    clear_environment();
    std::env::set_var("AWS_ACCESS_KEY_ID", "AKIDENVIRONMENT1");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "environment-s3cret");
    let url = queue_url("");
    let (key, _, region) = resolved(&SqsConfig::from_url(&url).unwrap()).await;
    assert_eq!(
        (key.as_str(), region.as_str()),
        ("AKIDENVIRONMENT1", "us-east-1")
    );
    round_trip(&url).await;

    // Nothing configured, a local endpoint: the placeholder pair.
    clear_environment();
    let url = queue_url("");
    assert_eq!(
        resolved(&SqsConfig::from_url(&url).unwrap()).await.0,
        "test"
    );
    round_trip(&url).await;

    // The secrets never show in the configuration's debug form.
    let config = SqsConfig::from_url(&queue_url("&profile=idemq-test")).unwrap();
    assert!(!format!("{config:?}").contains("s3cret"));
}
