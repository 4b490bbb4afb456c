//! An etcd rendezvous store ([`EtcdStore`], cargo feature `etcd`), for jobs
//! that span machines and want a store that survives the loss of any one
//! of them, the way torchrun's etcd rendezvous works. Selected with
//! `CHORUS_STORE=etcd://host:port[,host:port...]`.
//!
//! etcd knows nothing of the job secret, so the secret is applied on top:
//!
//! - Scoping: every key lives under `chorus-etcd/<secret id>/`, where the
//!   secret id is derived from the secret (SHA-256), so jobs with different
//!   secrets use disjoint key spaces; job ids scope keys further within.
//! - Authenticity: every value is stored as `HMAC-SHA256(secret, key ‖ value)
//!   ‖ value`. A value whose MAC does not verify (written by someone without
//!   the secret, or moved to another key) is refused with
//!   [`TransportError::AuthFailed`], never used.
//! - What the MAC cannot stop: a client that reaches etcd can still delete
//!   or overwrite keys (a denial of service, detected as a refused value or
//!   a timeout). Guard etcd itself for that: its user/password
//!   authentication (`CHORUS_ETCD_USER`, `CHORUS_ETCD_PASSWORD`) or network
//!   policy.
//!
//! # Invariants
//! - EC-1: no value read from etcd is returned before its MAC verified.
//! - EC-2: `add` and `compare_set` are single etcd transactions guarded by
//!   the key's revision (or its absence), retried on conflict, so they are
//!   atomic like the [`MemoryStore`](super::MemoryStore)'s.
//! - EC-3: `wait` watches the missing key from the revision it read, so a
//!   write between the read and the watch is never missed.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, EventType, Txn, TxnOp, WatchOptions,
};
use ring::hmac;

use super::{CompareSet, Store, TransportError};

/// A [`Store`] kept in an etcd cluster (see the module docs for how the job
/// secret scopes and authenticates it).
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    /// `chorus-etcd/<secret id>/`.
    root: String,
    mac: hmac::Key,
    endpoints: String,
    local_ip: IpAddr,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The key prefix of the job secret `secret` in etcd.
pub fn root_for(secret: &[u8]) -> String {
    let d = ring::digest::digest(
        &ring::digest::SHA256,
        &[b"chorus-etcd-namespace-v1:".as_slice(), secret].concat(),
    );
    format!("chorus-etcd/{}/", hex(&d.as_ref()[..12]))
}

/// The endpoints of `CHORUS_STORE=etcd://a:1,b:2`, as `http://a:1`, ...
///
/// # Errors
/// `Io` for a value that is not `etcd://` followed by `host:port`s.
pub fn parse_url(url: &str) -> Result<Vec<String>, TransportError> {
    let rest = url.strip_prefix("etcd://").ok_or_else(|| {
        TransportError::Io(format!(
            "CHORUS_STORE={url:?}: expected etcd://host:port[,host:port...]"
        ))
    })?;
    let eps: Vec<String> = rest
        .trim_end_matches('/')
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| format!("http://{s}"))
        .collect();
    if eps.is_empty() || rest.contains('/') {
        return Err(TransportError::Io(format!(
            "CHORUS_STORE={url:?}: expected etcd://host:port[,host:port...]"
        )));
    }
    Ok(eps)
}

impl EtcdStore {
    /// Connect to etcd at `endpoints` (`http://host:port`), retrying until
    /// `timeout`, with keys scoped and values authenticated by `secret`.
    /// `user` logs in with etcd's own authentication.
    ///
    /// # Errors
    /// `Io` for an empty secret; `ConnectFailed` if etcd does not answer
    /// within `timeout`.
    pub async fn connect(
        endpoints: &[String],
        secret: &[u8],
        user: Option<(String, String)>,
        timeout: Duration,
    ) -> Result<EtcdStore, TransportError> {
        if secret.is_empty() {
            return Err(TransportError::Io(
                "the job secret is empty; set CHORUS_SECRET to the same random value on every rank"
                    .into(),
            ));
        }
        let joined = endpoints.join(",");
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pause = Duration::from_millis(10);
        let client = loop {
            let mut opts = ConnectOptions::new()
                .with_connect_timeout(Duration::from_secs(2).min(timeout))
                .with_timeout(super::store::REQUEST_TIMEOUT);
            if let Some((u, p)) = &user {
                opts = opts.with_user(u.clone(), p.clone());
            }
            let attempt = async {
                let mut c = Client::connect(endpoints, Some(opts)).await?;
                // Connecting is lazy: make one request to know etcd answers.
                c.get("chorus-etcd/ping", None).await?;
                Ok::<_, etcd_client::Error>(c)
            };
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let why = match tokio::time::timeout(left, attempt).await {
                Ok(Ok(c)) => break c,
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no answer".to_string(),
            };
            if tokio::time::Instant::now() + pause >= deadline {
                return Err(TransportError::ConnectFailed {
                    addr: joined,
                    after: timeout,
                    detail: why,
                });
            }
            tracing::debug!(endpoints = %joined, why, "etcd not reachable yet; retrying");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        };
        tracing::info!(endpoints = %joined, "connected to the etcd store");
        Ok(EtcdStore {
            client,
            root: root_for(secret),
            mac: hmac::Key::new(hmac::HMAC_SHA256, secret),
            local_ip: local_ip_towards(endpoints),
            endpoints: joined,
        })
    }

    /// The local IP used to reach etcd (a good address to advertise to peers).
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.root)
    }

    /// `MAC(key ‖ value) ‖ value` for the full etcd key.
    fn seal(&self, full_key: &str, value: &[u8]) -> Vec<u8> {
        let mut ctx = hmac::Context::with_key(&self.mac);
        ctx.update(&(full_key.len() as u64).to_le_bytes());
        ctx.update(full_key.as_bytes());
        ctx.update(value);
        let tag = ctx.sign();
        [tag.as_ref(), value].concat()
    }

    /// [EC-1]: the value of a sealed record, once its MAC verified.
    ///
    /// [EC-1]: self#invariants
    fn open(&self, full_key: &str, sealed: &[u8]) -> Result<Vec<u8>, TransportError> {
        let refused = || TransportError::AuthFailed {
            peer: self.endpoints.clone(),
            detail: format!(
                "the value under {full_key:?} was not written with this job's secret; refusing it"
            ),
        };
        if sealed.len() < 32 {
            return Err(refused());
        }
        let (tag, value) = sealed.split_at(32);
        let mut msg = Vec::with_capacity(8 + full_key.len() + value.len());
        msg.extend_from_slice(&(full_key.len() as u64).to_le_bytes());
        msg.extend_from_slice(full_key.as_bytes());
        msg.extend_from_slice(value);
        hmac::verify(&self.mac, &msg, tag).map_err(|_| refused())?;
        Ok(value.to_vec())
    }

    fn err(&self, e: etcd_client::Error) -> TransportError {
        TransportError::ConnectionLost {
            addr: self.endpoints.clone(),
            detail: format!("etcd: {e}"),
        }
    }

    /// The verified value and mod revision of `full`, and the store revision read at.
    async fn read(&self, full: &str) -> Result<(Option<(Vec<u8>, i64)>, i64), TransportError> {
        let resp = self
            .client
            .clone()
            .get(full, None)
            .await
            .map_err(|e| self.err(e))?;
        let rev = resp.header().map_or(0, |h| h.revision());
        match resp.kvs().first() {
            Some(kv) => Ok((Some((self.open(full, kv.value())?, kv.mod_revision())), rev)),
            None => Ok((None, rev)),
        }
    }

    /// [EC-2]: put `desired` if `full` is at `rev` (0: absent).
    ///
    /// [EC-2]: self#invariants
    async fn put_if(&self, full: &str, rev: i64, desired: &[u8]) -> Result<bool, TransportError> {
        let cmp = if rev == 0 {
            Compare::create_revision(full, CompareOp::Equal, 0)
        } else {
            Compare::mod_revision(full, CompareOp::Equal, rev)
        };
        let txn =
            Txn::new()
                .when([cmp])
                .and_then([TxnOp::put(full, self.seal(full, desired), None)]);
        let r = self
            .client
            .clone()
            .txn(txn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(r.succeeded())
    }

    /// [EC-3]: wait until `full` exists, returning its verified value.
    ///
    /// [EC-3]: self#invariants
    async fn wait_one(
        &self,
        full: &str,
        until: tokio::time::Instant,
    ) -> Result<Option<Vec<u8>>, TransportError> {
        loop {
            let (cur, rev) = self.read(full).await?;
            if let Some((v, _)) = cur {
                return Ok(Some(v));
            }
            let mut stream = self
                .client
                .clone()
                .watch(full, Some(WatchOptions::new().with_start_revision(rev + 1)))
                .await
                .map_err(|e| self.err(e))?;
            let put = async {
                while let Some(resp) = stream.message().await.map_err(|e| self.err(e))? {
                    if resp.canceled() {
                        return Ok(None);
                    }
                    for ev in resp.events() {
                        if ev.event_type() == EventType::Put {
                            if let Some(kv) = ev.kv() {
                                return Ok(Some(self.open(full, kv.value())?));
                            }
                        }
                    }
                }
                Ok::<_, TransportError>(None)
            };
            let got = tokio::time::timeout_at(until, put).await;
            // Dropping the stream ends the watch.
            drop(stream);
            match got {
                Err(_) => return Ok(None),
                Ok(Ok(Some(v))) => return Ok(Some(v)),
                // The watch ended (compaction, cancel): read again.
                Ok(Ok(None)) => continue,
                Ok(Err(e)) => return Err(e),
            }
        }
    }
}

/// The local address a UDP socket would use towards the first endpoint
/// (nothing is sent).
fn local_ip_towards(endpoints: &[String]) -> IpAddr {
    let unspecified = IpAddr::from([0u8, 0, 0, 0]);
    let Some(target) = endpoints
        .first()
        .map(|e| {
            e.trim_start_matches("http://")
                .trim_start_matches("https://")
        })
        .and_then(|hp| hp.to_socket_addrs().ok()?.next())
    else {
        return unspecified;
    };
    let bind: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0"
            .parse()
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
    } else {
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0))
    };
    UdpSocket::bind(bind)
        .and_then(|s| {
            s.connect(target)?;
            s.local_addr()
        })
        .map_or(unspecified, |a| a.ip())
}

#[async_trait]
impl Store for EtcdStore {
    async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), TransportError> {
        let full = self.key(key);
        let sealed = self.seal(&full, &value);
        self.client
            .clone()
            .put(full, sealed, None)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, TransportError> {
        Ok(self.read(&self.key(key)).await?.0.map(|(v, _)| v))
    }

    async fn wait(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let until = tokio::time::Instant::now() + timeout;
        let mut out = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            match self.wait_one(&self.key(k), until).await? {
                Some(v) => out.push(v),
                None => {
                    // Name every key still missing, as the other stores do.
                    let mut missing = vec![k.clone()];
                    for k in &keys[i + 1..] {
                        if self.get(k).await?.is_none() {
                            missing.push(k.clone());
                        }
                    }
                    return Err(TransportError::WaitTimeout {
                        keys: missing,
                        after: timeout,
                    });
                }
            }
        }
        Ok(out)
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, TransportError> {
        let full = self.key(key);
        loop {
            let (cur, _) = self.read(&full).await?;
            let (n, rev) = match cur {
                None => (0, 0),
                Some((v, rev)) => {
                    let n = std::str::from_utf8(&v)
                        .ok()
                        .and_then(|s| s.trim().parse::<i64>().ok())
                        .ok_or_else(|| {
                            TransportError::Store(format!(
                                "add on {key:?}: the value is not an integer"
                            ))
                        })?;
                    (n, rev)
                }
            };
            let next = n.checked_add(delta).ok_or_else(|| {
                TransportError::Store(format!("add on {key:?}: {n} + {delta} overflows"))
            })?;
            if self.put_if(&full, rev, next.to_string().as_bytes()).await? {
                return Ok(next);
            }
        }
    }

    async fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> Result<CompareSet, TransportError> {
        let full = self.key(key);
        loop {
            let (cur, _) = self.read(&full).await?;
            let (value, rev) = match cur {
                Some((v, rev)) => (Some(v), rev),
                None => (None, 0),
            };
            if value != expected {
                return Ok(CompareSet::Current(value));
            }
            if self.put_if(&full, rev, &desired).await? {
                return Ok(CompareSet::Swapped);
            }
            // Changed between the read and the write: look again.
        }
    }

    async fn delete(&self, key: &str) -> Result<bool, TransportError> {
        let r = self
            .client
            .clone()
            .delete(self.key(key), None)
            .await
            .map_err(|e| self.err(e))?;
        Ok(r.deleted() > 0)
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64, TransportError> {
        super::check_prefix(prefix)?;
        let r = self
            .client
            .clone()
            .delete(self.key(prefix), Some(DeleteOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err(e))?;
        Ok(u64::try_from(r.deleted()).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_endpoints() {
        assert_eq!(
            parse_url("etcd://10.0.0.1:2379,h2:2379").unwrap(),
            vec!["http://10.0.0.1:2379", "http://h2:2379"]
        );
        for bad in ["etcd://", "http://a:1", "etcd://a:1/x"] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn secrets_get_disjoint_roots() {
        assert_ne!(root_for(b"a"), root_for(b"b"));
        assert!(root_for(b"a").ends_with('/'));
    }
}
