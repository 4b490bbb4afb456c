//! Fuzz the control-plane decoders (WI-1): no input may panic them, and
//! whatever decodes must survive an encode/decode round trip unchanged.
#![no_main]

use chorus::transport::wire;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = wire::decode_request(data) {
        if let Ok(body) = wire::encode_request(&req) {
            assert_eq!(wire::decode_request(&body).ok(), Some(req));
        }
    }
    if let Ok(resp) = wire::decode_response(data) {
        if let Ok(body) = wire::encode_response(&resp) {
            assert_eq!(wire::decode_response(&body).ok(), Some(resp));
        }
    }
    if let Ok(msg) = wire::decode_auth(data) {
        if let Ok(body) = wire::encode_auth(&msg) {
            assert_eq!(wire::decode_auth(&body).ok(), Some(msg));
        }
    }
});
