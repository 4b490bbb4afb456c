//! Control-plane framing: length-prefixed, size-bounded, validated rkyv messages.
//!
//! A frame is a `u32` little-endian body length followed by the body, an
//! rkyv 0.8 archive of one [`Request`], [`Response`] or [`AuthMessage`].
//! Every store request travels on its own QUIC bidirectional stream: the
//! client writes one request frame and finishes the stream, the server answers
//! with one response frame.
//!
//! # Invariants
//! - TP-2: the length prefix is checked against [`MAX_FRAME`] *before* any
//!   buffer for the body is allocated, so a peer cannot make us buffer more
//!   than that by announcing a large frame.
//! - WI-1: bodies are decoded only after rkyv's `bytecheck` validation
//!   succeeded; the `decode_*` functions never panic, whatever the input
//!   (pinned by a proptest below and by the cargo-fuzz target in `fuzz/`).
//! - WI-2: bodies are read into an [`AlignedVec`] (rkyv 0.8 rejects unaligned
//!   archives); the `decode_*` functions copy unaligned input first.

use rkyv::rancor;
use rkyv::util::AlignedVec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::TransportError;

/// Largest control-plane frame accepted, in bytes.
pub const MAX_FRAME: usize = 16 << 20;

/// Version of the control-plane protocol, exchanged in [`AuthMessage::ClientHello`].
pub const PROTOCOL_VERSION: u32 = 2;

/// Length of the random nonces of the authentication challenge.
pub const NONCE_LEN: usize = 32;

/// Length of an HMAC-SHA256 proof.
pub const PROOF_LEN: usize = 32;

pub use messages::*;

/// The message types. rkyv's derive generates `Archived*` twins whose fields
/// carry no docs; the lint is relaxed for this module only (every type written
/// here is documented).
#[allow(missing_docs)]
mod messages {
    use super::{NONCE_LEN, PROOF_LEN};

    /// A store request (client → server).
    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub enum Request {
        /// Set `key` to `value`. Answered with [`Response::Ok`].
        Set {
            /// Key.
            key: String,
            /// Value.
            value: Vec<u8>,
        },
        /// Read `key`. Answered with [`Response::Value`].
        Get {
            /// Key.
            key: String,
        },
        /// Wait for every key in `keys`. Answered with [`Response::Values`], or an
        /// [`ErrorKind::WaitTimeout`] error after `timeout_ms` (capped by the server).
        Wait {
            /// Keys to wait for.
            keys: Vec<String>,
            /// How long the server waits, in milliseconds.
            timeout_ms: u64,
        },
        /// Add `delta` to the integer at `key`. Answered with [`Response::Int`].
        Add {
            /// Key.
            key: String,
            /// Increment.
            delta: i64,
        },
        /// Compare-and-set. Answered with [`Response::Swapped`] or [`Response::Current`].
        CompareSet {
            /// Key.
            key: String,
            /// Expected current value (`None` = absent).
            expected: Option<Vec<u8>>,
            /// Value to store if the current one is `expected`.
            desired: Vec<u8>,
        },
        /// Delete `key`. Answered with [`Response::Bool`] (whether it existed).
        Delete {
            /// Key.
            key: String,
        },
        /// Delete every key under `prefix`. Answered with [`Response::Int`]
        /// (how many went). Added in protocol version 2.
        DeletePrefix {
            /// Prefix, non-empty and ending in `/`.
            prefix: String,
        },
    }

    /// Why the server refused or failed a request.
    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub enum ErrorKind {
        /// The store rejected the operation (e.g. `add` on a non-integer).
        Store,
        /// A `wait` timed out; these keys were still missing.
        WaitTimeout {
            /// Missing keys.
            missing: Vec<String>,
        },
        /// The request made no sense to the server.
        BadRequest,
    }

    /// A store response (server → client).
    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub enum Response {
        /// Done (set).
        Ok,
        /// The value of a key, if present (get).
        Value(Option<Vec<u8>>),
        /// The values of the waited-for keys, in request order (wait).
        Values(Vec<Vec<u8>>),
        /// The new value of a counter (add).
        Int(i64),
        /// Compare-set succeeded.
        Swapped,
        /// Compare-set failed; the key holds this value (`None` = absent).
        Current(Option<Vec<u8>>),
        /// Yes/no answer (delete: whether the key existed).
        Bool(bool),
        /// The request failed.
        Error {
            /// What kind of failure.
            kind: ErrorKind,
            /// Human-readable detail.
            message: String,
        },
    }

    /// Messages of the job-secret challenge on a connection's first
    /// bidirectional stream (see [`quic`](crate::transport::quic) for the protocol).
    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub enum AuthMessage {
        /// Client → server: protocol version and the client's nonce.
        ClientHello {
            /// [`PROTOCOL_VERSION`](super::PROTOCOL_VERSION) of the client.
            version: u32,
            /// Random client nonce.
            nonce: [u8; NONCE_LEN],
        },
        /// Server → client: the server's nonce.
        ServerHello {
            /// Random server nonce.
            nonce: [u8; NONCE_LEN],
        },
        /// Client → server: the client's proof of the secret.
        ClientProof {
            /// HMAC with the client role label.
            proof: [u8; PROOF_LEN],
        },
        /// Server → client: the client was accepted; the server's proof of the secret.
        ServerProof {
            /// HMAC with the server role label.
            proof: [u8; PROOF_LEN],
        },
    }
}

fn malformed(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Malformed(format!("invalid {what}: {e}"))
}

/// Check an encoded body against [`MAX_FRAME`].
fn bounded(
    body: Result<AlignedVec, rancor::Error>,
    what: &str,
) -> Result<AlignedVec, TransportError> {
    let body = body.map_err(|e| malformed(what, e))?;
    if body.len() > MAX_FRAME {
        return Err(TransportError::Malformed(format!(
            "{what} of {} bytes exceeds the {MAX_FRAME}-byte frame limit",
            body.len()
        )));
    }
    Ok(body)
}

/// Encode a request body (no length prefix). Fails if it exceeds [`MAX_FRAME`].
pub fn encode_request(req: &Request) -> Result<AlignedVec, TransportError> {
    bounded(rkyv::to_bytes::<rancor::Error>(req), "request")
}

/// Encode a response body (no length prefix). Fails if it exceeds [`MAX_FRAME`].
pub fn encode_response(resp: &Response) -> Result<AlignedVec, TransportError> {
    bounded(rkyv::to_bytes::<rancor::Error>(resp), "response")
}

/// Encode an authentication message body (no length prefix).
pub fn encode_auth(msg: &AuthMessage) -> Result<AlignedVec, TransportError> {
    bounded(
        rkyv::to_bytes::<rancor::Error>(msg),
        "authentication message",
    )
}

/// Run `f` on `bytes` if they are suitably aligned for rkyv, else on an
/// aligned copy ([WI-2]).
///
/// [WI-2]: self#invariants
fn with_aligned<R>(bytes: &[u8], f: impl FnOnce(&[u8]) -> R) -> R {
    if (bytes.as_ptr() as usize) % AlignedVec::<16>::ALIGNMENT == 0 {
        f(bytes)
    } else {
        let mut copy = AlignedVec::<16>::with_capacity(bytes.len());
        copy.extend_from_slice(bytes);
        f(&copy)
    }
}

/// Decode and validate a request body. Never panics.
pub fn decode_request(bytes: &[u8]) -> Result<Request, TransportError> {
    with_aligned(bytes, rkyv::from_bytes::<Request, rancor::Error>)
        .map_err(|e| malformed("request", e))
}

/// Decode and validate a response body. Never panics.
pub fn decode_response(bytes: &[u8]) -> Result<Response, TransportError> {
    with_aligned(bytes, rkyv::from_bytes::<Response, rancor::Error>)
        .map_err(|e| malformed("response", e))
}

/// Decode and validate an authentication message body. Never panics.
pub fn decode_auth(bytes: &[u8]) -> Result<AuthMessage, TransportError> {
    with_aligned(bytes, rkyv::from_bytes::<AuthMessage, rancor::Error>)
        .map_err(|e| malformed("authentication message", e))
}

/// Why reading or writing a frame failed.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream ended cleanly before the first byte of a frame.
    #[error("stream ended before a frame")]
    Eof,
    /// The length prefix announced more than the limit (at most [`MAX_FRAME`]).
    #[error("frame of {len} bytes exceeds the {limit}-byte limit")]
    TooLarge {
        /// Announced (or attempted) length.
        len: usize,
        /// The limit in force.
        limit: usize,
    },
    /// The stream failed or ended inside a frame.
    #[error("stream error: {0}")]
    Io(#[from] std::io::Error),
}

/// Write one frame: `u32` little-endian length, then `body`.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, body: &[u8]) -> Result<(), FrameError> {
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge {
            len: body.len(),
            limit: MAX_FRAME,
        });
    }
    // MAX_FRAME < u32::MAX, so the cast is lossless.
    let len = (body.len() as u32).to_le_bytes();
    w.write_all(&len).await?;
    w.write_all(body).await?;
    Ok(())
}

/// Read one frame body of at most [`MAX_FRAME`] bytes ([TP-2]).
///
/// [TP-2]: self#invariants
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<AlignedVec, FrameError> {
    read_frame_limited(r, MAX_FRAME).await
}

/// Granularity in which a frame body buffer grows.
const READ_CHUNK: usize = 64 << 10;

/// Read one frame body of at most `limit` bytes (capped at [`MAX_FRAME`]).
///
/// The announced length is checked against the limit before anything is
/// allocated ([TP-2]), and the buffer then grows only as body bytes actually
/// arrive, so a peer that announces a large frame and sends nothing costs
/// at most one read chunk (64 KiB).
///
/// [TP-2]: self#invariants
pub async fn read_frame_limited<R: AsyncRead + Unpin>(
    r: &mut R,
    limit: usize,
) -> Result<AlignedVec, FrameError> {
    let limit = limit.min(MAX_FRAME);
    let mut prefix = [0u8; 4];
    // Distinguish a clean end of stream (no byte at all) from a truncated prefix.
    let n = r.read(&mut prefix).await?;
    if n == 0 {
        return Err(FrameError::Eof);
    }
    r.read_exact(&mut prefix[n..]).await?;
    let len = u32::from_le_bytes(prefix) as usize;
    if len > limit {
        return Err(FrameError::TooLarge { len, limit });
    }
    let mut body = AlignedVec::<16>::with_capacity(len.min(READ_CHUNK));
    while body.len() < len {
        let start = body.len();
        let chunk = (len - start).min(READ_CHUNK);
        body.resize(start + chunk, 0);
        let got = r.read(&mut body[start..]).await?;
        if got == 0 {
            return Err(FrameError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("stream ended after {start} of {len} frame bytes"),
            )));
        }
        body.resize(start + got, 0);
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample_requests() -> Vec<Request> {
        vec![
            Request::Set {
                key: "comm/0/addr".into(),
                value: b"127.0.0.1:1234".to_vec(),
            },
            Request::Get { key: "k".into() },
            Request::Wait {
                keys: vec!["a".into(), "b".into()],
                timeout_ms: 1500,
            },
            Request::Add {
                key: "n".into(),
                delta: -7,
            },
            Request::CompareSet {
                key: "c".into(),
                expected: Some(vec![1, 2, 3]),
                desired: vec![4],
            },
            Request::CompareSet {
                key: "c".into(),
                expected: None,
                desired: vec![],
            },
            Request::Delete { key: "d".into() },
            Request::DeletePrefix {
                prefix: "p/".into(),
            },
        ]
    }

    fn sample_responses() -> Vec<Response> {
        vec![
            Response::Ok,
            Response::Value(None),
            Response::Value(Some(b"v".to_vec())),
            Response::Values(vec![vec![1], vec![], vec![2, 3]]),
            Response::Int(i64::MIN),
            Response::Swapped,
            Response::Current(Some(vec![9; 100])),
            Response::Bool(true),
            Response::Error {
                kind: ErrorKind::WaitTimeout {
                    missing: vec!["x".into()],
                },
                message: "timed out".into(),
            },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for req in sample_requests() {
            let body = encode_request(&req).unwrap();
            assert_eq!(decode_request(&body).unwrap(), req);
        }
        for resp in sample_responses() {
            let body = encode_response(&resp).unwrap();
            assert_eq!(decode_response(&body).unwrap(), resp);
        }
        let auth = AuthMessage::ClientHello {
            version: PROTOCOL_VERSION,
            nonce: [7; NONCE_LEN],
        };
        assert_eq!(decode_auth(&encode_auth(&auth).unwrap()).unwrap(), auth);
    }

    #[test]
    fn unaligned_input_is_decoded_from_a_copy() {
        let req = Request::Get { key: "k".into() };
        let body = encode_request(&req).unwrap();
        let mut shifted = AlignedVec::<16>::new();
        shifted.push(0);
        shifted.extend_from_slice(&body);
        assert_eq!(decode_request(&shifted[1..]).unwrap(), req);
    }

    #[test]
    fn empty_and_garbage_bodies_are_malformed() {
        assert!(matches!(
            decode_request(&[]),
            Err(TransportError::Malformed(_))
        ));
        assert!(matches!(
            decode_response(&[0xff; 64]),
            Err(TransportError::Malformed(_))
        ));
    }

    #[tokio::test]
    async fn frames_round_trip_over_a_stream() {
        tokio::time::timeout(std::time::Duration::from_secs(30), async {
            let (mut a, mut b) = tokio::io::duplex(1 << 16);
            let body = encode_request(&sample_requests()[2]).unwrap();
            write_frame(&mut a, &body).await.unwrap();
            drop(a);
            let got = read_frame(&mut b).await.unwrap();
            assert_eq!(decode_request(&got).unwrap(), sample_requests()[2]);
            assert!(matches!(read_frame(&mut b).await, Err(FrameError::Eof)));
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn tp2_oversized_length_prefix_is_rejected_before_allocation() {
        tokio::time::timeout(std::time::Duration::from_secs(30), async {
            let (mut a, mut b) = tokio::io::duplex(64);
            // Announce u32::MAX bytes and send nothing else: if the reader
            // allocated or waited for the body, this would fail or hang.
            a.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
            match read_frame(&mut b).await {
                Err(FrameError::TooLarge { len, limit }) => {
                    assert_eq!((len, limit), (u32::MAX as usize, MAX_FRAME))
                }
                other => panic!("unexpected {other:?}"),
            }
            let too_big = ((MAX_FRAME + 1) as u32).to_le_bytes();
            a.write_all(&too_big).await.unwrap();
            assert!(matches!(
                read_frame(&mut b).await,
                Err(FrameError::TooLarge { .. })
            ));
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn read_frame_limited_enforces_a_smaller_limit() {
        tokio::time::timeout(std::time::Duration::from_secs(30), async {
            let (mut a, mut b) = tokio::io::duplex(4096);
            write_frame(&mut a, &[0u8; 100]).await.unwrap();
            match read_frame_limited(&mut b, 99).await {
                Err(FrameError::TooLarge { len, limit }) => assert_eq!((len, limit), (100, 99)),
                other => panic!("unexpected {other:?}"),
            }
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn truncated_frame_is_an_io_error() {
        tokio::time::timeout(std::time::Duration::from_secs(30), async {
            let (mut a, mut b) = tokio::io::duplex(64);
            a.write_all(&10u32.to_le_bytes()).await.unwrap();
            a.write_all(&[1, 2, 3]).await.unwrap();
            drop(a);
            assert!(matches!(read_frame(&mut b).await, Err(FrameError::Io(_))));
        })
        .await
        .unwrap();
    }

    #[test]
    fn oversized_message_is_refused_by_the_encoder() {
        let req = Request::Set {
            key: "big".into(),
            value: vec![0; MAX_FRAME + 1],
        };
        assert!(matches!(
            encode_request(&req),
            Err(TransportError::Malformed(_))
        ));
    }

    fn valid_bodies() -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = sample_requests()
            .iter()
            .map(|r| encode_request(r).unwrap().to_vec())
            .collect();
        v.extend(
            sample_responses()
                .iter()
                .map(|r| encode_response(r).unwrap().to_vec()),
        );
        v.push(
            encode_auth(&AuthMessage::ServerProof {
                proof: [3; PROOF_LEN],
            })
            .unwrap()
            .to_vec(),
        );
        v
    }

    fn decode_all(bytes: &[u8]) {
        let _ = decode_request(bytes);
        let _ = decode_response(bytes);
        let _ = decode_auth(bytes);
    }

    proptest! {
        // Fuzzing for wire decoding: arbitrary bytes never panic a decoder (WI-1).
        #[test]
        fn wi1_decoders_never_panic_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            decode_all(&bytes);
        }

        // Fuzzing for wire decoding: mutations of valid frames (byte flips,
        // truncation, extension) are rejected or decoded, never panic (WI-1).
        #[test]
        fn wi1_decoders_never_panic_on_mutated_frames(
            which in 0usize..17,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
            cut in any::<usize>(),
            tail in proptest::collection::vec(any::<u8>(), 0..16),
        ) {
            let bodies = valid_bodies();
            let mut body = bodies[which % bodies.len()].clone();
            for (pos, val) in flips {
                if !body.is_empty() {
                    let i = pos % body.len();
                    body[i] ^= val;
                }
            }
            decode_all(&body);
            let cut = cut % (body.len() + 1);
            decode_all(&body[..cut]);
            body.extend_from_slice(&tail);
            decode_all(&body);
        }
    }
}
