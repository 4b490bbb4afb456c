//! The rendezvous store over QUIC: [`RendezvousServer`] and [`StoreClient`].
//!
//! STUB: to be implemented (see transport/mod.rs for the contract).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use async_trait::async_trait;

use super::{CompareSet, Store, TransportError};

/// Serves a [`MemoryStore`](super::MemoryStore) over QUIC to authenticated clients.
#[derive(Debug)]
pub struct RendezvousServer {
    addr: SocketAddr,
}

impl RendezvousServer {
    /// Bind to `addr` (port 0 picks a free port) and start serving clients
    /// that prove `secret`.
    pub async fn bind(addr: SocketAddr, secret: &[u8]) -> Result<RendezvousServer, TransportError> {
        let _ = secret;
        Err(TransportError::Io(format!(
            "rendezvous server not implemented ({addr})"
        )))
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop serving; open connections are closed.
    pub fn shutdown(&self) {}
}

/// A connection to a [`RendezvousServer`].
#[derive(Debug)]
pub struct StoreClient {
    addr: SocketAddr,
}

impl StoreClient {
    /// Connect to the server at `addr` and authenticate with `secret`,
    /// retrying refused/unreachable connects until `timeout` (the server may
    /// not be up yet). A wrong secret fails at once with `AuthFailed`.
    pub async fn connect(
        addr: SocketAddr,
        secret: &[u8],
        timeout: Duration,
    ) -> Result<StoreClient, TransportError> {
        let _ = (secret, timeout);
        Err(TransportError::Io(format!(
            "store client not implemented ({addr})"
        )))
    }

    /// The local IP this client uses to reach the server (a good address to
    /// advertise to peers).
    pub fn local_ip(&self) -> IpAddr {
        self.addr.ip()
    }
}

#[async_trait]
impl Store for StoreClient {
    async fn set(&self, _key: &str, _value: Vec<u8>) -> Result<(), TransportError> {
        Err(TransportError::Io("unimplemented".into()))
    }
    async fn get(&self, _key: &str) -> Result<Option<Vec<u8>>, TransportError> {
        Err(TransportError::Io("unimplemented".into()))
    }
    async fn wait(
        &self,
        _keys: &[String],
        _timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        Err(TransportError::Io("unimplemented".into()))
    }
    async fn add(&self, _key: &str, _delta: i64) -> Result<i64, TransportError> {
        Err(TransportError::Io("unimplemented".into()))
    }
    async fn compare_set(
        &self,
        _key: &str,
        _expected: Option<Vec<u8>>,
        _desired: Vec<u8>,
    ) -> Result<CompareSet, TransportError> {
        Err(TransportError::Io("unimplemented".into()))
    }
    async fn delete(&self, _key: &str) -> Result<bool, TransportError> {
        Err(TransportError::Io("unimplemented".into()))
    }
}
