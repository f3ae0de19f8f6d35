//! The broker's commit-log retention, read with two requests of RocketMQ's
//! remoting protocol: a topic's route from a name server (which brokers
//! hold the topic) and each master broker's configuration
//! (`GET_BROKER_CONFIG`), whose `fileReservedTime` is how many hours the
//! broker keeps its commit log, consumed or not. rocketmq-client-rust 1.0
//! keeps its admin client private, so the two requests are written here.
//!
//! A frame is a big-endian `i32` length of what follows, the header's
//! length (its top byte the header's serialization, 0 = JSON), the JSON
//! header (`code`, `opaque`, `extFields`, …) and the body. A request is
//! signed when the source has credentials (the ACL signature: HMAC-SHA1 of
//! the `extFields` values in key order, then the body, base64).

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use hmac::Mac as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::config::{AclCredentials, RocketMqConfig};
use crate::source::health::Horizon;

/// `RequestCode.GET_ROUTEINFO_BY_TOPIC`.
const GET_ROUTE_INFO_BY_TOPIC: i32 = 105;
/// `RequestCode.GET_BROKER_CONFIG`.
const GET_BROKER_CONFIG: i32 = 26;
/// How long one connect or one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest response accepted (a broker's configuration is a few KiB).
const MAX_FRAME: usize = 16 << 20;

/// Why the retention could not be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum AdminError {
    /// The network failed or timed out.
    #[error("{0}")]
    Io(String),
    /// The server answered with an error code.
    #[error("{what}: code {code}{}", remark.as_deref().map(|r| format!(" ({r})")).unwrap_or_default())]
    Refused {
        what: &'static str,
        code: i64,
        remark: Option<String>,
    },
    /// The answer was not what the protocol says.
    #[error("{0}")]
    Malformed(String),
}

/// The smallest `fileReservedTime` of the topic's master brokers as a
/// [`Horizon`]: `Bounded` with the hours and where they come from, or
/// `Unknown` with why they could not be read.
pub(super) async fn retention(config: &RocketMqConfig) -> Horizon {
    match read_retention(config).await {
        Ok((hours, setting)) => Horizon::Bounded {
            limit: Duration::from_secs(hours.saturating_mul(3_600)),
            setting,
        },
        Err(e) => Horizon::Unknown {
            why: format!("the brokers' fileReservedTime could not be read ({e}); 72h by default"),
        },
    }
}

async fn read_retention(config: &RocketMqConfig) -> Result<(u64, String), AdminError> {
    let credentials = config.credentials.as_ref();
    let mut last = AdminError::Malformed("no name server address".into());
    let mut brokers = None;
    for name_server in config
        .name_server
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let mut fields = BTreeMap::new();
        fields.insert("topic".to_owned(), config.topic.clone());
        fields.insert("acceptStandardJsonOnly".to_owned(), "true".to_owned());
        match request(
            name_server,
            GET_ROUTE_INFO_BY_TOPIC,
            fields,
            credentials,
            "the topic's route",
        )
        .await
        {
            Ok(body) => {
                brokers = Some(master_brokers(&body)?);
                break;
            }
            Err(e) => last = e,
        }
    }
    let brokers = brokers.ok_or(last)?;
    let mut smallest: Option<(u64, String)> = None;
    for (name, address) in brokers {
        let body = request(
            &address,
            GET_BROKER_CONFIG,
            BTreeMap::new(),
            credentials,
            "the broker's configuration",
        )
        .await?;
        let text = String::from_utf8_lossy(&body);
        let hours = property(&text, "fileReservedTime").ok_or_else(|| {
            AdminError::Malformed(format!("broker {name} reports no fileReservedTime"))
        })?;
        let hours: u64 = hours.parse().map_err(|_| {
            AdminError::Malformed(format!("broker {name}: fileReservedTime={hours}"))
        })?;
        if smallest.as_ref().is_none_or(|(h, _)| hours < *h) {
            smallest = Some((
                hours,
                format!("broker {name} ({address}) fileReservedTime={hours} (hours)"),
            ));
        }
    }
    smallest.ok_or_else(|| {
        AdminError::Malformed(format!("topic {} has no master broker", config.topic))
    })
}

/// The master (`brokerAddrs` key `0`) of each broker of a route's JSON.
fn master_brokers(body: &[u8]) -> Result<Vec<(String, String)>, AdminError> {
    let route: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| AdminError::Malformed(format!("the topic's route is not JSON: {e}")))?;
    let brokers = route["brokerDatas"]
        .as_array()
        .ok_or_else(|| AdminError::Malformed("the topic's route has no brokerDatas".into()))?;
    Ok(brokers
        .iter()
        .filter_map(|broker| {
            let name = broker["brokerName"].as_str()?.to_owned();
            let master = broker["brokerAddrs"]["0"].as_str()?.to_owned();
            Some((name, master))
        })
        .collect())
}

/// The value of `key` in Java properties text (`key=value` lines).
fn property<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once('=')?;
        (k.trim() == key).then(|| v.trim())
    })
}

/// Sends one request (`code`, `fields`, no body) to `address` and returns
/// the body of a successful response.
async fn request(
    address: &str,
    code: i32,
    fields: BTreeMap<String, String>,
    credentials: Option<&AclCredentials>,
    what: &'static str,
) -> Result<Vec<u8>, AdminError> {
    let frame = encode(code, fields, credentials)?;
    let exchange = async {
        let mut stream = TcpStream::connect(address).await?;
        stream.write_all(&frame).await?;
        let length = usize::try_from(stream.read_i32().await?).unwrap_or(usize::MAX);
        if !(4..=MAX_FRAME).contains(&length) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a response frame of {length} bytes"),
            ));
        }
        let mut rest = vec![0; length];
        stream.read_exact(&mut rest).await?;
        Ok(rest)
    };
    let rest = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .map_err(|_| {
            AdminError::Io(format!(
                "{what} from {address}: no answer in {REQUEST_TIMEOUT:?}"
            ))
        })?
        .map_err(|e| AdminError::Io(format!("{what} from {address}: {e}")))?;
    let (header, body) = decode(&rest)?;
    match header["code"].as_i64() {
        Some(0) => Ok(body.to_vec()),
        code => Err(AdminError::Refused {
            what,
            code: code.unwrap_or(-1),
            remark: header["remark"].as_str().map(str::to_owned),
        }),
    }
}

/// A request frame: the JSON header with `fields` (signed with
/// `credentials`), no body.
fn encode(
    code: i32,
    mut fields: BTreeMap<String, String>,
    credentials: Option<&AclCredentials>,
) -> Result<Vec<u8>, AdminError> {
    if let Some(credentials) = credentials {
        fields.insert("AccessKey".to_owned(), credentials.access_key.clone());
        let signature = sign(&fields, credentials.secret_key())?;
        fields.insert("Signature".to_owned(), signature);
    }
    let header = serde_json::json!({
        "code": code,
        "language": "OTHER",
        "version": 0,
        "opaque": 1,
        "flag": 0,
        "extFields": fields,
        "serializeTypeCurrentRPC": "JSON",
    });
    let header = serde_json::to_vec(&header).map_err(|e| AdminError::Malformed(e.to_string()))?;
    let header_len = i32::try_from(header.len())
        .map_err(|_| AdminError::Malformed("a header too large".into()))?;
    let mut frame = Vec::with_capacity(8 + header.len());
    frame.extend_from_slice(&(4 + header_len).to_be_bytes());
    // The top byte is the header's serialization: 0, JSON.
    frame.extend_from_slice(&header_len.to_be_bytes());
    frame.extend_from_slice(&header);
    Ok(frame)
}

/// The ACL signature of a request without body: HMAC-SHA1 over the field
/// values in key order, base64.
fn sign(fields: &BTreeMap<String, String>, secret: &str) -> Result<String, AdminError> {
    let mut mac = hmac::Hmac::<sha1::Sha1>::new_from_slice(secret.as_bytes())
        .map_err(|_| AdminError::Malformed("an unusable secret key".into()))?;
    for (key, value) in fields {
        if key != "Signature" {
            mac.update(value.as_bytes());
        }
    }
    Ok(base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()))
}

/// The JSON header and the body of a response frame (after its length).
fn decode(frame: &[u8]) -> Result<(serde_json::Value, &[u8]), AdminError> {
    let malformed = |what: &str| AdminError::Malformed(format!("a response frame {what}"));
    let (mark, rest) = frame
        .split_first_chunk::<4>()
        .ok_or_else(|| malformed("without a header length"))?;
    let mark = u32::from_be_bytes(*mark);
    if mark >> 24 != 0 {
        return Err(malformed("whose header is not JSON"));
    }
    let header_len = usize::try_from(mark & 0x00ff_ffff).unwrap_or(usize::MAX);
    if header_len > rest.len() {
        return Err(malformed("shorter than its header"));
    }
    let (header, body) = rest.split_at(header_len);
    let header =
        serde_json::from_slice(header).map_err(|_| malformed("whose header is not JSON"))?;
    Ok((header, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_length_json_header_and_signed_fields() {
        let credentials = AclCredentials::new("ak", "sk");
        let frame = encode(GET_BROKER_CONFIG, BTreeMap::new(), Some(&credentials)).unwrap();
        let total = i32::from_be_bytes(frame[..4].try_into().unwrap());
        assert_eq!(usize::try_from(total).unwrap(), frame.len() - 4);
        let (header, body) = decode(&frame[4..]).unwrap();
        assert!(body.is_empty());
        assert_eq!(header["code"], 26);
        assert_eq!(header["extFields"]["AccessKey"], "ak");
        // HMAC-SHA1("sk", "ak"), base64.
        let mut fields = BTreeMap::new();
        fields.insert("AccessKey".to_owned(), "ak".to_owned());
        assert_eq!(
            header["extFields"]["Signature"],
            sign(&fields, "sk").unwrap()
        );
        assert!(
            !String::from_utf8_lossy(&frame).contains("sk\""),
            "the secret is not sent"
        );
    }

    #[test]
    fn the_signature_is_hmac_sha1_base64() {
        let mut fields = BTreeMap::new();
        fields.insert("b".to_owned(), "2".to_owned());
        fields.insert("a".to_owned(), "1".to_owned());
        // HMAC-SHA1(key "key", "12"), as `openssl dgst -sha1 -hmac key -binary | base64`.
        assert_eq!(
            sign(&fields, "key").unwrap(),
            "mYDe4PF4x+JrlwVHHwgZPpv94hU="
        );
    }

    #[test]
    fn routes_and_properties_parse() {
        let route = br#"{"brokerDatas":[{"brokerAddrs":{"0":"127.0.0.1:10911","1":"127.0.0.1:10912"},"brokerName":"b1","cluster":"c"}],"queueDatas":[]}"#;
        assert_eq!(
            master_brokers(route).unwrap(),
            vec![("b1".to_owned(), "127.0.0.1:10911".to_owned())]
        );
        let text = "deleteWhen=04\nfileReservedTime=96\ndiskMaxUsedSpaceRatio=95\n";
        assert_eq!(property(text, "fileReservedTime"), Some("96"));
        assert_eq!(property(text, "missing"), None);
    }

    #[test]
    fn refusals_and_short_frames_are_errors() {
        assert!(decode(&[0, 0]).is_err());
        assert!(decode(&[0, 0, 0, 9, b'{']).is_err());
        let header = br#"{"code":17,"remark":"No topic route info"}"#;
        let mut frame = (header.len() as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(header);
        let (decoded, _) = decode(&frame).unwrap();
        assert_eq!(decoded["code"], 17);
    }
}
