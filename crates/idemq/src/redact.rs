//! Hiding secrets in URLs before they reach a log, an error or any output.
//!
//! One function, used wherever a URL is shown: [`redact_url`].

/// The marker that stands where a secret was.
const HIDDEN: &str = "***";

/// `url` with every secret hidden: its user info (`user:password@`, of every
/// server of a list such as `nats://a:4222,nats://u:p@b:4222`) becomes
/// `<credentials>@`, and the value of every query parameter whose name says
/// it holds a secret ([`is_secret_param`]) becomes `***`.
///
/// ```
/// use idemq::redact::redact_url;
///
/// assert_eq!(
///     redact_url("kafka://h:9092/t?group=g&sasl.password=hunter2"),
///     "kafka://h:9092/t?group=g&sasl.password=***"
/// );
/// assert_eq!(
///     redact_url("postgres://app:hunter2@db:5432/orders?sslmode=require"),
///     "postgres://<credentials>@db:5432/orders?sslmode=require"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let query_at = rest.find('?').unwrap_or(rest.len());
    let (before_query, query) = rest.split_at(query_at);
    // Everything up to the last `@` before the query is user info (at the
    // cost of hiding the host when a path holds an `@`).
    let before_query = match before_query.rfind('@') {
        Some(at) => format!("<credentials>{}", &before_query[at..]),
        None => before_query.to_owned(),
    };
    let query = match query.strip_prefix('?') {
        Some(params) => {
            let (params, fragment) = match params.split_once('#') {
                Some((params, fragment)) => (params, Some(fragment)),
                None => (params, None),
            };
            let hidden: Vec<String> = params
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if is_secret_param(name) => format!("{name}={HIDDEN}"),
                    _ => pair.to_owned(),
                })
                .collect();
            let fragment = fragment.map_or_else(String::new, |f| format!("#{f}"));
            format!("?{}{fragment}", hidden.join("&"))
        }
        None => query.to_owned(),
    };
    format!("{scheme}://{before_query}{query}")
}

/// Whether a URL parameter of this name holds a secret: its name (any case,
/// `-` and `.` read as `_`) contains `password`, `passwd`, `secret`,
/// `token`, `credential`, `signature` or `jaas`, or is or ends in `key`
/// (`sasl.key`, `api_key`, `nkey`, `secret_access_key`).
pub fn is_secret_param(name: &str) -> bool {
    let name = name.to_ascii_lowercase().replace(['-', '.'], "_");
    const WORDS: [&str; 7] = [
        "password",
        "passwd",
        "secret",
        "token",
        "credential",
        "signature",
        "jaas",
    ];
    WORDS.iter().any(|w| name.contains(w)) || name.ends_with("key")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_info_of_every_server_is_hidden() {
        assert_eq!(redact_url("x://h/a?c=@"), "x://h/a?c=@");
        assert_eq!(
            redact_url("x://a,x://u:p@b/t?c=@"),
            "x://<credentials>@b/t?c=@"
        );
        assert_eq!(redact_url("x://a@b@h?c"), "x://<credentials>@h?c");
        assert_eq!(redact_url("no scheme"), "no scheme");
    }

    #[test]
    fn secret_parameters_are_hidden_and_the_rest_kept() {
        assert_eq!(
            redact_url("kafka://h:9092/t?group=g&sasl.password=p%40ss&security.protocol=SASL_SSL"),
            "kafka://h:9092/t?group=g&sasl.password=***&security.protocol=SASL_SSL"
        );
        assert_eq!(
            redact_url("nats://h:4222/s/c?token=abc&nkey=SU123&subject=o"),
            "nats://h:4222/s/c?token=***&nkey=***&subject=o"
        );
        assert_eq!(
            redact_url("sqs://q?access_key_id=AKIA&secret_access_key=s&region=eu"),
            "sqs://q?access_key_id=AKIA&secret_access_key=***&region=eu"
        );
        assert_eq!(
            redact_url("rocketmq://h:9876/t?group=g&secret-key=s#frag"),
            "rocketmq://h:9876/t?group=g&secret-key=***#frag"
        );
        assert_eq!(redact_url("amqp://h/%2f?queue=q"), "amqp://h/%2f?queue=q");
    }
}
