//! The URL syntax shared by the broker sources, and its value parsers.
//!
//! Every broker source is configured by a URL of the shape
//!
//! ```text
//! scheme://[user[:password]@]authority[/path][?name=value[&name=value…]]
//! ```
//!
//! [`BrokerUrl::parse`] splits it; each source then says what the authority
//! and the path mean for it (a `host:port` list, a queue name, a topic
//! filter…) and which query parameters it takes. The rules, the same for
//! every source:
//!
//! - The authority ends at the first `/` or `?`; the user info is what comes
//!   before its last `@`. The path is everything between the first `/` after
//!   the authority and the first `?`: it may itself contain `/`, and `#` is an
//!   ordinary character (an MQTT topic filter such as `orders/#` is written as
//!   is: there are no fragments).
//! - The query is split at `&`, each pair at its first `=`; a name without
//!   `=` has the empty value (`?create` is `?create=`). When a name occurs
//!   twice, the last one wins (the source sees both, in order).
//! - User, password, host, path and query names and values are
//!   percent-decoded (`%2F` is `/`). A `%` not followed by two hex digits, or
//!   a result that is not UTF-8, is an error. `+` is a plain `+`, not a space.
//! - Durations ([`parse_duration`]) are written as the CLI's flags are: one
//!   or more whole numbers each with a unit `ms`, `s`, `m`, `h` or `d`
//!   (`500ms`, `1m30s`, `7d`). **A bare number is seconds** ([`Bare::Seconds`]), except
//!   where a source documents otherwise (Redis Streams keeps milliseconds, as
//!   Redis itself counts; [`Bare::Millis`]).
//! - Counts ([`parse_count`]) are whole numbers written with ASCII digits
//!   only; flags ([`parse_bool`]) are `true`/`1`/`yes`/empty or
//!   `false`/`0`/`no`.
//! - Every error is a [`SourceErrorKind::Config`](crate::SourceErrorKind::Config) reading
//!   `invalid <Broker> URL "<url>": <why>`, with the user info of the URL
//!   replaced by `<credentials>` so that no password reaches a log.
//!
//! The [`url`](https://docs.rs/url) crate is not used: it rejects a
//! comma-separated host list (`kafka://h1:9092,h2:9092/t`) as an invalid
//! port, reads the `#` of an MQTT filter as the start of a fragment, decodes
//! `+` in the query as a space and passes a malformed `%zz` through.

// Each broker feature uses only part of this module.
#![cfg_attr(
    not(all(
        feature = "amqp",
        feature = "kafka",
        feature = "mqtt",
        feature = "nats",
        feature = "redis-streams",
        feature = "sqs"
    )),
    allow(dead_code)
)]

use std::fmt::Display;
use std::time::Duration;

use crate::error::SourceError;

/// A broker URL split into its parts (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BrokerUrl<'a> {
    broker: &'static str,
    raw: &'a str,
    /// The scheme, without `://`.
    pub(crate) scheme: &'a str,
    /// The authority as written, user info included.
    pub(crate) authority: &'a str,
    /// The decoded user and password (empty when only a user is given).
    pub(crate) userinfo: Option<(String, String)>,
    /// The authority without the user info, as written.
    pub(crate) hosts: &'a str,
    /// The path after the first `/`, as written; `None` without a `/`.
    pub(crate) path: Option<&'a str>,
    params: Vec<(String, String)>,
}

/// One decoded query parameter, with the URL it came from (for errors).
#[derive(Debug, Clone)]
pub(crate) struct Param<'u> {
    url: &'u BrokerUrl<'u>,
    /// The decoded name.
    pub(crate) name: String,
    /// The decoded value (empty for a name without `=`).
    pub(crate) value: String,
}

/// What a duration written without a unit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bare {
    /// `30` is 30 s: the rule for every source unless documented otherwise.
    Seconds,
    /// `500` is 500 ms (Redis Streams).
    Millis,
}

impl<'a> BrokerUrl<'a> {
    /// Splits `url`, which must start with `scheme://`. `broker` names the
    /// broker in error messages (`"Kafka"`).
    pub(crate) fn parse(
        broker: &'static str,
        scheme: &'a str,
        url: &'a str,
    ) -> Result<Self, SourceError> {
        let mut parsed = BrokerUrl {
            broker,
            raw: url,
            scheme,
            authority: "",
            userinfo: None,
            hosts: "",
            path: None,
            params: Vec::new(),
        };
        let rest = url
            .strip_prefix(scheme)
            .and_then(|r| r.strip_prefix("://"))
            .ok_or_else(|| parsed.error(format!("it must start with {scheme}://")))?;
        let (location, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match location.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (location, None),
        };
        parsed.authority = authority;
        parsed.path = path;
        parsed.hosts = authority;
        if let Some((userinfo, hosts)) = authority.rsplit_once('@') {
            let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            let user = decode(user).map_err(|why| parsed.error(why))?;
            let password = decode(password).map_err(|why| parsed.error(why))?;
            parsed.userinfo = Some((user, password));
            parsed.hosts = hosts;
        }
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let name = decode(name).map_err(|why| parsed.error(why))?;
            let value = decode(value).map_err(|why| parsed.error(why))?;
            parsed.params.push((name, value));
        }
        Ok(parsed)
    }

    /// A [`SourceErrorKind::Config`](crate::SourceErrorKind::Config) about this URL (its credentials hidden).
    pub(crate) fn error(&self, why: impl Display) -> SourceError {
        SourceError::config(format!(
            "invalid {} URL {:?}: {why}",
            self.broker,
            redact(self.raw)
        ))
    }

    /// The error for a required parameter that is missing or empty.
    pub(crate) fn missing(&self, name: &str) -> SourceError {
        self.error(format!("the {name} parameter is required (?{name}=…)"))
    }

    /// A client certificate from the URL's certificate and key files,
    /// which come together or not at all.
    pub(crate) fn client_cert(
        &self,
        cert: Option<std::path::PathBuf>,
        key: Option<std::path::PathBuf>,
    ) -> Result<Option<(std::path::PathBuf, std::path::PathBuf)>, SourceError> {
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some((cert, key))),
            (None, None) => Ok(None),
            _ => Err(self.error("a client certificate needs both cert= and key=")),
        }
    }

    /// The query parameters, in order.
    pub(crate) fn params(&self) -> impl Iterator<Item = Param<'_>> + '_ {
        self.params.iter().map(move |(name, value)| Param {
            url: self,
            name: name.clone(),
            value: value.clone(),
        })
    }

    /// The authority without user info, checked to be a non-empty list of
    /// non-empty comma-separated entries (`h1:9092,h2:9092`), as written.
    pub(crate) fn host_list(&self) -> Result<&'a str, SourceError> {
        if self.hosts.split(',').any(|h| h.trim().is_empty()) {
            return Err(self.error("no host"));
        }
        Ok(self.hosts)
    }

    /// The one `host[:port]` of the authority, decoded; `[v6]` brackets are
    /// removed; the port is `default_port` when absent.
    pub(crate) fn host_port(&self, default_port: u16) -> Result<(String, u16), SourceError> {
        let hostport = self.hosts;
        let (host, port) = if let Some(rest) = hostport.strip_prefix('[') {
            let (host, after) = rest
                .split_once(']')
                .ok_or_else(|| self.error(format!("unclosed '[' in {hostport:?}")))?;
            match after {
                "" => (host, None),
                _ => match after.strip_prefix(':') {
                    Some(port) => (host, Some(port)),
                    None => return Err(self.error(format!("junk after ']' in {hostport:?}"))),
                },
            }
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (hostport, None),
            }
        };
        if host.is_empty() {
            return Err(self.error("no host"));
        }
        let port = match port {
            Some(p) => p
                .parse()
                .ok()
                .filter(|_| p.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| self.error(format!("{p:?} is not a valid port")))?,
            None => default_port,
        };
        Ok((decode(host).map_err(|why| self.error(why))?, port))
    }

    /// The authority without user info, decoded.
    pub(crate) fn decoded_hosts(&self) -> Result<String, SourceError> {
        decode(self.hosts).map_err(|why| self.error(why))
    }

    /// The path, which must be present (`what` names it in the error).
    pub(crate) fn require_path(&self, what: &str) -> Result<&'a str, SourceError> {
        self.path
            .ok_or_else(|| self.error(format!("no {what}: expected {}://…/{what}", self.scheme)))
    }

    /// The whole path decoded; the empty string when there is none.
    pub(crate) fn decoded_path(&self) -> Result<String, SourceError> {
        decode(self.path.unwrap_or("")).map_err(|why| self.error(why))
    }

    /// The decoded `/`-separated path segments, ignoring one trailing `/`.
    pub(crate) fn segments(&self) -> Result<Vec<String>, SourceError> {
        let path = self.path.unwrap_or("");
        let path = path.strip_suffix('/').unwrap_or(path);
        if path.is_empty() {
            return Ok(Vec::new());
        }
        path.split('/')
            .map(|s| decode(s).map_err(|why| self.error(why)))
            .collect()
    }
}

impl Param<'_> {
    /// A [`SourceErrorKind::Config`](crate::SourceErrorKind::Config) about this parameter.
    pub(crate) fn error(&self, why: impl Display) -> SourceError {
        self.url.error(why)
    }

    /// `e`, a plain [`SourceErrorKind::Config`](crate::SourceErrorKind::Config), as an error about this URL.
    fn in_context(&self, e: SourceError) -> SourceError {
        if e.kind() == crate::error::SourceErrorKind::Config {
            self.error(e.message())
        } else {
            e
        }
    }

    /// The error for a parameter the source does not know.
    pub(crate) fn unknown(&self) -> SourceError {
        self.error(format!("unknown parameter {:?}", self.name))
    }

    /// The value, or `None` when empty.
    pub(crate) fn non_empty(&self) -> Option<String> {
        Some(self.value.clone()).filter(|v| !v.is_empty())
    }

    /// The value as a duration (see [`parse_duration`]).
    pub(crate) fn duration(&self, bare: Bare) -> Result<Duration, SourceError> {
        parse_duration(&self.name, &self.value, bare).map_err(|e| self.in_context(e))
    }

    /// The value as a whole number (see [`parse_count`]).
    pub(crate) fn count<T: TryFrom<u64>>(&self) -> Result<T, SourceError> {
        parse_count(&self.name, &self.value).map_err(|e| self.in_context(e))
    }

    /// The value as a flag (see [`parse_bool`]).
    pub(crate) fn flag(&self) -> Result<bool, SourceError> {
        parse_bool(&self.name, &self.value).map_err(|e| self.in_context(e))
    }

    /// The value, which must be one of `choices`.
    pub(crate) fn choice(&self, choices: &[&str]) -> Result<&str, SourceError> {
        if choices.contains(&self.value.as_str()) {
            Ok(&self.value)
        } else {
            Err(self.error(format!(
                "{} must be {}, not {:?}",
                self.name,
                choices.join(" or "),
                self.value
            )))
        }
    }
}

/// `value` of parameter `name` as a duration, written as the CLI's flags
/// are: one or more whole numbers each with a unit `ms`, `s`, `m`, `h` or `d`
/// (`500ms`, `30s`, `1m30s`, `7d`); a bare number counts as `bare` says.
pub(crate) fn parse_duration(name: &str, value: &str, bare: Bare) -> Result<Duration, SourceError> {
    let bad = || {
        SourceError::config(format!(
            "{name} must be a duration such as 500ms, 30s, 1m30s, 2h or 7d, not {value:?}"
        ))
    };
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        let n: u64 = value.parse().map_err(|_| bad())?;
        let millis = match bare {
            Bare::Millis => Some(n),
            Bare::Seconds => n.checked_mul(1_000),
        };
        return millis.map(Duration::from_millis).ok_or_else(bad);
    }
    if value.is_empty() {
        return Err(bad());
    }
    let mut rest = value;
    let mut millis: u64 = 0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let scale: u64 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        millis = n
            .checked_mul(scale)
            .and_then(|part| millis.checked_add(part))
            .ok_or_else(bad)?;
    }
    Ok(Duration::from_millis(millis))
}

/// `value` of parameter `name` as a whole number (ASCII digits only) that
/// fits `T`.
pub(crate) fn parse_count<T: TryFrom<u64>>(name: &str, value: &str) -> Result<T, SourceError> {
    let n: u64 = value
        .parse()
        .ok()
        .filter(|_| value.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| {
            SourceError::config(format!("{name} must be a whole number, not {value:?}"))
        })?;
    T::try_from(n).map_err(|_| SourceError::config(format!("{name}={n} is too large")))
}

/// `value` of parameter `name` as a flag: `true`, `1`, `yes` or empty (a
/// bare `?name`) are true; `false`, `0` and `no` are false.
pub(crate) fn parse_bool(name: &str, value: &str) -> Result<bool, SourceError> {
    match value {
        "" | "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        other => Err(SourceError::config(format!(
            "{name} must be true or false, not {other:?}"
        ))),
    }
}

/// `url` with `name=value` added to its query unless it already sets
/// `name` (a parameter only a consumer needs, given a default for a
/// publisher).
pub(crate) fn with_default_param(url: &str, name: &str, value: &str) -> String {
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

/// `url` with query parameter `name` set to `value` (replaced if present).
pub(crate) fn set_param(url: &str, name: &str, value: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut pairs: Vec<&str> = query
        .split('&')
        .filter(|p| !p.is_empty() && p.split('=').next() != Some(name))
        .collect();
    let pair = format!("{name}={value}");
    pairs.push(&pair);
    format!("{base}?{}", pairs.join("&"))
}

/// The raw (not decoded) value of query parameter `name` of `url`; the
/// last one when it occurs twice.
pub(crate) fn raw_param<'u>(url: &'u str, name: &str) -> Option<&'u str> {
    let (_, query) = url.split_once('?')?;
    query.split('&').rev().find_map(|pair| {
        let (n, v) = pair.split_once('=').unwrap_or((pair, ""));
        (n == name).then_some(v)
    })
}

/// The URL of the `slot`-th of several competing consumers of `url`, where
/// each needs a name of its own (`param`): `{name}-w{slot}`, the name being
/// the URL's own or `default`.
pub(crate) fn competing_with(url: &str, param: &str, default: &str, slot: usize) -> String {
    let base = raw_param(url, param).unwrap_or(default);
    set_param(url, param, &format!("{base}-w{slot}"))
}

/// `url` with its secrets hidden (see [`crate::redact::redact_url`]).
pub(crate) fn redact(url: &str) -> String {
    crate::redact::redact_url(url)
}

/// Strict percent-decoding: `%` must be followed by two hex digits, and the
/// result must be UTF-8.
pub(crate) fn decode(text: &str) -> Result<String, String> {
    if !text.contains('%') {
        return Ok(text.to_owned());
    }
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let byte = text
                .get(i + 1..i + 3)
                .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent-encoding in {text:?}"))?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{text:?} does not decode to UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_are_set_and_read() {
        assert_eq!(set_param("k://h/t", "a", "1"), "k://h/t?a=1");
        assert_eq!(set_param("k://h/t?a=0&b=2", "a", "1"), "k://h/t?b=2&a=1");
        assert_eq!(raw_param("k://h/t?a=0&b=2&a=3", "a"), Some("3"));
        assert_eq!(raw_param("k://h/t?ab=0", "a"), None);
        assert_eq!(
            competing_with("m://h/t?client_id=c", "client_id", "idemq", 1),
            "m://h/t?client_id=c-w1"
        );
        assert_eq!(
            competing_with("r://h/s?group=g", "consumer", "idemq", 0),
            "r://h/s?group=g&consumer=idemq-w0"
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

    fn config_text(e: SourceError) -> String {
        assert_eq!(
            e.kind(),
            crate::error::SourceErrorKind::Config,
            "not a configuration error: {e:?}"
        );
        e.message().to_owned()
    }

    #[test]
    fn splits_every_part() {
        let u = BrokerUrl::parse(
            "Test",
            "x",
            "x://us%40er:p%3Ass@h1:1,h2:2/a/b%2Fc/#?n=v%26w&flag&n=last&e=&p=a+b",
        )
        .unwrap();
        assert_eq!(u.scheme, "x");
        assert_eq!(u.authority, "us%40er:p%3Ass@h1:1,h2:2");
        assert_eq!(u.userinfo, Some(("us@er".into(), "p:ss".into())));
        assert_eq!(u.hosts, "h1:1,h2:2");
        assert_eq!(u.decoded_hosts().unwrap(), "h1:1,h2:2");
        assert_eq!(u.host_list().unwrap(), "h1:1,h2:2");
        assert_eq!(u.path, Some("a/b%2Fc/#"));
        assert_eq!(u.decoded_path().unwrap(), "a/b/c/#");
        assert_eq!(u.segments().unwrap(), ["a", "b/c", "#"]);
        let params: Vec<(String, String)> = u.params().map(|p| (p.name, p.value)).collect();
        assert_eq!(
            params,
            [
                ("n", "v&w"),
                ("flag", ""),
                ("n", "last"),
                ("e", ""),
                ("p", "a+b")
            ]
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
        );
    }

    #[test]
    fn optional_parts() {
        let u = BrokerUrl::parse("Test", "x", "x://host").unwrap();
        assert_eq!((u.hosts, u.path, u.userinfo.clone()), ("host", None, None));
        assert_eq!(u.params().count(), 0);
        assert!(u.segments().unwrap().is_empty());
        assert_eq!(u.decoded_path().unwrap(), "");
        assert!(u.require_path("topic").is_err());
        let u = BrokerUrl::parse("Test", "x", "x://user@host/?").unwrap();
        assert_eq!(u.userinfo, Some(("user".into(), String::new())));
        assert_eq!(u.path, Some(""));
        assert_eq!(u.require_path("topic").unwrap(), "");
        let u = BrokerUrl::parse("Test", "x", "x://a%2Eb").unwrap();
        assert_eq!(u.decoded_hosts().unwrap(), "a.b");
        assert!(u.segments().unwrap().is_empty());
        let u = BrokerUrl::parse("Test", "x", "x://h/S/C/").unwrap();
        assert_eq!(u.segments().unwrap(), ["S", "C"]);
    }

    #[test]
    fn hosts_and_ports() {
        let hp = |url: &str| BrokerUrl::parse("Test", "x", url).unwrap().host_port(7);
        assert_eq!(hp("x://h:5/p").unwrap(), ("h".into(), 5));
        assert_eq!(hp("x://u:p@h/p").unwrap(), ("h".into(), 7));
        assert_eq!(hp("x://[::1]:9").unwrap(), ("::1".into(), 9));
        assert_eq!(hp("x://[::1]").unwrap(), ("::1".into(), 7));
        for bad in [
            "x://h:x",
            "x://h:+5",
            "x://h:70000",
            "x://:5",
            "x://",
            "x://[::1",
            "x://[::1]5",
        ] {
            assert!(hp(bad).is_err(), "{bad}");
        }
        let list = |url: &str| {
            BrokerUrl::parse("Test", "x", url)
                .unwrap()
                .host_list()
                .map(str::to_owned)
        };
        assert_eq!(list("x://a,b/t").unwrap(), "a,b");
        for bad in ["x:///t", "x://a,/t", "x://u@/t", "x://a, ,b/t"] {
            assert!(list(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rejects_bad_urls() {
        for bad in [
            "y://h",
            "x:/h",
            "xx://h",
            "x://h/%zz",
            "x://h?a=%4",
            "x://h?%ff=1",
            "x://%C3%28@h",
        ] {
            let Err(e) = BrokerUrl::parse("Test", "x", bad).and_then(|u| u.decoded_path()) else {
                panic!("{bad} should be rejected");
            };
            assert!(config_text(e).starts_with("invalid Test URL"), "{bad}");
        }
    }

    #[test]
    fn errors_hide_credentials() {
        let u = BrokerUrl::parse("Test", "x", "x://user:secret@h/p?a=1").unwrap();
        let text = config_text(u.params().next().unwrap().unknown());
        assert_eq!(
            text,
            r#"invalid Test URL "x://<credentials>@h/p?a=1": unknown parameter "a""#
        );
        assert_eq!(
            config_text(u.missing("group")),
            r#"invalid Test URL "x://<credentials>@h/p?a=1": the group parameter is required (?group=…)"#
        );
    }

    #[test]
    fn durations() {
        let d = |v: &str, bare| parse_duration("x", v, bare);
        for bare in [Bare::Seconds, Bare::Millis] {
            assert_eq!(d("250ms", bare).unwrap(), Duration::from_millis(250));
            assert_eq!(d("2s", bare).unwrap(), Duration::from_secs(2));
            assert_eq!(d("3m", bare).unwrap(), Duration::from_secs(180));
            assert_eq!(d("1h", bare).unwrap(), Duration::from_secs(3600));
            assert_eq!(d("7d", bare).unwrap(), Duration::from_secs(7 * 86_400));
            assert_eq!(d("1m30s", bare).unwrap(), Duration::from_secs(90));
            assert_eq!(
                d("1h2m3s4ms", bare).unwrap(),
                Duration::from_millis(3_723_004)
            );
            for bad in [
                "",
                "s",
                "1x",
                "m1",
                "1m30",
                "1.5s",
                "-1s",
                " 1s",
                "1 s",
                "99999999999999999999h",
            ] {
                assert!(d(bad, bare).is_err(), "{bad}");
            }
        }
        assert_eq!(d("3", Bare::Seconds).unwrap(), Duration::from_secs(3));
        assert_eq!(d("3", Bare::Millis).unwrap(), Duration::from_millis(3));
        assert_eq!(
            config_text(d("soon", Bare::Seconds).unwrap_err()),
            r#"x must be a duration such as 500ms, 30s, 1m30s, 2h or 7d, not "soon""#
        );
    }

    #[test]
    fn counts_and_flags() {
        assert_eq!(parse_count::<u16>("n", "65535").unwrap(), 65535);
        assert_eq!(parse_count::<u64>("n", "0").unwrap(), 0);
        for bad in ["", "-1", "+1", "1.0", "x", "65536"] {
            assert!(parse_count::<u16>("n", bad).is_err(), "{bad}");
        }
        assert_eq!(
            config_text(parse_count::<u16>("n", "x").unwrap_err()),
            r#"n must be a whole number, not "x""#
        );
        for yes in ["", "true", "1", "yes"] {
            assert!(parse_bool("f", yes).unwrap());
        }
        for no in ["false", "0", "no"] {
            assert!(!parse_bool("f", no).unwrap());
        }
        assert!(parse_bool("f", "maybe").is_err());
    }

    #[test]
    fn params_parse_values_in_context() {
        let u = BrokerUrl::parse("Test", "x", "x://h?d=5&n=7&f=no&c=b&e=").unwrap();
        let p: Vec<Param<'_>> = u.params().collect();
        assert_eq!(
            p[0].duration(Bare::Seconds).unwrap(),
            Duration::from_secs(5)
        );
        assert_eq!(p[1].count::<u8>().unwrap(), 7);
        assert!(!p[2].flag().unwrap());
        assert_eq!(p[3].choice(&["a", "b"]).unwrap(), "b");
        assert_eq!(p[4].non_empty(), None);
        assert_eq!(p[3].non_empty().as_deref(), Some("b"));
        assert_eq!(
            config_text(p[3].choice(&["a", "z"]).unwrap_err()),
            r#"invalid Test URL "x://h?d=5&n=7&f=no&c=b&e=": c must be a or z, not "b""#
        );
        assert!(config_text(p[2].duration(Bare::Seconds).unwrap_err())
            .ends_with(r#"f must be a duration such as 500ms, 30s, 1m30s, 2h or 7d, not "no""#));
    }
}
