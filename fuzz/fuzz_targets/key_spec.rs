//! Key-spec parsing (`KeySpec::from_str`) and extraction on an arbitrary message.
#![no_main]

use arbitrary::Arbitrary;
use idemq::key::MAX_KEY_BYTES;
use idemq::{KeySpec, Message};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    spec: String,
    id: Option<String>,
    key: Option<String>,
    headers: Vec<(String, Vec<u8>)>,
    payload: Vec<u8>,
}

fuzz_target!(|input: Input| {
    let Ok(spec) = input.spec.parse::<KeySpec>() else {
        return;
    };
    let _ = spec.to_string();
    let mut message = Message::new(input.payload);
    message.id = input.id;
    message.key = input.key;
    for (name, value) in input.headers {
        message.headers.insert(name, value);
    }
    let first = spec.extract(&message);
    if let Ok(key) = &first {
        assert!(!key.is_empty(), "empty key from {spec}");
        assert!(key.len() <= MAX_KEY_BYTES, "key longer than the limit");
    }
    // Extraction is a pure function of the message.
    assert_eq!(first, spec.extract(&message));
});
