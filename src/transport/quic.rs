//! QUIC endpoints with TLS 1.3 (self-signed server certificates) and the
//! job-secret HMAC challenge.
//!
//! STUB: to be implemented.
