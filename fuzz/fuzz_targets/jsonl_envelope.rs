//! The JSON-lines envelope parser (`idemq::source::jsonl::parse_message`).
#![no_main]

use idemq::source::jsonl::parse_message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|line: &[u8]| {
    let Ok(message) = parse_message(line) else {
        return;
    };
    // Whatever was accepted is UTF-8 JSON.
    let text = std::str::from_utf8(line).expect("accepted a non-UTF-8 line");
    let value: serde_json::Value = serde_json::from_str(text).expect("accepted non-JSON");
    let envelope = value.as_object().is_some_and(|o| {
        o.contains_key("payload")
            && o.keys()
                .all(|k| matches!(k.as_str(), "id" | "key" | "headers" | "payload"))
    });
    if envelope {
        let o = value.as_object().expect("checked above");
        let payload = match &o["payload"] {
            serde_json::Value::String(s) => s.clone().into_bytes(),
            other => other.to_string().into_bytes(),
        };
        assert_eq!(message.payload, payload);
    } else {
        // A bare line is its own payload.
        assert_eq!(message.payload, text.trim().as_bytes());
        assert!(message.id.is_none() && message.key.is_none() && message.headers.is_empty());
    }
});
