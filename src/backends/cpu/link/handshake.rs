//! The data-link handshake: proving the job secret in both directions, with a
//! fresh nonce from each side, before a TCP connection carries frames.
//!
//! Four messages, each a [`PREAMBLE_LEN`]-byte preamble (magic `b"CHLK"`,
//! protocol version `u16`, body length `u16`, little endian) followed by a
//! validated rkyv archive of one [`LinkMsg`]:
//!
//! 1. connector → acceptor, `Hello { from, to, epoch, nonce_c, mac_h }`
//! 2. acceptor → connector, `Answer { from, to, epoch, nonce_a, mac_a }`
//! 3. connector → acceptor, `Confirm { mac_c }`
//! 4. acceptor → connector, `Verdict { take }`
//!
//! with, for a job-secret key `K` and the communicator's store prefix `P`
//! (length-prefixed), `c` the connector and `a` the acceptor:
//! - `mac_h = HMAC(K, "chorus-link-v2-hello"  || P || c || a || epoch || nonce_c)`
//! - `mac_a = HMAC(K, "chorus-link-v2-answer" || P || c || a || epoch || nonce_c || nonce_a || mac_h)`
//! - `mac_c = HMAC(K, "chorus-link-v2-confirm"|| P || c || a || epoch || nonce_c || nonce_a || mac_a)`
//!
//! The connector knows the acceptor holds the secret once `mac_a` verifies
//! (it covers the connector's fresh nonce); the acceptor knows the same of
//! the connector once `mac_c` verifies (it covers the acceptor's fresh
//! nonce). A recorded hello replayed to an acceptor therefore gets an answer
//! but never a valid confirm, and a reflected message never verifies because
//! each step signs under its own label.
//!
//! Links open on demand ([`pool`](super::pool)), so both ranks of a pair
//! may dial each other at once. The verdict settles which connection the
//! pair keeps: the acceptor decides once the confirm verified (its caller's
//! `decide`), and a connection whose verdict is `take = false` is closed
//! without carrying a frame.
//!
//! # Invariants
//! - LK-5: the decoders never panic and never allocate more than
//!   [`MAX_BODY`] bytes, whatever a peer sends: the preamble is checked first,
//!   and the body is decoded only after rkyv's validation succeeds.
//! - LK-6: an acceptor reports a connection as authenticated only after the
//!   confirm verified, so a replayed hello never occupies a rank's slot.

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use rkyv::rancor;
use rkyv::util::AlignedVec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, Result};
use crate::transport::TransportError;

/// Magic that opens every handshake message.
const MAGIC: [u8; 4] = *b"CHLK";
/// Version of the data-link protocol (frames and handshake).
pub(crate) const LINK_VERSION: u16 = 3;
/// Size of the preamble before each handshake body.
pub(crate) const PREAMBLE_LEN: usize = 8;
/// Largest handshake body accepted ([LK-5](self#invariants)).
pub(crate) const MAX_BODY: usize = 512;
/// Length of each side's nonce.
const NONCE_LEN: usize = 16;

const HELLO_LABEL: &[u8] = b"chorus-link-v2-hello";
const ANSWER_LABEL: &[u8] = b"chorus-link-v2-answer";
const CONFIRM_LABEL: &[u8] = b"chorus-link-v2-confirm";

/// One handshake message. rkyv's derive generates an `Archived` twin whose
/// fields carry no docs; every field here is documented on the variant.
#[allow(missing_docs)]
mod messages {
    use super::NONCE_LEN;

    /// A handshake message; see the module docs for what each MAC covers.
    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub(crate) enum LinkMsg {
        /// Connector `from` asks acceptor `to` for a link in `epoch`.
        Hello {
            from: u32,
            to: u32,
            epoch: u64,
            nonce: [u8; NONCE_LEN],
            mac: [u8; 32],
        },
        /// Acceptor `from` answers connector `to` with its own nonce.
        Answer {
            from: u32,
            to: u32,
            epoch: u64,
            nonce: [u8; NONCE_LEN],
            mac: [u8; 32],
        },
        /// The connector's proof over the acceptor's nonce.
        Confirm { mac: [u8; 32] },
        /// Whether the acceptor keeps this connection as the pair's link
        /// (`false`: the pair keeps the one the acceptor dialed).
        Verdict { take: bool },
    }
}
pub(crate) use messages::LinkMsg;

/// Encode `msg` with its preamble.
pub(crate) fn encode_msg(msg: &LinkMsg) -> Result<Vec<u8>> {
    let body = rkyv::to_bytes::<rancor::Error>(msg)
        .map_err(|e| Error::Internal(format!("encoding a link handshake message: {e}")))?;
    if body.len() > MAX_BODY {
        return Err(Error::Internal(format!(
            "link handshake message of {} bytes exceeds {MAX_BODY}",
            body.len()
        )));
    }
    let mut out = Vec::with_capacity(PREAMBLE_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&LINK_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u16).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Check a preamble; returns the body length ([LK-5](self#invariants)).
pub(crate) fn check_preamble(p: &[u8; PREAMBLE_LEN]) -> std::result::Result<usize, String> {
    if p[0..4] != MAGIC {
        return Err("bad magic (not a chorus data link)".into());
    }
    let version = u16::from_le_bytes([p[4], p[5]]);
    if version != LINK_VERSION {
        return Err(format!(
            "link protocol version {version}, this rank speaks {LINK_VERSION}"
        ));
    }
    let len = usize::from(u16::from_le_bytes([p[6], p[7]]));
    if len > MAX_BODY {
        return Err(format!("handshake body of {len} bytes exceeds {MAX_BODY}"));
    }
    Ok(len)
}

/// Decode a body (validated before use, [LK-5](self#invariants)).
pub(crate) fn decode_body(body: &[u8]) -> std::result::Result<LinkMsg, String> {
    let mut aligned = AlignedVec::<16>::with_capacity(body.len());
    aligned.extend_from_slice(body);
    rkyv::from_bytes::<LinkMsg, rancor::Error>(&aligned)
        .map_err(|e| format!("malformed handshake message: {e}"))
}

/// Decode one whole message (preamble and body) from `bytes`.
#[cfg(test)]
pub(crate) fn decode_msg(bytes: &[u8]) -> std::result::Result<LinkMsg, String> {
    let pre: &[u8; PREAMBLE_LEN] = bytes
        .get(..PREAMBLE_LEN)
        .and_then(|p| p.try_into().ok())
        .ok_or("truncated handshake preamble")?;
    let len = check_preamble(pre)?;
    let body = bytes
        .get(PREAMBLE_LEN..PREAMBLE_LEN + len)
        .ok_or("truncated handshake body")?;
    decode_body(body)
}

async fn read_msg<S: AsyncRead + Unpin>(s: &mut S) -> std::result::Result<LinkMsg, String> {
    let mut pre = [0u8; PREAMBLE_LEN];
    s.read_exact(&mut pre)
        .await
        .map_err(|e| format!("connection closed during the handshake ({e})"))?;
    let len = check_preamble(&pre)?;
    let mut body = [0u8; MAX_BODY];
    s.read_exact(&mut body[..len])
        .await
        .map_err(|e| format!("connection closed inside a handshake message ({e})"))?;
    decode_body(&body[..len])
}

async fn write_msg<S: AsyncWrite + Unpin>(
    s: &mut S,
    msg: &LinkMsg,
) -> std::result::Result<(), String> {
    let bytes = encode_msg(msg).map_err(|e| e.to_string())?;
    s.write_all(&bytes)
        .await
        .map_err(|e| format!("sending a handshake message failed: {e}"))
}

/// The job secret and scope shared by all handshakes of one setup.
pub(crate) struct Auth {
    key: hmac::Key,
    prefix: String,
}

impl Auth {
    /// Handshakes of the communicator whose store keys start with `prefix`.
    pub(crate) fn new(secret: &[u8], prefix: &str) -> Auth {
        Auth {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
            prefix: prefix.to_string(),
        }
    }

    /// `label || len(P) || P || c || a || epoch || parts...`.
    fn input(&self, label: &[u8], c: u32, a: u32, epoch: u64, parts: &[&[u8]]) -> Vec<u8> {
        let mut m = Vec::with_capacity(128 + self.prefix.len());
        m.extend_from_slice(label);
        m.extend_from_slice(&(self.prefix.len() as u64).to_le_bytes());
        m.extend_from_slice(self.prefix.as_bytes());
        m.extend_from_slice(&u64::from(c).to_le_bytes());
        m.extend_from_slice(&u64::from(a).to_le_bytes());
        m.extend_from_slice(&epoch.to_le_bytes());
        for p in parts {
            m.extend_from_slice(p);
        }
        m
    }

    fn sign(&self, input: &[u8]) -> [u8; 32] {
        let mut out = [0u8; 32];
        out.copy_from_slice(hmac::sign(&self.key, input).as_ref());
        out
    }

    /// Constant-time check of `mac` over `input`.
    fn verify(&self, input: &[u8], mac: &[u8; 32]) -> bool {
        hmac::verify(&self.key, input, mac).is_ok()
    }

    fn hello_input(&self, c: u32, a: u32, epoch: u64, nonce_c: &[u8; NONCE_LEN]) -> Vec<u8> {
        self.input(HELLO_LABEL, c, a, epoch, &[nonce_c])
    }

    fn answer_input(&self, c: u32, a: u32, epoch: u64, n: &Nonces, mac_h: &[u8; 32]) -> Vec<u8> {
        self.input(ANSWER_LABEL, c, a, epoch, &[&n.c, &n.a, mac_h])
    }

    fn confirm_input(&self, c: u32, a: u32, epoch: u64, n: &Nonces, mac_a: &[u8; 32]) -> Vec<u8> {
        self.input(CONFIRM_LABEL, c, a, epoch, &[&n.c, &n.a, mac_a])
    }
}

/// Both sides' nonces of one handshake.
struct Nonces {
    c: [u8; NONCE_LEN],
    a: [u8; NONCE_LEN],
}

fn fresh_nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    SystemRandom::new()
        .fill(&mut n)
        .map_err(|_| Error::Internal("system random generator failed".into()))?;
    Ok(n)
}

fn rank32(r: usize) -> Result<u32> {
    u32::try_from(r).map_err(|_| Error::Internal(format!("rank {r} does not fit in u32")))
}

fn auth_failed(peer: impl std::fmt::Display, detail: impl Into<String>) -> Error {
    Error::Transport(TransportError::AuthFailed {
        peer: peer.to_string(),
        detail: detail.into(),
    })
}

/// Connector side: prove the secret to `peer` and check its proof; `true`
/// when the peer keeps this connection as the pair's link (its verdict).
///
/// # Errors
/// `Transport(AuthFailed)` when the peer does not answer with a valid proof
/// (another job secret, communicator or epoch) or closes the connection.
pub(crate) async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    auth: &Auth,
    me: usize,
    peer: usize,
    epoch: u64,
    stream: &mut S,
) -> Result<bool> {
    connect_attempt(auth, me, peer, epoch, stream)
        .await
        .map_err(|r| r.error)
}

/// Why a [`connect_attempt`] failed.
#[derive(Debug)]
pub(crate) struct Refusal {
    /// The error [`connect`] reports.
    pub(crate) error: Error,
    /// The peer closed the connection before it answered our hello: it
    /// rejected our proof, or its listener closed the connection unread to
    /// make room (LK-12), so another connection may succeed.
    pub(crate) unanswered: bool,
}

/// [`connect`], saying whether the peer closed the connection unanswered.
pub(crate) async fn connect_attempt<S: AsyncRead + AsyncWrite + Unpin>(
    auth: &Auth,
    me: usize,
    peer: usize,
    epoch: u64,
    stream: &mut S,
) -> std::result::Result<bool, Refusal> {
    let failed = |error: Error| Refusal {
        error,
        unanswered: false,
    };
    let (c, a) = (rank32(me).map_err(failed)?, rank32(peer).map_err(failed)?);
    let who = format!("rank {peer} data link");
    let nonce_c = fresh_nonce().map_err(failed)?;
    let mac_h = auth.sign(&auth.hello_input(c, a, epoch, &nonce_c));
    let hello = LinkMsg::Hello {
        from: c,
        to: a,
        epoch,
        nonce: nonce_c,
        mac: mac_h,
    };
    // A write can fail when the peer has already closed the connection.
    write_msg(stream, &hello).await.map_err(|d| Refusal {
        error: auth_failed(&who, d),
        unanswered: true,
    })?;
    let answer = read_msg(stream).await.map_err(|d| Refusal {
        error: auth_failed(
            &who,
            format!(
                "{d}; rank {peer} rejected our proof (different job secret, communicator or epoch?)"
            ),
        ),
        unanswered: true,
    })?;
    let LinkMsg::Answer {
        from,
        to,
        epoch: e,
        nonce: nonce_a,
        mac: mac_a,
    } = answer
    else {
        return Err(failed(auth_failed(&who, "expected an answer to our hello")));
    };
    if from != a || to != c || e != epoch {
        return Err(failed(auth_failed(
            &who,
            format!("answer does not match our hello (from {from}, to {to}, epoch {e})"),
        )));
    }
    let nonces = Nonces {
        c: nonce_c,
        a: nonce_a,
    };
    if !auth.verify(&auth.answer_input(c, a, epoch, &nonces, &mac_h), &mac_a) {
        return Err(failed(auth_failed(
            &who,
            format!("rank {peer} could not prove the job secret"),
        )));
    }
    let confirm = LinkMsg::Confirm {
        mac: auth.sign(&auth.confirm_input(c, a, epoch, &nonces, &mac_a)),
    };
    write_msg(stream, &confirm)
        .await
        .map_err(|d| failed(auth_failed(&who, d)))?;
    match read_msg(stream).await {
        Ok(LinkMsg::Verdict { take }) => Ok(take),
        Ok(_) => Err(failed(auth_failed(&who, "expected a verdict on our link"))),
        Err(d) => Err(failed(auth_failed(
            &who,
            format!("{d}; rank {peer} closed the link before its verdict"),
        ))),
    }
}

/// Acceptor side: run the whole handshake on an accepted connection.
/// Once the connector's confirm verified ([LK-6](self#invariants)),
/// `decide(rank)` says whether this connection becomes the pair's link,
/// and the verdict is sent. Returns the connector's rank and the verdict,
/// or why the connection is refused.
pub(crate) async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    auth: &Auth,
    me: usize,
    size: usize,
    epoch: u64,
    stream: &mut S,
    decide: impl FnOnce(usize) -> bool,
) -> std::result::Result<(usize, bool), String> {
    let a = rank32(me).map_err(|e| e.to_string())?;
    let LinkMsg::Hello {
        from: c,
        to,
        epoch: e,
        nonce: nonce_c,
        mac: mac_h,
    } = read_msg(stream).await?
    else {
        return Err("first message is not a hello".into());
    };
    let from = c as usize;
    if to != a || from == me || from >= size || e != epoch {
        return Err(format!(
            "hello from rank {from} to rank {to} for epoch {e} does not fit this rank {me} of {size}, epoch {epoch}"
        ));
    }
    if !auth.verify(&auth.hello_input(c, a, epoch, &nonce_c), &mac_h) {
        return Err(format!(
            "claimed rank {from} could not prove the job secret"
        ));
    }
    let nonces = Nonces {
        c: nonce_c,
        a: fresh_nonce().map_err(|e| e.to_string())?,
    };
    let mac_a = auth.sign(&auth.answer_input(c, a, epoch, &nonces, &mac_h));
    let answer = LinkMsg::Answer {
        from: a,
        to: c,
        epoch,
        nonce: nonces.a,
        mac: mac_a,
    };
    write_msg(stream, &answer).await?;
    let LinkMsg::Confirm { mac: mac_c } = read_msg(stream).await? else {
        return Err(format!("claimed rank {from} sent no confirm"));
    };
    if !auth.verify(&auth.confirm_input(c, a, epoch, &nonces, &mac_a), &mac_c) {
        return Err(format!(
            "claimed rank {from} could not prove the job secret over our nonce (a replayed hello?)"
        ));
    }
    let take = decide(from);
    write_msg(stream, &LinkMsg::Verdict { take }).await?;
    Ok((from, take))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn messages_round_trip_with_their_preamble() {
        let m = LinkMsg::Hello {
            from: 3,
            to: 1,
            epoch: 9,
            nonce: [7; NONCE_LEN],
            mac: [1; 32],
        };
        let bytes = encode_msg(&m).unwrap();
        assert_eq!(&bytes[..4], b"CHLK");
        assert_eq!(decode_msg(&bytes).unwrap(), m);
        let c = LinkMsg::Confirm { mac: [2; 32] };
        assert_eq!(decode_msg(&encode_msg(&c).unwrap()).unwrap(), c);
    }

    #[test]
    fn preamble_errors_name_the_problem() {
        let mut b = encode_msg(&LinkMsg::Confirm { mac: [0; 32] }).unwrap();
        b[4] = 1;
        assert!(decode_msg(&b).unwrap_err().contains("version 1"));
        assert!(decode_msg(b"GET / HTTP/1.1\r\n")
            .unwrap_err()
            .contains("magic"));
        let mut big = *b"CHLK\x03\x00\xff\xff";
        assert!(check_preamble(&big).unwrap_err().contains("exceeds"));
        big[6] = 0;
        big[7] = 0;
        assert!(decode_msg(&big).is_err());
    }

    #[test]
    fn both_sides_authenticate_over_a_duplex() {
        let rt = rt();
        let (mut x, mut y) = tokio::io::duplex(4096);
        let auth = Auth::new(b"secret", "job/world/0");
        let (c, a) = rt.block_on(async {
            tokio::join!(
                connect(&auth, 2, 0, 5, &mut x),
                accept(&auth, 0, 4, 5, &mut y, |_| true)
            )
        });
        assert!(c.unwrap(), "the acceptor took the link");
        assert_eq!(a.unwrap(), (2, true));
        // A lower rank may dial too, and the verdict reaches the connector.
        let (mut x, mut y) = tokio::io::duplex(4096);
        let (c, a) = rt.block_on(async {
            tokio::join!(
                connect(&auth, 1, 3, 5, &mut x),
                accept(&auth, 3, 4, 5, &mut y, |from| from > 3)
            )
        });
        assert!(!c.unwrap(), "the acceptor declined the link");
        assert_eq!(a.unwrap(), (1, false));
    }

    #[test]
    fn a_wrong_secret_is_refused_on_both_sides() {
        let rt = rt();
        let (mut x, mut y) = tokio::io::duplex(4096);
        let good = Auth::new(b"secret", "p");
        let bad = Auth::new(b"guess", "p");
        let (c, a) = rt.block_on(async {
            let acc = async {
                let r = accept(&good, 0, 2, 0, &mut y, |_| true).await;
                drop(y);
                r
            };
            tokio::join!(connect(&bad, 1, 0, 0, &mut x), acc)
        });
        assert!(a.unwrap_err().contains("could not prove"));
        assert!(matches!(
            c.unwrap_err(),
            Error::Transport(TransportError::AuthFailed { .. })
        ));
        // The other communicator's prefix is refused the same way.
        let (mut x, mut y) = tokio::io::duplex(4096);
        let other = Auth::new(b"secret", "q");
        let a = rt.block_on(async {
            let acc = async {
                let r = accept(&good, 0, 2, 0, &mut y, |_| true).await;
                drop(y);
                r
            };
            tokio::join!(connect(&other, 1, 0, 0, &mut x), acc).1
        });
        assert!(a.unwrap_err().contains("could not prove"));
    }

    /// A connection closed before the answer (a wrong secret, or a
    /// listener making room, LK-12) is told apart from a bad answer: only
    /// the first is worth another connection.
    #[test]
    fn a_connection_closed_unanswered_is_told_apart_from_a_bad_answer() {
        let rt = rt();
        let auth = Auth::new(b"secret", "p");
        let (mut x, y) = tokio::io::duplex(4096);
        drop(y);
        let r = rt.block_on(connect_attempt(&auth, 1, 0, 0, &mut x));
        assert!(r.unwrap_err().unanswered);
        // An acceptor with another secret reads the hello, then closes.
        let (mut x, mut y) = tokio::io::duplex(4096);
        let other = Auth::new(b"other", "p");
        let r = rt.block_on(async {
            let acc = async {
                let r = accept(&other, 0, 2, 0, &mut y, |_| true).await;
                drop(y);
                r
            };
            tokio::join!(connect_attempt(&auth, 1, 0, 0, &mut x), acc).0
        });
        assert!(r.unwrap_err().unanswered);
        // An answer that does not verify is final.
        let (mut x, mut y) = tokio::io::duplex(4096);
        let r = rt.block_on(async {
            let forge = async {
                let _hello = read_msg(&mut y).await;
                let answer = LinkMsg::Answer {
                    from: 0,
                    to: 1,
                    epoch: 0,
                    nonce: [0; NONCE_LEN],
                    mac: [0; 32],
                };
                write_msg(&mut y, &answer).await
            };
            tokio::join!(connect_attempt(&auth, 1, 0, 0, &mut x), forge).0
        });
        let r = r.unwrap_err();
        assert!(!r.unanswered);
        assert!(
            r.error.to_string().contains("could not prove"),
            "{}",
            r.error
        );
    }

    #[test]
    fn a_replayed_hello_and_confirm_are_refused() {
        // An eavesdropper recorded a whole legitimate handshake: the hello
        // and the confirm. Replayed to the acceptor, the hello verifies and
        // is answered with a new nonce, so the old confirm cannot verify.
        let rt = rt();
        let auth = Auth::new(b"secret", "p");
        let (c, a, epoch) = (1u32, 0u32, 3u64);
        let nonce_c = [4u8; NONCE_LEN];
        let mac_h = auth.sign(&auth.hello_input(c, a, epoch, &nonce_c));
        let hello = LinkMsg::Hello {
            from: c,
            to: a,
            epoch,
            nonce: nonce_c,
            mac: mac_h,
        };
        let recorded = Nonces {
            c: nonce_c,
            a: [9u8; NONCE_LEN],
        };
        let old_mac_a = auth.sign(&auth.answer_input(c, a, epoch, &recorded, &mac_h));
        let old_confirm = LinkMsg::Confirm {
            mac: auth.sign(&auth.confirm_input(c, a, epoch, &recorded, &old_mac_a)),
        };
        let (mut x, mut y) = tokio::io::duplex(4096);
        let r = rt.block_on(async {
            let replay = async {
                write_msg(&mut x, &hello).await.unwrap();
                let answer = read_msg(&mut x).await.unwrap();
                assert!(matches!(answer, LinkMsg::Answer { nonce, .. } if nonce != recorded.a));
                write_msg(&mut x, &old_confirm).await.unwrap();
            };
            tokio::join!(replay, accept(&auth, 0, 2, epoch, &mut y, |_| true)).1
        });
        assert!(
            r.unwrap_err().contains("replayed"),
            "replay must be refused"
        );
    }

    #[test]
    fn a_reflected_hello_is_not_an_answer() {
        let rt = rt();
        let auth = Auth::new(b"secret", "p");
        let (mut x, mut y) = tokio::io::duplex(4096);
        let r = rt.block_on(async {
            let mirror = async {
                let hello = read_msg(&mut y).await.unwrap();
                write_msg(&mut y, &hello).await.unwrap();
            };
            tokio::join!(connect(&auth, 1, 0, 0, &mut x), mirror).0
        });
        assert!(r.unwrap_err().to_string().contains("expected an answer"));
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..700)) {
            let _ = decode_msg(&bytes);
            let _ = decode_body(&bytes);
        }

        #[test]
        fn decoding_a_valid_preamble_with_garbage_never_panics(
            body in proptest::collection::vec(any::<u8>(), 0..MAX_BODY)
        ) {
            let mut b = Vec::from(MAGIC);
            b.extend_from_slice(&LINK_VERSION.to_le_bytes());
            b.extend_from_slice(&(body.len() as u16).to_le_bytes());
            b.extend_from_slice(&body);
            let _ = decode_msg(&b);
        }
    }
}
