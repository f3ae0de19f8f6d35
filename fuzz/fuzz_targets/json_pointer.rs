//! JSON-pointer validation and extraction (`KeySpec::json`) on arbitrary payloads,
//! checked against serde_json's own pointer lookup.
#![no_main]

use arbitrary::Arbitrary;
use idemq::key::{validate_pointer, MAX_KEY_BYTES};
use idemq::{InputError, KeySpec, Message};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    pointer: String,
    payload: Vec<u8>,
}

fuzz_target!(|input: Input| {
    let valid = validate_pointer(&input.pointer).is_ok();
    // The `json:` spec accepts exactly the valid pointers (escaped for the spec syntax).
    let escaped: String = input
        .pointer
        .chars()
        .flat_map(|c| match c {
            '\\' | '+' | '|' => vec!['\\', c],
            c => vec![c],
        })
        .collect();
    let parsed = format!("json:{escaped}").parse::<KeySpec>();
    if input.pointer.trim() == input.pointer {
        assert_eq!(parsed.is_ok(), valid, "spec json:{escaped}");
    }
    // Extraction never panics, even for pointers that were not validated.
    let message = Message::new(input.payload.clone());
    let got = KeySpec::json(input.pointer.clone()).extract(&message);
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(&input.payload) else {
        assert!(matches!(got, Err(InputError::MalformedJson(_))), "{got:?}");
        return;
    };
    let expected = match json.pointer(&input.pointer) {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Number(n)) => Some(n.to_string()),
        Some(serde_json::Value::Bool(b)) => Some(b.to_string()),
        _ => None,
    };
    match (expected, got) {
        (Some(want), Ok(key)) => assert_eq!(want, key),
        (Some(want), Err(e)) => assert!(
            want.is_empty() || want.len() > MAX_KEY_BYTES,
            "{want:?} not extracted: {e}"
        ),
        (None, Ok(key)) => panic!("extracted {key:?} where serde_json finds no scalar"),
        (None, Err(_)) => {}
    }
});
