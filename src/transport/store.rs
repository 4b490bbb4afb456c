//! The rendezvous store over QUIC: [`RendezvousServer`] and [`StoreClient`].
//!
//! The server owns a [`MemoryStore`] and serves it to clients that proved the
//! job secret ([`quic`]). Each request is one bidirectional QUIC
//! stream opened by the client: one [`Request`] frame in, one [`Response`]
//! frame out ([`wire`]). Requests on one connection run
//! concurrently, so a long `wait` does not hold up a `set`.
//!
//! # Invariants
//! - TP-1: a connection's request streams are accepted only after its
//!   authentication succeeded.
//! - ST-1: a malformed or oversized frame closes only the connection that
//!   sent it ([`CLOSE_MALFORMED`]); other clients are unaffected.
//! - ST-2: a server-side `wait` lasts at most [`MAX_SERVER_WAIT`] per
//!   request and ends when its connection closes; the client splits longer
//!   waits into several requests.
//! - ST-3: every client request has a deadline (the wait's timeout plus
//!   [`RESPONSE_MARGIN`], or [`REQUEST_TIMEOUT`]); a lost connection fails
//!   requests with `ConnectionLost` instead of hanging them.
//! - ST-4: the server stops on [`RendezvousServer::shutdown`] and on drop;
//!   dropping never panics.
//! - ST-6: an unauthenticated connection holds its slot for at most
//!   [`PRE_AUTH_DEADLINE`], and one source IP holds at most
//!   [`MAX_PENDING_PER_SOURCE`] slots, so a flood cannot deny the store.
//! - ST-7: a client whose authentication the server did not see finish
//!   within [`PRE_AUTH_DEADLINE`] is closed with its own code
//!   ([`quic::CLOSE_AUTH_TIMEOUT`]), which the client retries until its
//!   connect timeout and never reports as a wrong secret; only a failed
//!   secret check is `AuthFailed`.
//! - ST-5: binding a port that a just-dropped server still holds is retried
//!   for at most [`BIND_RETRY`], so a communicator re-created at once works.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use quinn::{ConnectionError, TransportErrorCode, VarInt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::quic::{
    self, CLOSE_AUTH_FAILED, CLOSE_AUTH_TIMEOUT, CLOSE_MALFORMED, CLOSE_NORMAL, CLOSE_SHUTDOWN,
};
use super::wire::{self, ErrorKind, FrameError, Request, Response};
use super::{CompareSet, MemoryStore, Store, TransportError};

/// Longest a single `wait` request is served before the server answers
/// with a timeout (the client re-issues longer waits).
pub const MAX_SERVER_WAIT: Duration = Duration::from_secs(3600);
/// Deadline of a client request other than `wait`.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Extra time a client gives the server to answer a `wait` after its timeout.
pub const RESPONSE_MARGIN: Duration = Duration::from_secs(10);
/// How long the server waits for a request frame on a newly opened stream.
const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Connections that may be in the handshake/authentication phase at once;
/// more are refused (QUIC `CONNECTION_REFUSED`, which clients retry).
pub const MAX_PENDING_CONNECTIONS: usize = 512;
/// Connections from one IP address that may be unauthenticated at once
/// ([ST-6]); more from that address are refused, so one flooding host cannot
/// take the slots of [`MAX_PENDING_CONNECTIONS`] from everyone else.
///
/// [ST-6]: self#invariants
pub const MAX_PENDING_PER_SOURCE: usize = 64;
/// How long a new connection has for its QUIC handshake and the secret
/// challenge together ([ST-6]); a slot is never held longer.
///
/// [ST-6]: self#invariants
pub const PRE_AUTH_DEADLINE: Duration = Duration::from_secs(2);
/// Stream reset code when a stream carried no request in time.
const RESET_NO_REQUEST: u32 = 1;

/// Serves a [`MemoryStore`] over QUIC to authenticated clients.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use std::time::Duration;
/// use chorus::transport::{RendezvousServer, Store, StoreClient};
/// let server = RendezvousServer::bind("127.0.0.1:0".parse().unwrap(), b"job-secret")
///     .await
///     .unwrap();
/// let client = StoreClient::connect(server.local_addr(), b"job-secret", Duration::from_secs(10))
///     .await
///     .unwrap();
/// client.set("rank/0", b"10.0.0.1:4000".to_vec()).await.unwrap();
/// assert_eq!(client.get("rank/0").await.unwrap(), Some(b"10.0.0.1:4000".to_vec()));
/// server.shutdown();
/// # });
/// ```
#[derive(Debug)]
pub struct RendezvousServer {
    addr: SocketAddr,
    endpoint: quinn::Endpoint,
    store: Arc<MemoryStore>,
    stop: CancellationToken,
}

impl RendezvousServer {
    /// Bind to `addr` (port 0 picks a free port) and start serving clients
    /// that prove `secret`. Must be called within a tokio runtime.
    ///
    /// # Errors
    /// `Io` if the secret is empty, TLS setup fails or the address cannot be bound.
    pub async fn bind(addr: SocketAddr, secret: &[u8]) -> Result<RendezvousServer, TransportError> {
        RendezvousServer::bind_with_store(addr, secret, Arc::new(MemoryStore::new())).await
    }

    /// Like [`bind`](Self::bind), serving an existing `store` (which the
    /// caller, e.g. rank 0, may also use directly without a network hop).
    ///
    /// # Errors
    /// As [`bind`](Self::bind).
    pub async fn bind_with_store(
        addr: SocketAddr,
        secret: &[u8],
        store: Arc<MemoryStore>,
    ) -> Result<RendezvousServer, TransportError> {
        if secret.is_empty() {
            return Err(TransportError::Io(
                "refusing to serve the rendezvous store with an empty job secret".into(),
            ));
        }
        let config = quic::server_config()?;
        let endpoint = bind_server(config, addr).await?;
        let local = endpoint
            .local_addr()
            .map_err(|e| TransportError::Io(format!("rendezvous server address: {e}")))?;
        let stop = CancellationToken::new();
        let secret: Arc<[u8]> = Arc::from(secret);
        tokio::spawn(
            accept_loop(endpoint.clone(), store.clone(), secret, stop.clone())
                .instrument(tracing::info_span!("rendezvous_server", addr = %local)),
        );
        tracing::info!(addr = %local, "rendezvous server listening");
        Ok(RendezvousServer {
            addr: local,
            endpoint,
            store,
            stop,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The store being served.
    pub fn store(&self) -> Arc<MemoryStore> {
        self.store.clone()
    }

    /// Stop serving; open connections are closed (clients see
    /// `ConnectionLost`). Idempotent.
    pub fn shutdown(&self) {
        if !self.stop.is_cancelled() {
            tracing::info!(addr = %self.addr, "rendezvous server shutting down");
        }
        self.stop.cancel();
        self.endpoint.close(
            VarInt::from_u32(CLOSE_SHUTDOWN),
            b"rendezvous server shutting down",
        );
    }

    /// Whether the server still serves (no [`shutdown`](Self::shutdown) yet).
    pub fn is_serving(&self) -> bool {
        !self.stop.is_cancelled()
    }

    /// Resolves once the server has stopped (after [`shutdown`](Self::shutdown)).
    pub async fn stopped(&self) {
        self.stop.cancelled().await;
        self.endpoint.wait_idle().await;
    }
}

impl Drop for RendezvousServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// How long binding the rendezvous server retries a port that is still in use.
pub const BIND_RETRY: Duration = Duration::from_secs(10);

/// Bind the server's endpoint, retrying (10 ms, growing to 100 ms, for at
/// most [`BIND_RETRY`]) while the port is in use: the socket of a server
/// this process just dropped stays open until its connections drained, and
/// a communicator re-created at once must not fail on that ([ST-5]). No
/// `SO_REUSEADDR`: on UDP it would let two live servers share the port.
///
/// [ST-5]: self#invariants
async fn bind_server(
    config: quinn::ServerConfig,
    addr: SocketAddr,
) -> Result<quinn::Endpoint, TransportError> {
    let until = Instant::now() + BIND_RETRY;
    let mut pause = Duration::from_millis(10);
    loop {
        let endpoint = server_socket(addr).and_then(|socket| {
            let runtime = quinn::default_runtime().ok_or_else(|| {
                std::io::Error::other("no async runtime for the rendezvous server")
            })?;
            quinn::Endpoint::new(
                quinn::EndpointConfig::default(),
                Some(config.clone()),
                socket,
                runtime,
            )
        });
        match endpoint {
            Ok(ep) => return Ok(ep),
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && addr.port() != 0
                    && Instant::now() + pause < until =>
            {
                tracing::debug!(%addr, ?pause, "rendezvous port still in use; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(TransportError::Io(format!(
                    "binding the rendezvous server to {addr}: {e}"
                )))
            }
        }
    }
}

/// The receive and send buffers asked for the server's UDP socket. Every
/// rank of a job connects and authenticates at once at start-up, and with
/// the kernel's default buffer (about 200 KiB) a burst from a few hundred
/// ranks overflows it: datagrams are dropped and handshakes time out. The
/// kernel caps the request at `net.core.rmem_max` / `wmem_max`.
const SERVER_SOCKET_BUFFER: usize = 8 << 20;

/// The server's UDP socket on `addr`, with [`SERVER_SOCKET_BUFFER`]-sized
/// buffers as far as the kernel allows (what it granted is logged).
fn server_socket(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    let socket = UdpSocket::bind(addr)?;
    let granted = crate::limits::grow_socket_buffers(&socket, SERVER_SOCKET_BUFFER);
    tracing::debug!(%addr, ?granted, "rendezvous socket buffers (receive, send)");
    Ok(socket)
}

async fn accept_loop(
    endpoint: quinn::Endpoint,
    store: Arc<MemoryStore>,
    secret: Arc<[u8]>,
    stop: CancellationToken,
) {
    let pending = Arc::new(Semaphore::new(MAX_PENDING_CONNECTIONS));
    let per_source: PerSource = Arc::default();
    loop {
        let incoming = tokio::select! {
            incoming = endpoint.accept() => incoming,
            _ = stop.cancelled() => break,
        };
        let Some(incoming) = incoming else { break };
        let peer = incoming.remote_address();
        let Some(source) = SourceSlot::take(&per_source, peer.ip()) else {
            tracing::warn!(%peer, "too many connections authenticating from this address; refusing one");
            incoming.refuse();
            continue;
        };
        let Ok(permit) = pending.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "too many connections authenticating; refusing one");
            incoming.refuse();
            continue;
        };
        let permit = (permit, source);
        tokio::spawn(
            serve_connection(
                incoming,
                permit,
                store.clone(),
                secret.clone(),
                stop.clone(),
            )
            .instrument(tracing::info_span!("rendezvous_conn", %peer)),
        );
    }
    tracing::debug!("accept loop ended");
}

/// Unauthenticated connections by source address ([ST-6]).
///
/// [ST-6]: self#invariants
type PerSource = Arc<std::sync::Mutex<std::collections::HashMap<IpAddr, usize>>>;

/// One source's pending slot; released on drop.
struct SourceSlot {
    map: PerSource,
    ip: IpAddr,
}

impl SourceSlot {
    fn take(map: &PerSource, ip: IpAddr) -> Option<SourceSlot> {
        let mut m = map.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(ip).or_insert(0);
        if *n >= MAX_PENDING_PER_SOURCE {
            return None;
        }
        *n += 1;
        Some(SourceSlot {
            map: map.clone(),
            ip,
        })
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

async fn serve_connection(
    incoming: quinn::Incoming,
    pending: (OwnedSemaphorePermit, SourceSlot),
    store: Arc<MemoryStore>,
    secret: Arc<[u8]>,
    stop: CancellationToken,
) {
    // ST-6: handshake and authentication share one short deadline.
    let pre_auth = Instant::now() + PRE_AUTH_DEADLINE;
    let conn = match tokio::time::timeout_at(pre_auth, incoming).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!("handshake timed out");
            return;
        }
    };
    // TP-1: nothing but the authentication stream until it succeeded.
    let auth = tokio::time::timeout_at(pre_auth, quic::authenticate_server(&conn, &secret)).await;
    drop(pending);
    match auth {
        Ok(Ok(())) => tracing::debug!("client authenticated"),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "client refused");
            return;
        }
        Err(_) => {
            // Slow is not wrong: the client retries on this code, and
            // never reports it as a wrong secret (ST-7).
            tracing::warn!("client did not authenticate in time");
            conn.close(
                VarInt::from_u32(CLOSE_AUTH_TIMEOUT),
                b"authentication not finished in time",
            );
            return;
        }
    }
    loop {
        let stream = tokio::select! {
            s = conn.accept_bi() => s,
            _ = stop.cancelled() => break,
        };
        match stream {
            Ok((send, recv)) => {
                let conn = conn.clone();
                let store = store.clone();
                let stop = stop.clone();
                tokio::spawn(
                    async move {
                        tokio::select! {
                            _ = serve_request(&conn, &store, send, recv) => {}
                            _ = conn.closed() => {}
                            _ = stop.cancelled() => {}
                        }
                    }
                    .in_current_span(),
                );
            }
            Err(ConnectionError::ApplicationClosed(close))
                if close.error_code == VarInt::from_u32(CLOSE_NORMAL) =>
            {
                tracing::debug!("client closed the connection");
                break;
            }
            Err(e) => {
                tracing::debug!(error = %e, "connection ended");
                break;
            }
        }
    }
}

fn refuse_malformed(conn: &quinn::Connection, detail: &str) {
    tracing::warn!(detail, "malformed request; closing the connection");
    let reason = format!("malformed request: {detail}");
    // Close reasons must fit in a packet; keep them short.
    let reason = &reason.as_bytes()[..reason.len().min(200)];
    conn.close(VarInt::from_u32(CLOSE_MALFORMED), reason);
}

async fn serve_request(
    conn: &quinn::Connection,
    store: &MemoryStore,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let body = match tokio::time::timeout(REQUEST_READ_TIMEOUT, wire::read_frame(&mut recv)).await {
        Err(_) => {
            tracing::debug!("no request on a stream in time; resetting it");
            let _ = send.reset(VarInt::from_u32(RESET_NO_REQUEST));
            return;
        }
        Ok(Ok(body)) => body,
        Ok(Err(e @ FrameError::TooLarge { .. })) => {
            refuse_malformed(conn, &e.to_string());
            return;
        }
        Ok(Err(FrameError::Eof)) => {
            // A stream opened and finished without a request: nothing to do.
            return;
        }
        Ok(Err(FrameError::Io(e))) => {
            if conn.close_reason().is_none() && e.kind() == std::io::ErrorKind::UnexpectedEof {
                refuse_malformed(conn, "stream ended inside a frame");
            } else {
                tracing::debug!(error = %e, "request stream failed");
            }
            return;
        }
    };
    let request = match wire::decode_request(&body) {
        Ok(r) => r,
        Err(e) => {
            refuse_malformed(conn, &e.to_string());
            return;
        }
    };
    let response = execute(store, request).await;
    let body = match wire::encode_response(&response) {
        Ok(b) => b,
        Err(e) => match wire::encode_response(&Response::Error {
            kind: ErrorKind::Store,
            message: e.to_string(),
        }) {
            Ok(b) => b,
            Err(_) => return,
        },
    };
    if let Err(e) = wire::write_frame(&mut send, &body).await {
        tracing::debug!(error = %e, "could not send the response");
        return;
    }
    let _ = send.finish();
}

async fn execute(store: &MemoryStore, request: Request) -> Response {
    fn store_err(e: TransportError) -> Response {
        match e {
            TransportError::WaitTimeout { keys, after } => Response::Error {
                message: format!("timed out after {after:?}"),
                kind: ErrorKind::WaitTimeout { missing: keys },
            },
            other => Response::Error {
                kind: ErrorKind::Store,
                message: other.to_string(),
            },
        }
    }
    match request {
        Request::Set { key, value } => {
            tracing::trace!(%key, bytes = value.len(), "set");
            match store.set(&key, value).await {
                Ok(()) => Response::Ok,
                Err(e) => store_err(e),
            }
        }
        Request::Get { key } => match store.get(&key).await {
            Ok(v) => Response::Value(v),
            Err(e) => store_err(e),
        },
        Request::Wait { keys, timeout_ms } => {
            let timeout = Duration::from_millis(timeout_ms).min(MAX_SERVER_WAIT);
            tracing::trace!(?keys, ?timeout, "wait");
            match store.wait(&keys, timeout).await {
                Ok(v) => Response::Values(v),
                Err(e) => store_err(e),
            }
        }
        Request::Add { key, delta } => match store.add(&key, delta).await {
            Ok(v) => Response::Int(v),
            Err(e) => store_err(e),
        },
        Request::CompareSet {
            key,
            expected,
            desired,
        } => match store.compare_set(&key, expected, desired).await {
            Ok(CompareSet::Swapped) => Response::Swapped,
            Ok(CompareSet::Current(v)) => Response::Current(v),
            Err(e) => store_err(e),
        },
        Request::Delete { key } => match store.delete(&key).await {
            Ok(v) => Response::Bool(v),
            Err(e) => store_err(e),
        },
        Request::DeletePrefix { prefix } => {
            tracing::debug!(%prefix, "delete prefix");
            match store.delete_prefix(&prefix).await {
                Ok(n) => Response::Int(i64::try_from(n).unwrap_or(i64::MAX)),
                Err(e) => store_err(e),
            }
        }
    }
}

/// A connection to a [`RendezvousServer`].
///
/// Cheap to share (`Arc<StoreClient>`); requests may run concurrently.
/// Dropping it closes the connection.
#[derive(Debug)]
pub struct StoreClient {
    addr: SocketAddr,
    local_ip: IpAddr,
    request_timeout: Duration,
    /// Kept so the client's UDP socket lives as long as the connection.
    _endpoint: quinn::Endpoint,
    conn: quinn::Connection,
}

/// How one connection attempt failed.
enum Attempt {
    /// Worth retrying until the deadline (server not up yet, timeouts).
    Retry(String),
    /// Retrying cannot help (wrong secret, TLS/protocol mismatch).
    Fatal(TransportError),
}

impl StoreClient {
    /// Connect to the server at `addr` and authenticate with `secret`,
    /// retrying refused/unreachable connects until `timeout` (the server may
    /// not be up yet). A wrong secret fails at once with `AuthFailed`.
    ///
    /// # Errors
    /// `AuthFailed` (no retry), `ConnectFailed` once `timeout` passed or on a
    /// TLS/protocol mismatch, `Io` for an empty secret or local socket errors.
    pub async fn connect(
        addr: SocketAddr,
        secret: &[u8],
        timeout: Duration,
    ) -> Result<StoreClient, TransportError> {
        if secret.is_empty() {
            return Err(TransportError::Io(
                "the job secret is empty; set CHORUS_SECRET to the same random value on every rank"
                    .into(),
            ));
        }
        let span = tracing::info_span!("store_connect", %addr);
        async {
            let bind: SocketAddr = if addr.is_ipv4() {
                (Ipv4Addr::UNSPECIFIED, 0).into()
            } else {
                (Ipv6Addr::UNSPECIFIED, 0).into()
            };
            let mut endpoint = quinn::Endpoint::client(bind)
                .map_err(|e| TransportError::Io(format!("binding a QUIC client socket: {e}")))?;
            endpoint.set_default_client_config(quic::client_config_for(addr.ip())?);

            let start = Instant::now();
            let deadline = start + timeout;
            // A store that is not bound yet loses the first packet: on
            // loopback, give up on an attempt soon and retry after 10 ms
            // (both growing), so the first rank in waits tens of ms, not 1 s.
            let mut attempt_timeout = if addr.ip().is_loopback() {
                Duration::from_millis(100)
            } else {
                Duration::from_secs(1)
            };
            let mut backoff = Duration::from_millis(10);
            let mut last = String::from("no attempt made");
            let mut attempts = 0u32;
            loop {
                let now = Instant::now();
                if now >= deadline {
                    return Err(TransportError::ConnectFailed {
                        addr: addr.to_string(),
                        after: timeout,
                        detail: format!("{last} (after {attempts} attempts)"),
                    });
                }
                attempts += 1;
                match try_connect(&endpoint, addr, secret, attempt_timeout, deadline).await {
                    Ok(conn) => {
                        let local_ip = local_ip_for(&conn, addr);
                        tracing::info!(attempts, %local_ip, "connected to the rendezvous store");
                        return Ok(StoreClient {
                            addr,
                            local_ip,
                            request_timeout: REQUEST_TIMEOUT,
                            _endpoint: endpoint,
                            conn,
                        });
                    }
                    Err(Attempt::Fatal(e)) => {
                        tracing::warn!(error = %e, "cannot connect to the rendezvous store");
                        return Err(e);
                    }
                    Err(Attempt::Retry(why)) => {
                        tracing::debug!(attempts, why, "connect attempt failed; retrying");
                        last = why;
                    }
                }
                attempt_timeout = (attempt_timeout * 2).min(Duration::from_secs(8));
                let pause = backoff.min(deadline.saturating_duration_since(Instant::now()));
                tokio::time::sleep(pause).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
        .instrument(span)
        .await
    }

    /// The local IP this client uses to reach the server (a good address to
    /// advertise to peers).
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// Use `timeout` instead of [`REQUEST_TIMEOUT`] as the deadline of
    /// requests other than `wait` (whose deadline is its own timeout plus
    /// [`RESPONSE_MARGIN`]).
    pub fn with_request_timeout(mut self, timeout: Duration) -> StoreClient {
        self.request_timeout = timeout;
        self
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Close the connection (as dropping does); pending and later requests
    /// fail with `ConnectionLost`.
    pub fn close(&self) {
        self.conn
            .close(VarInt::from_u32(CLOSE_NORMAL), b"client closed");
    }

    fn lost(&self, detail: impl Into<String>) -> TransportError {
        TransportError::ConnectionLost {
            addr: self.addr.to_string(),
            detail: detail.into(),
        }
    }

    /// Send one request on its own stream and read the response, within `deadline`.
    async fn request(&self, req: &Request, deadline: Duration) -> Result<Response, TransportError> {
        let body = wire::encode_request(req)?;
        let exchange = async {
            let (mut send, mut recv) = self
                .conn
                .open_bi()
                .await
                .map_err(|e| quic::connection_error(&self.addr.to_string(), &e))?;
            wire::write_frame(&mut send, &body)
                .await
                .map_err(|e| quic::frame_error(&self.conn, e))?;
            let _ = send.finish();
            let resp = wire::read_frame(&mut recv)
                .await
                .map_err(|e| quic::frame_error(&self.conn, e))?;
            wire::decode_response(&resp)
        };
        match tokio::time::timeout(deadline, exchange).await {
            Ok(r) => r,
            Err(_) => Err(self.lost(format!("no response within {deadline:?}"))),
        }
    }

    async fn simple(&self, req: Request) -> Result<Response, TransportError> {
        match self.request(&req, self.request_timeout).await? {
            Response::Error { kind, message } => Err(error_response(kind, message, None)),
            other => Ok(other),
        }
    }
}

fn unexpected(resp: Response) -> TransportError {
    TransportError::Malformed(format!("unexpected response from the store: {resp:?}"))
}

fn error_response(kind: ErrorKind, message: String, wait: Option<Duration>) -> TransportError {
    match kind {
        ErrorKind::WaitTimeout { missing } => TransportError::WaitTimeout {
            keys: missing,
            after: wait.unwrap_or_default(),
        },
        ErrorKind::Store => TransportError::Store(message),
        ErrorKind::BadRequest => TransportError::Malformed(message),
    }
}

impl Drop for StoreClient {
    fn drop(&mut self) {
        self.close();
    }
}

/// One connection attempt: QUIC handshake within `attempt_timeout`, then the
/// secret challenge within [`quic::AUTH_TIMEOUT`] (both bounded by `deadline`).
async fn try_connect(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    secret: &[u8],
    attempt_timeout: Duration,
    deadline: Instant,
) -> Result<quinn::Connection, Attempt> {
    let connecting = endpoint.connect(addr, quic::SERVER_NAME).map_err(|e| {
        Attempt::Fatal(TransportError::ConnectFailed {
            addr: addr.to_string(),
            after: Duration::ZERO,
            detail: e.to_string(),
        })
    })?;
    let handshake_deadline = deadline.min(Instant::now() + attempt_timeout);
    let conn = match tokio::time::timeout_at(handshake_deadline, connecting).await {
        Err(_) => return Err(Attempt::Retry("no answer from the server".into())),
        Ok(Err(e)) => return Err(classify_connect_error(addr, e)),
        Ok(Ok(conn)) => conn,
    };
    let auth_deadline = deadline.min(Instant::now() + quic::AUTH_TIMEOUT);
    match tokio::time::timeout_at(auth_deadline, quic::authenticate_client(&conn, secret)).await {
        Err(_) => {
            conn.close(VarInt::from_u32(CLOSE_NORMAL), b"authentication timed out");
            Err(Attempt::Retry(
                "the server did not complete authentication".into(),
            ))
        }
        Ok(Ok(())) => Ok(conn),
        Ok(Err(e @ TransportError::AuthFailed { .. })) => Err(Attempt::Fatal(e)),
        Ok(Err(e @ TransportError::Malformed(_))) => Err(Attempt::Fatal(e)),
        Ok(Err(e)) => match conn.close_reason() {
            Some(reason) => Err(classify_connect_error(addr, reason)),
            None => Err(Attempt::Retry(e.to_string())),
        },
    }
}

fn classify_connect_error(addr: SocketAddr, e: ConnectionError) -> Attempt {
    match &e {
        ConnectionError::TimedOut | ConnectionError::Reset => Attempt::Retry(e.to_string()),
        ConnectionError::ConnectionClosed(close)
            if close.error_code == TransportErrorCode::CONNECTION_REFUSED =>
        {
            Attempt::Retry(e.to_string())
        }
        // A server that is shutting down may be replaced by a new one.
        ConnectionError::ApplicationClosed(close)
            if close.error_code == VarInt::from_u32(CLOSE_SHUTDOWN) =>
        {
            Attempt::Retry(e.to_string())
        }
        // ST-7: a busy server that timed out our secret check.
        ConnectionError::ApplicationClosed(close)
            if close.error_code == VarInt::from_u32(CLOSE_AUTH_TIMEOUT) =>
        {
            Attempt::Retry(format!(
                "the server timed out the secret check (busy): {}",
                String::from_utf8_lossy(&close.reason)
            ))
        }
        ConnectionError::ApplicationClosed(close)
            if close.error_code == VarInt::from_u32(CLOSE_AUTH_FAILED) =>
        {
            Attempt::Fatal(quic::connection_error(&addr.to_string(), &e))
        }
        _ => Attempt::Fatal(TransportError::ConnectFailed {
            addr: addr.to_string(),
            after: Duration::ZERO,
            detail: format!(
                "{e} (TLS/QUIC or protocol mismatch; is this a Chorus rendezvous server?)"
            ),
        }),
    }
}

/// The local address used to reach `server`: from the connection if the
/// platform reports it, else from the routing table (a connected UDP socket
/// sends nothing).
fn local_ip_for(conn: &quinn::Connection, server: SocketAddr) -> IpAddr {
    if let Some(ip) = conn.local_ip() {
        if !ip.is_unspecified() {
            return ip;
        }
    }
    let bind: SocketAddr = if server.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    UdpSocket::bind(bind)
        .and_then(|s| {
            s.connect(server)?;
            s.local_addr()
        })
        .map(|a| a.ip())
        .unwrap_or(bind.ip())
}

#[async_trait]
impl Store for StoreClient {
    async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), TransportError> {
        let req = Request::Set {
            key: key.to_string(),
            value,
        };
        match self.simple(req).await? {
            Response::Ok => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, TransportError> {
        match self
            .simple(Request::Get {
                key: key.to_string(),
            })
            .await?
        {
            Response::Value(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    async fn wait(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let deadline = Instant::now() + timeout;
        loop {
            // ST-2: the server serves at most MAX_SERVER_WAIT per request.
            let chunk = deadline
                .saturating_duration_since(Instant::now())
                .min(MAX_SERVER_WAIT);
            let req = Request::Wait {
                keys: keys.to_vec(),
                timeout_ms: u64::try_from(chunk.as_millis()).unwrap_or(u64::MAX),
            };
            match self.request(&req, chunk + RESPONSE_MARGIN).await? {
                Response::Values(v) if v.len() == keys.len() => return Ok(v),
                Response::Error {
                    kind: ErrorKind::WaitTimeout { .. },
                    ..
                } if Instant::now() < deadline => continue,
                Response::Error { kind, message } => {
                    return Err(error_response(kind, message, Some(timeout)))
                }
                other => return Err(unexpected(other)),
            }
        }
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, TransportError> {
        let req = Request::Add {
            key: key.to_string(),
            delta,
        };
        match self.simple(req).await? {
            Response::Int(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    async fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> Result<CompareSet, TransportError> {
        let req = Request::CompareSet {
            key: key.to_string(),
            expected,
            desired,
        };
        match self.simple(req).await? {
            Response::Swapped => Ok(CompareSet::Swapped),
            Response::Current(v) => Ok(CompareSet::Current(v)),
            other => Err(unexpected(other)),
        }
    }

    async fn delete(&self, key: &str) -> Result<bool, TransportError> {
        match self
            .simple(Request::Delete {
                key: key.to_string(),
            })
            .await?
        {
            Response::Bool(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64, TransportError> {
        super::check_prefix(prefix)?;
        match self
            .simple(Request::DeletePrefix {
                prefix: prefix.to_string(),
            })
            .await?
        {
            Response::Int(n) => Ok(u64::try_from(n).unwrap_or(0)),
            other => Err(unexpected(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn st7_a_timed_out_secret_check_is_retried_and_never_blames_the_secret() {
        let addr: SocketAddr = "127.0.0.1:9".parse().expect("addr");
        let closed = |code: u32| {
            ConnectionError::ApplicationClosed(quinn::ApplicationClose {
                error_code: VarInt::from_u32(code),
                reason: b"closed by the test".to_vec().into(),
            })
        };
        assert!(matches!(
            classify_connect_error(addr, closed(CLOSE_AUTH_TIMEOUT)),
            Attempt::Retry(_)
        ));
        assert!(matches!(
            classify_connect_error(addr, closed(CLOSE_AUTH_FAILED)),
            Attempt::Fatal(TransportError::AuthFailed { .. })
        ));
        let e = quic::connection_error("store", &closed(CLOSE_AUTH_TIMEOUT));
        assert!(matches!(e, TransportError::ConnectionLost { .. }), "{e}");
        assert!(e.to_string().contains("not a wrong secret"), "{e}");
    }

    use super::*;

    const T: Duration = Duration::from_secs(30);

    fn localhost() -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }

    #[tokio::test]
    async fn requests_round_trip_through_the_server() {
        tokio::time::timeout(T, async {
            let server = RendezvousServer::bind(localhost(), b"s").await.unwrap();
            let client = StoreClient::connect(server.local_addr(), b"s", T)
                .await
                .unwrap();
            client.set("a", b"1".to_vec()).await.unwrap();
            assert_eq!(client.get("a").await.unwrap(), Some(b"1".to_vec()));
            assert_eq!(client.get("nope").await.unwrap(), None);
            assert_eq!(client.add("n", 3).await.unwrap(), 3);
            assert!(matches!(
                client.add("a", 1).await,
                Ok(2) // "1" is an integer
            ));
            assert!(matches!(
                client.compare_set("a", None, vec![]).await.unwrap(),
                CompareSet::Current(Some(_))
            ));
            assert!(client.delete("a").await.unwrap());
            assert_eq!(server.store().len(), 1);
            client.set("job/x/1", vec![]).await.unwrap();
            client.set("job/x/2", vec![]).await.unwrap();
            assert_eq!(client.delete_prefix("job/x/").await.unwrap(), 2);
            assert!(matches!(
                client.delete_prefix("").await,
                Err(TransportError::Store(_))
            ));
            assert_eq!(server.store().len(), 1);
            assert!(client.local_ip().is_loopback());
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn store_errors_come_back_typed() {
        tokio::time::timeout(T, async {
            let server = RendezvousServer::bind(localhost(), b"s").await.unwrap();
            let client = StoreClient::connect(server.local_addr(), b"s", T)
                .await
                .unwrap();
            client.set("x", b"not a number".to_vec()).await.unwrap();
            assert!(matches!(
                client.add("x", 1).await,
                Err(TransportError::Store(_))
            ));
            let err = client
                .wait(&["x".into(), "y".into()], Duration::from_millis(50))
                .await
                .unwrap_err();
            match err {
                TransportError::WaitTimeout { keys, after } => {
                    assert_eq!(keys, vec!["y".to_string()]);
                    assert_eq!(after, Duration::from_millis(50));
                }
                other => panic!("unexpected {other:?}"),
            }
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn st4_shutdown_fails_requests_with_connection_lost() {
        tokio::time::timeout(T, async {
            let server = RendezvousServer::bind(localhost(), b"s").await.unwrap();
            let client = StoreClient::connect(server.local_addr(), b"s", T)
                .await
                .unwrap();
            let waiter = {
                let keys = vec!["never".to_string()];
                async move { client.wait(&keys, Duration::from_secs(600)).await }
            };
            let waiter = tokio::spawn(waiter);
            tokio::time::sleep(Duration::from_millis(50)).await;
            server.shutdown();
            server.shutdown(); // idempotent
            match waiter.await.unwrap() {
                Err(TransportError::ConnectionLost { .. }) => {}
                other => panic!("unexpected {other:?}"),
            }
            server.stopped().await;
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn empty_secret_is_refused_by_server_and_client() {
        tokio::time::timeout(T, async {
            assert!(RendezvousServer::bind(localhost(), b"").await.is_err());
            assert!(StoreClient::connect(localhost(), b"", T).await.is_err());
        })
        .await
        .unwrap();
    }
}
