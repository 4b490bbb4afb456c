//! QUIC endpoints with TLS 1.3 (self-signed server certificates) and the
//! job-secret HMAC challenge.
//!
//! # Trust model
//! Ranks of a job share a secret (`CHORUS_SECRET`), not a PKI. The server
//! presents a freshly generated self-signed certificate; the client accepts
//! any certificate ([`SelfSignedServerVerifier`]) but still checks the TLS 1.3
//! handshake signature with it, so the TLS session is keyed to whoever holds
//! that certificate's private key. Who that is gets settled by the secret: on
//! the first bidirectional stream of every connection both sides prove it
//! with HMAC-SHA256 over fresh nonces *and* a value exported from this TLS
//! session (RFC 5705/8446 exporter). A man in the middle terminates two
//! different TLS sessions, so proofs it relays do not verify; a proof is
//! never valid for another connection or for the other role.
//!
//! # Protocol (stream 0, [`AuthMessage`] frames)
//! 1. client → server `ClientHello { version, nonce: cn }`
//! 2. server → client `ServerHello { nonce: sn }`
//! 3. client → server `ClientProof { HMAC(secret, ctx("client")) }`
//! 4. server → client `ServerProof { HMAC(secret, ctx("server")) }` (only if 3 verified)
//!
//! where `ctx(role) = "chorus-auth-v1" 0x00 role 0x00 sn cn exporter`. The
//! server never reveals a secret-derived value to an unauthenticated client.
//! A failed check closes the connection with [`CLOSE_AUTH_FAILED`]; the
//! client maps that to [`TransportError::AuthFailed`].
//!
//! # Invariants
//! - TP-1: the server accepts no other stream before step 3 verified (see
//!   [`store`](super::store)); the client sends no request before step 4 verified.
//! - AU-1: proofs are compared in constant time (`ring::hmac::verify`).
//! - AU-2: an empty secret is refused on both sides.

use std::sync::Arc;
use std::time::Duration;

use quinn::{ConnectionError, VarInt};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

use super::wire::{self, AuthMessage, FrameError, NONCE_LEN, PROOF_LEN, PROTOCOL_VERSION};
use super::TransportError;

/// ALPN protocol identifier of the Chorus control plane.
pub const ALPN: &[u8] = b"chorus/1";

/// Server name the client asks for (the certificate is self-signed for it;
/// the name is not what authenticates the server, the secret is).
pub const SERVER_NAME: &str = "chorus-rendezvous";

/// Application close code: normal close (client finished, or dropped).
pub const CLOSE_NORMAL: u32 = 0;
/// Application close code: the peer did not prove the job secret.
pub const CLOSE_AUTH_FAILED: u32 = 0x4301;
/// Application close code: the peer sent a malformed or oversized frame.
pub const CLOSE_MALFORMED: u32 = 0x4302;
/// Application close code: protocol violation (wrong message, wrong version).
pub const CLOSE_PROTOCOL: u32 = 0x4303;
/// Application close code: the server is shutting down.
pub const CLOSE_SHUTDOWN: u32 = 0x4304;
/// Application close code: the peer did not finish authenticating in time.
/// Not a wrong secret: a busy server, or a slow path (a client retries).
pub const CLOSE_AUTH_TIMEOUT: u32 = 0x4305;

/// Connections with no traffic for this long are closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Keep-alive interval (well under [`IDLE_TIMEOUT`]).
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// How long the authentication exchange may take once connected.
pub const AUTH_TIMEOUT: Duration = Duration::from_secs(10);

/// Concurrent requests (bidirectional streams) an authenticated client may
/// have open. Before authentication a client gets credit for one stream only
/// (the challenge's), so [TP-1] also holds at the QUIC flow-control level.
///
/// [TP-1]: self#invariants
pub const MAX_CONCURRENT_REQUESTS: u32 = 1024;

/// Bytes a peer may have in flight on one stream / on one connection: bounds
/// what an (unauthenticated or misbehaving) peer can make us buffer. Frames
/// larger than the stream window still pass; credit is renewed as we read.
const STREAM_WINDOW: u32 = 4 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;

/// Authentication messages are tiny; an unauthenticated peer may not make
/// us buffer more than this.
const MAX_AUTH_FRAME: usize = 1024;

const AUTH_DOMAIN: &[u8] = b"chorus-auth-v1";
const ROLE_CLIENT: &[u8] = b"client";
const ROLE_SERVER: &[u8] = b"server";
const EXPORTER_LABEL: &[u8] = b"EXPORTER-chorus-auth-v1";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::Io(format!("TLS/QUIC configuration: {e}"))
}

/// The initial RTT estimate for a store on a loopback address: quinn's
/// default (333 ms) makes a lost first packet (a store not bound yet) cost
/// a whole second; on loopback the first retransmit comes in tens of ms.
pub const LOOPBACK_INITIAL_RTT: Duration = Duration::from_millis(5);

fn transport_config(server: bool) -> Result<Arc<quinn::TransportConfig>, TransportError> {
    transport_config_with(server, None)
}

fn transport_config_with(
    server: bool,
    initial_rtt: Option<Duration>,
) -> Result<Arc<quinn::TransportConfig>, TransportError> {
    let mut t = quinn::TransportConfig::default();
    if let Some(rtt) = initial_rtt {
        t.initial_rtt(rtt);
    }
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(IDLE_TIMEOUT).map_err(tls_err)?,
    ));
    t.keep_alive_interval(Some(KEEP_ALIVE));
    // Only clients open streams, and only bidirectional ones; the server
    // grants more than the challenge stream only after authentication.
    t.max_concurrent_uni_streams(VarInt::from_u32(0));
    t.max_concurrent_bidi_streams(VarInt::from_u32(if server { 1 } else { 0 }));
    t.stream_receive_window(VarInt::from_u32(STREAM_WINDOW));
    t.receive_window(VarInt::from_u32(CONNECTION_WINDOW));
    Ok(Arc::new(t))
}

/// A QUIC server configuration with a freshly generated self-signed
/// certificate, TLS 1.3 only, ALPN [`ALPN`].
pub fn server_config() -> Result<quinn::ServerConfig, TransportError> {
    let certified = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()])
        .map_err(|e| tls_err(format!("generating a self-signed certificate: {e}")))?;
    let cert = certified.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        certified.signing_key.serialize_der(),
    ));
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .map_err(tls_err)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    // 0-RTT data would be replayable; the control plane does not need it.
    tls.max_early_data_size = 0;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(tls_err)?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(transport_config(true)?);
    Ok(cfg)
}

/// A QUIC client configuration that accepts the server's self-signed
/// certificate (see the module docs for why that is sound here), TLS 1.3
/// only, ALPN [`ALPN`].
pub fn client_config() -> Result<quinn::ClientConfig, TransportError> {
    client_config_with(None)
}

/// [`client_config`] for a server at `peer`: on a loopback address the
/// initial RTT is [`LOOPBACK_INITIAL_RTT`].
pub fn client_config_for(peer: std::net::IpAddr) -> Result<quinn::ClientConfig, TransportError> {
    client_config_with(peer.is_loopback().then_some(LOOPBACK_INITIAL_RTT))
}

fn client_config_with(
    initial_rtt: Option<Duration>,
) -> Result<quinn::ClientConfig, TransportError> {
    let provider = provider();
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(SelfSignedServerVerifier { provider }))
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(tls_err)?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(transport_config_with(false, initial_rtt)?);
    Ok(cfg)
}

/// Accepts any server certificate (servers are authenticated by the job
/// secret, bound to the TLS session) but verifies the TLS 1.3 handshake
/// signature against it with the ring provider's algorithms.
#[derive(Debug)]
pub struct SelfSignedServerVerifier {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for SelfSignedServerVerifier {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        // Only TLS 1.3 is configured; a TLS 1.2 handshake is a peer error.
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls13RequiredForQuic,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Classify a connection error seen by a client.
///
/// An application close with [`CLOSE_AUTH_FAILED`] becomes `AuthFailed`,
/// everything else `ConnectionLost`.
pub fn connection_error(peer: &str, err: &ConnectionError) -> TransportError {
    match err {
        ConnectionError::ApplicationClosed(close)
            if close.error_code == VarInt::from_u32(CLOSE_AUTH_FAILED) =>
        {
            TransportError::AuthFailed {
                peer: peer.to_string(),
                detail: format!(
                    "the server refused us: {}",
                    String::from_utf8_lossy(&close.reason)
                ),
            }
        }
        ConnectionError::ApplicationClosed(close)
            if close.error_code == VarInt::from_u32(CLOSE_SHUTDOWN) =>
        {
            TransportError::ConnectionLost {
                addr: peer.to_string(),
                detail: "the rendezvous server shut down".to_string(),
            }
        }
        ConnectionError::ApplicationClosed(close)
            if close.error_code == VarInt::from_u32(CLOSE_AUTH_TIMEOUT) =>
        {
            TransportError::ConnectionLost {
                addr: peer.to_string(),
                detail: "the rendezvous server closed the connection before the secret \
                         check finished (it is busy, or the path to it is slow; this is not \
                         a wrong secret)"
                    .to_string(),
            }
        }
        other => TransportError::ConnectionLost {
            addr: peer.to_string(),
            detail: other.to_string(),
        },
    }
}

/// Map a stream/frame failure on `conn`: if the connection is closed, its
/// reason decides (see [`connection_error`]); otherwise the frame error.
pub fn frame_error(conn: &quinn::Connection, err: FrameError) -> TransportError {
    let peer = conn.remote_address().to_string();
    if let Some(reason) = conn.close_reason() {
        return connection_error(&peer, &reason);
    }
    match err {
        FrameError::TooLarge { .. } => TransportError::Malformed(err.to_string()),
        FrameError::Eof => TransportError::ConnectionLost {
            addr: peer,
            detail: "the peer ended the stream without answering".to_string(),
        },
        FrameError::Io(e) => TransportError::ConnectionLost {
            addr: peer,
            detail: e.to_string(),
        },
    }
}

fn random_nonce() -> Result<[u8; NONCE_LEN], TransportError> {
    let mut nonce = [0u8; NONCE_LEN];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| TransportError::Io("system random number generator failed".into()))?;
    Ok(nonce)
}

fn exporter(conn: &quinn::Connection) -> Result<[u8; 32], TransportError> {
    let mut out = [0u8; 32];
    conn.export_keying_material(&mut out, EXPORTER_LABEL, b"")
        .map_err(|_| TransportError::Io("TLS keying-material export failed".into()))?;
    Ok(out)
}

/// The message both proofs are computed over, for `role`.
fn proof_input(
    role: &[u8],
    server_nonce: &[u8; NONCE_LEN],
    client_nonce: &[u8; NONCE_LEN],
    exporter: &[u8; 32],
) -> Vec<u8> {
    let mut m = Vec::with_capacity(AUTH_DOMAIN.len() + role.len() + 2 + 2 * NONCE_LEN + 32);
    m.extend_from_slice(AUTH_DOMAIN);
    m.push(0);
    m.extend_from_slice(role);
    m.push(0);
    m.extend_from_slice(server_nonce);
    m.extend_from_slice(client_nonce);
    m.extend_from_slice(exporter);
    m
}

fn prove(key: &hmac::Key, input: &[u8]) -> [u8; PROOF_LEN] {
    let tag = hmac::sign(key, input);
    let mut out = [0u8; PROOF_LEN];
    out.copy_from_slice(tag.as_ref());
    out
}

fn check_secret(secret: &[u8]) -> Result<(), TransportError> {
    if secret.is_empty() {
        return Err(TransportError::Io(
            "the job secret is empty; set CHORUS_SECRET to the same random value on every rank"
                .into(),
        ));
    }
    Ok(())
}

async fn send_auth(
    conn: &quinn::Connection,
    send: &mut quinn::SendStream,
    msg: &AuthMessage,
) -> Result<(), TransportError> {
    let body = wire::encode_auth(msg)?;
    wire::write_frame(send, &body)
        .await
        .map_err(|e| frame_error(conn, e))
}

async fn recv_auth(
    conn: &quinn::Connection,
    recv: &mut quinn::RecvStream,
) -> Result<AuthMessage, TransportError> {
    let body = wire::read_frame_limited(recv, MAX_AUTH_FRAME)
        .await
        .map_err(|e| frame_error(conn, e))?;
    wire::decode_auth(&body)
}

fn refuse(conn: &quinn::Connection, code: u32, reason: &str) {
    conn.close(VarInt::from_u32(code), reason.as_bytes());
}

/// Client side of the challenge (see the module docs). On failure the
/// connection is closed; a peer that cannot prove the secret, or that
/// refused ours, yields [`TransportError::AuthFailed`].
pub async fn authenticate_client(
    conn: &quinn::Connection,
    secret: &[u8],
) -> Result<(), TransportError> {
    check_secret(secret)?;
    let peer = conn.remote_address().to_string();
    let result = async {
        let (mut send, mut recv) = conn
            .open_bi()
            .await
            .map_err(|e| connection_error(&peer, &e))?;
        let client_nonce = random_nonce()?;
        send_auth(
            conn,
            &mut send,
            &AuthMessage::ClientHello {
                version: PROTOCOL_VERSION,
                nonce: client_nonce,
            },
        )
        .await?;
        let server_nonce = match recv_auth(conn, &mut recv).await? {
            AuthMessage::ServerHello { nonce } => nonce,
            other => {
                refuse(conn, CLOSE_PROTOCOL, "expected ServerHello");
                return Err(TransportError::Malformed(format!(
                    "expected ServerHello from {peer}, got {other:?}"
                )));
            }
        };
        let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let exp = exporter(conn)?;
        let proof = prove(
            &key,
            &proof_input(ROLE_CLIENT, &server_nonce, &client_nonce, &exp),
        );
        send_auth(conn, &mut send, &AuthMessage::ClientProof { proof }).await?;
        let server_proof = match recv_auth(conn, &mut recv).await? {
            AuthMessage::ServerProof { proof } => proof,
            other => {
                refuse(conn, CLOSE_PROTOCOL, "expected ServerProof");
                return Err(TransportError::Malformed(format!(
                    "expected ServerProof from {peer}, got {other:?}"
                )));
            }
        };
        let input = proof_input(ROLE_SERVER, &server_nonce, &client_nonce, &exp);
        if hmac::verify(&key, &input, &server_proof).is_err() {
            refuse(
                conn,
                CLOSE_AUTH_FAILED,
                "authentication failed: the server did not prove the job secret",
            );
            return Err(TransportError::AuthFailed {
                peer: peer.clone(),
                detail: "the server could not prove the job secret".into(),
            });
        }
        // The server finished its side after its proof; finish ours.
        let _ = send.finish();
        Ok(())
    }
    .await;
    if let Err(e) = &result {
        tracing::debug!(%peer, error = %e, "client authentication failed");
    }
    result
}

/// Server side of the challenge: accepts the connection's first
/// bidirectional stream and runs the exchange. On failure the connection is
/// closed with [`CLOSE_AUTH_FAILED`] (wrong secret) or [`CLOSE_PROTOCOL`].
pub async fn authenticate_server(
    conn: &quinn::Connection,
    secret: &[u8],
) -> Result<(), TransportError> {
    check_secret(secret)?;
    let peer = conn.remote_address().to_string();
    let (mut send, mut recv) = conn
        .accept_bi()
        .await
        .map_err(|e| connection_error(&peer, &e))?;
    let client_nonce = match recv_auth(conn, &mut recv).await {
        Ok(AuthMessage::ClientHello { version, nonce }) if version == PROTOCOL_VERSION => nonce,
        Ok(AuthMessage::ClientHello { version, .. }) => {
            refuse(
                conn,
                CLOSE_PROTOCOL,
                &format!("unsupported protocol version {version}, expected {PROTOCOL_VERSION}"),
            );
            return Err(TransportError::Malformed(format!(
                "client {peer} speaks protocol version {version}"
            )));
        }
        Ok(other) => {
            refuse(conn, CLOSE_PROTOCOL, "expected ClientHello");
            return Err(TransportError::Malformed(format!(
                "expected ClientHello from {peer}, got {other:?}"
            )));
        }
        Err(e) => {
            refuse(conn, CLOSE_MALFORMED, "malformed authentication frame");
            return Err(e);
        }
    };
    let server_nonce = random_nonce()?;
    send_auth(
        conn,
        &mut send,
        &AuthMessage::ServerHello {
            nonce: server_nonce,
        },
    )
    .await?;
    let client_proof = match recv_auth(conn, &mut recv).await {
        Ok(AuthMessage::ClientProof { proof }) => proof,
        Ok(other) => {
            refuse(conn, CLOSE_PROTOCOL, "expected ClientProof");
            return Err(TransportError::Malformed(format!(
                "expected ClientProof from {peer}, got {other:?}"
            )));
        }
        Err(e) => {
            refuse(conn, CLOSE_MALFORMED, "malformed authentication frame");
            return Err(e);
        }
    };
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let exp = exporter(conn)?;
    let input = proof_input(ROLE_CLIENT, &server_nonce, &client_nonce, &exp);
    if hmac::verify(&key, &input, &client_proof).is_err() {
        refuse(
            conn,
            CLOSE_AUTH_FAILED,
            "authentication failed: wrong job secret",
        );
        return Err(TransportError::AuthFailed {
            peer,
            detail: "the client could not prove the job secret".into(),
        });
    }
    let proof = prove(
        &key,
        &proof_input(ROLE_SERVER, &server_nonce, &client_nonce, &exp),
    );
    // Grant request streams before the proof leaves, so the credit arrives
    // with (or before) it and the client's first request need not wait.
    conn.set_max_concurrent_bi_streams(VarInt::from_u32(MAX_CONCURRENT_REQUESTS));
    send_auth(conn, &mut send, &AuthMessage::ServerProof { proof }).await?;
    let _ = send.finish();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, SocketAddr};

    const T: Duration = Duration::from_secs(30);

    fn server_endpoint() -> quinn::Endpoint {
        quinn::Endpoint::server(
            server_config().unwrap(),
            SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        )
        .unwrap()
    }

    fn client_endpoint() -> quinn::Endpoint {
        let mut ep = quinn::Endpoint::client(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
        ep.set_default_client_config(client_config().unwrap());
        ep
    }

    /// Connect a client and a server endpoint; returns (client conn, server conn).
    async fn pair(
        server: &quinn::Endpoint,
        client: &quinn::Endpoint,
    ) -> (quinn::Connection, quinn::Connection) {
        let addr = server.local_addr().unwrap();
        let connecting = client.connect(addr, SERVER_NAME).unwrap();
        let (c, s) = tokio::join!(connecting, async {
            server.accept().await.unwrap().await.unwrap()
        });
        (c.unwrap(), s)
    }

    #[tokio::test]
    async fn same_secret_authenticates_both_sides() {
        tokio::time::timeout(T, async {
            let (se, ce) = (server_endpoint(), client_endpoint());
            let (c, s) = pair(&se, &ce).await;
            let (cr, sr) = tokio::join!(
                authenticate_client(&c, b"secret"),
                authenticate_server(&s, b"secret")
            );
            cr.unwrap();
            sr.unwrap();
            assert_eq!(
                c.handshake_data()
                    .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                    .and_then(|d| d.protocol),
                Some(ALPN.to_vec())
            );
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn tp1_wrong_client_secret_is_refused_by_the_server() {
        tokio::time::timeout(T, async {
            let (se, ce) = (server_endpoint(), client_endpoint());
            let (c, s) = pair(&se, &ce).await;
            let (cr, sr) = tokio::join!(
                authenticate_client(&c, b"wrong"),
                authenticate_server(&s, b"secret")
            );
            assert!(
                matches!(sr, Err(TransportError::AuthFailed { .. })),
                "{sr:?}"
            );
            assert!(
                matches!(cr, Err(TransportError::AuthFailed { .. })),
                "{cr:?}"
            );
        })
        .await
        .unwrap();
    }

    /// A server that does not know the secret but accepts any client proof
    /// (and answers with a garbage proof) is rejected by the client.
    #[tokio::test]
    async fn client_rejects_a_server_that_cannot_prove_the_secret() {
        tokio::time::timeout(T, async {
            let (se, ce) = (server_endpoint(), client_endpoint());
            let (c, s) = pair(&se, &ce).await;
            let rogue = async {
                let (mut send, mut recv) = s.accept_bi().await.unwrap();
                let _hello = recv_auth(&s, &mut recv).await.unwrap();
                send_auth(&s, &mut send, &AuthMessage::ServerHello { nonce: [1; 32] })
                    .await
                    .unwrap();
                let _proof = recv_auth(&s, &mut recv).await.unwrap();
                send_auth(&s, &mut send, &AuthMessage::ServerProof { proof: [0; 32] })
                    .await
                    .unwrap();
                s.closed().await
            };
            let (cr, closed) = tokio::join!(authenticate_client(&c, b"secret"), rogue);
            assert!(
                matches!(cr, Err(TransportError::AuthFailed { .. })),
                "{cr:?}"
            );
            match closed {
                ConnectionError::ApplicationClosed(close) => {
                    assert_eq!(close.error_code, VarInt::from_u32(CLOSE_AUTH_FAILED))
                }
                other => panic!("unexpected {other:?}"),
            }
        })
        .await
        .unwrap();
    }

    /// AU: a proof made for one role (or one connection) does not verify for
    /// the other role.
    #[test]
    fn proofs_are_bound_to_role_nonces_and_session() {
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"k");
        let (sn, cn, exp) = ([1; 32], [2; 32], [3; 32]);
        let client = prove(&key, &proof_input(ROLE_CLIENT, &sn, &cn, &exp));
        assert!(hmac::verify(&key, &proof_input(ROLE_CLIENT, &sn, &cn, &exp), &client).is_ok());
        assert!(hmac::verify(&key, &proof_input(ROLE_SERVER, &sn, &cn, &exp), &client).is_err());
        assert!(hmac::verify(&key, &proof_input(ROLE_CLIENT, &cn, &sn, &exp), &client).is_err());
        assert!(
            hmac::verify(&key, &proof_input(ROLE_CLIENT, &sn, &cn, &[4; 32]), &client).is_err()
        );
    }

    #[test]
    fn au2_empty_secret_is_refused() {
        assert!(check_secret(b"").is_err());
        assert!(check_secret(b"x").is_ok());
    }
}
