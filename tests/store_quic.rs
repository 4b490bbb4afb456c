//! The rendezvous store over QUIC, end to end on loopback: several clients,
//! authentication, malformed peers, late servers, absent servers.

use std::future::Future;
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::transport::quic;
use chorus::transport::wire::{self, Request};
use chorus::transport::{CompareSet, RendezvousServer, Store, StoreClient, TransportError};

const SECRET: &[u8] = b"test-job-secret";
const LIMIT: Duration = Duration::from_secs(30);
const CONNECT: Duration = Duration::from_secs(10);

/// Every test body runs under a 30 s limit so nothing hangs CI.
async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("test exceeded its 30 s limit");
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn server() -> RendezvousServer {
    RendezvousServer::bind(loopback(), SECRET).await.unwrap()
}

async fn client(server: &RendezvousServer) -> StoreClient {
    StoreClient::connect(server.local_addr(), SECRET, CONNECT)
        .await
        .unwrap()
}

/// An authenticated raw QUIC connection, for sending frames a well-behaved
/// client never would.
async fn raw_connection(addr: SocketAddr) -> (quinn::Endpoint, quinn::Connection) {
    let mut ep = quinn::Endpoint::client(loopback()).unwrap();
    ep.set_default_client_config(quic::client_config().unwrap());
    let conn = ep.connect(addr, quic::SERVER_NAME).unwrap().await.unwrap();
    quic::authenticate_client(&conn, SECRET).await.unwrap();
    (ep, conn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_operation_works_over_quic() {
    bounded(async {
        let server = server().await;
        let c = client(&server).await;
        c.set("comm/0/addr", b"a0".to_vec()).await.unwrap();
        assert_eq!(c.get("comm/0/addr").await.unwrap(), Some(b"a0".to_vec()));
        assert_eq!(c.get("comm/0/none").await.unwrap(), None);
        assert_eq!(
            c.wait(&["comm/0/addr".into()], Duration::from_secs(1))
                .await
                .unwrap(),
            vec![b"a0".to_vec()]
        );
        assert_eq!(c.add("ctr", 5).await.unwrap(), 5);
        assert_eq!(c.add("ctr", -2).await.unwrap(), 3);
        assert_eq!(
            c.compare_set("leader", None, b"r1".to_vec()).await.unwrap(),
            CompareSet::Swapped
        );
        assert_eq!(
            c.compare_set("leader", None, b"r2".to_vec()).await.unwrap(),
            CompareSet::Current(Some(b"r1".to_vec()))
        );
        assert_eq!(
            c.compare_set("leader", Some(b"r1".to_vec()), b"r3".to_vec())
                .await
                .unwrap(),
            CompareSet::Swapped
        );
        assert!(c.delete("leader").await.unwrap());
        assert!(!c.delete("leader").await.unwrap());
        assert!(matches!(
            c.add("comm/0/addr", 1).await,
            Err(TransportError::Store(_))
        ));
        // Values up to well over one QUIC packet travel intact.
        let big = vec![0xab; 1 << 20];
        c.set("big", big.clone()).await.unwrap();
        assert_eq!(c.get("big").await.unwrap(), Some(big));
        assert!(c.local_ip().is_loopback());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_rendezvous_and_count_exactly() {
    bounded(async {
        let server = server().await;
        let n = 8;
        let keys: Vec<String> = (0..n).map(|r| format!("job/ep0/rank/{r}")).collect();
        let mut tasks = Vec::new();
        for rank in 0..n {
            let addr = server.local_addr();
            let keys = keys.clone();
            tasks.push(tokio::spawn(async move {
                let c = StoreClient::connect(addr, SECRET, CONNECT).await.unwrap();
                for _ in 0..10 {
                    c.add("job/ep0/count", 1).await.unwrap();
                }
                c.set(&keys[rank], format!("addr-{rank}").into_bytes())
                    .await
                    .unwrap();
                c.wait(&keys, Duration::from_secs(20)).await.unwrap()
            }));
        }
        let expected: Vec<Vec<u8>> = (0..n).map(|r| format!("addr-{r}").into_bytes()).collect();
        for t in tasks {
            assert_eq!(t.await.unwrap(), expected);
        }
        let c = client(&server).await;
        assert_eq!(c.add("job/ep0/count", 0).await.unwrap(), 10 * n as i64);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_wakes_when_another_client_sets() {
    bounded(async {
        let server = server().await;
        let waiter = Arc::new(client(&server).await);
        let setter = client(&server).await;
        let w = waiter.clone();
        let waiting = tokio::spawn(async move {
            let start = Instant::now();
            let v = w
                .wait(&["late".into(), "early".into()], Duration::from_secs(20))
                .await;
            (v, start.elapsed())
        });
        setter.set("early", b"e".to_vec()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        setter.set("late", b"l".to_vec()).await.unwrap();
        let (v, took) = waiting.await.unwrap();
        assert_eq!(v.unwrap(), vec![b"l".to_vec(), b"e".to_vec()]);
        assert!(
            took < Duration::from_secs(5),
            "wait woke only after {took:?}"
        );
        // A long wait does not hold up other requests on the same connection.
        let w = waiter.clone();
        let pending =
            tokio::spawn(async move { w.wait(&["x".into()], Duration::from_secs(20)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(waiter.get("early").await.unwrap(), Some(b"e".to_vec()));
        waiter.set("x", b"1".to_vec()).await.unwrap();
        assert_eq!(pending.await.unwrap().unwrap(), vec![b"1".to_vec()]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_timeout_names_the_missing_keys() {
    bounded(async {
        let server = server().await;
        let c = client(&server).await;
        c.set("present", vec![]).await.unwrap();
        let start = Instant::now();
        let err = c
            .wait(
                &["present".into(), "gone/1".into(), "gone/2".into()],
                Duration::from_millis(300),
            )
            .await
            .unwrap_err();
        let took = start.elapsed();
        match &err {
            TransportError::WaitTimeout { keys, after } => {
                assert_eq!(keys, &vec!["gone/1".to_string(), "gone/2".to_string()]);
                assert_eq!(*after, Duration::from_millis(300));
            }
            other => panic!("expected WaitTimeout, got {other:?}"),
        }
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(5));
        assert!(err.to_string().contains("gone/1"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused_with_auth_failed() {
    bounded(async {
        let server = server().await;
        let good = client(&server).await;
        let start = Instant::now();
        // A long connect timeout: an auth failure must not be retried.
        let err = StoreClient::connect(server.local_addr(), b"wrong", Duration::from_secs(20))
            .await
            .unwrap_err();
        assert!(
            matches!(err, TransportError::AuthFailed { .. }),
            "expected AuthFailed, got {err:?}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "auth failure was retried"
        );
        // The server keeps serving clients that know the secret.
        good.set("still", b"here".to_vec()).await.unwrap();
        let late = client(&server).await;
        assert_eq!(late.get("still").await.unwrap(), Some(b"here".to_vec()));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_streams_are_not_served() {
    bounded(async {
        let server = server().await;
        let mut ep = quinn::Endpoint::client(loopback()).unwrap();
        ep.set_default_client_config(quic::client_config().unwrap());
        let conn = ep
            .connect(server.local_addr(), quic::SERVER_NAME)
            .unwrap()
            .await
            .unwrap();
        // Skip the challenge and send a store request on the first stream.
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        // Before authentication the server grants no second stream.
        assert!(
            tokio::time::timeout(Duration::from_millis(200), conn.open_bi())
                .await
                .is_err(),
            "TP-1: a second stream was granted before authentication"
        );
        let body = wire::encode_request(&Request::Set {
            key: "intruder".into(),
            value: vec![1],
        })
        .unwrap();
        wire::write_frame(&mut send, &body).await.unwrap();
        let _ = send.finish();
        // Whatever the server makes of it, no store response comes back and
        // the connection is closed.
        while let Ok(frame) = wire::read_frame(&mut recv).await {
            assert!(wire::decode_response(&frame).is_err());
        }
        let _ = conn.closed().await;
        assert_eq!(server.store().len(), 0, "TP-1: request served before auth");
    })
    .await;
}

async fn disconnects_only_the_sender(bad_frame: Vec<u8>) {
    let server = server().await;
    let good = client(&server).await;
    good.set("k", b"v".to_vec()).await.unwrap();
    let (_ep, conn) = raw_connection(server.local_addr()).await;
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&bad_frame).await.unwrap();
    let _ = send.finish();
    assert!(wire::read_frame(&mut recv).await.is_err());
    match conn.closed().await {
        quinn::ConnectionError::ApplicationClosed(close) => {
            assert_eq!(
                close.error_code,
                quinn::VarInt::from_u32(quic::CLOSE_MALFORMED)
            )
        }
        other => panic!("expected a malformed-frame close, got {other:?}"),
    }
    // The other client is unaffected, and new clients are still served.
    assert_eq!(good.get("k").await.unwrap(), Some(b"v".to_vec()));
    let again = client(&server).await;
    assert_eq!(again.get("k").await.unwrap(), Some(b"v".to_vec()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frame_disconnects_only_its_sender() {
    bounded(async {
        let mut frame = 64u32.to_le_bytes().to_vec();
        frame.extend_from_slice(&[0xee; 64]);
        disconnects_only_the_sender(frame).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frame_disconnects_only_its_sender() {
    bounded(async {
        // Announce more than MAX_FRAME; the body never follows (TP-2).
        let frame = ((wire::MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
        disconnects_only_the_sender(frame).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_survives_a_client_vanishing_mid_request() {
    bounded(async {
        let server = server().await;
        {
            let (ep, conn) = raw_connection(server.local_addr()).await;
            let (mut send, _recv) = conn.open_bi().await.unwrap();
            // Half a frame, then the whole endpoint disappears without a close.
            send.write_all(&100u32.to_le_bytes()).await.unwrap();
            send.write_all(&[1, 2, 3]).await.unwrap();
            drop(send);
            drop(conn);
            drop(ep);
        }
        {
            // A client dropped in the middle of a wait.
            let c = client(&server).await;
            let _ = tokio::time::timeout(
                Duration::from_millis(100),
                c.wait(&["never".into()], Duration::from_secs(60)),
            )
            .await;
        }
        let c = client(&server).await;
        c.set("alive", vec![1]).await.unwrap();
        assert_eq!(c.get("alive").await.unwrap(), Some(vec![1]));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_retries_until_a_late_server_comes_up() {
    bounded(async {
        // Reserve a free port, release it, and start the server there later.
        let addr = UdpSocket::bind(loopback()).unwrap().local_addr().unwrap();
        let connecting = tokio::spawn(async move {
            StoreClient::connect(addr, SECRET, Duration::from_secs(20)).await
        });
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let server = RendezvousServer::bind(addr, SECRET).await.unwrap();
        let c = connecting.await.unwrap().unwrap();
        c.set("up", vec![]).await.unwrap();
        assert_eq!(server.store().len(), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_nothing_gives_connect_failed_within_the_timeout() {
    bounded(async {
        let addr = UdpSocket::bind(loopback()).unwrap().local_addr().unwrap();
        let timeout = Duration::from_millis(1500);
        let start = Instant::now();
        let err = StoreClient::connect(addr, SECRET, timeout)
            .await
            .unwrap_err();
        let took = start.elapsed();
        match &err {
            TransportError::ConnectFailed { after, .. } => assert_eq!(*after, timeout),
            other => panic!("expected ConnectFailed, got {other:?}"),
        }
        assert!(
            took >= timeout && took < timeout + Duration::from_secs(3),
            "took {took:?}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_to_an_unresponsive_server_fails_at_its_deadline() {
    bounded(async {
        // A server that authenticates clients, then never answers.
        let ep = quinn::Endpoint::server(quic::server_config().unwrap(), loopback()).unwrap();
        let addr = ep.local_addr().unwrap();
        let mute = tokio::spawn(async move {
            let conn = ep.accept().await.unwrap().await.unwrap();
            quic::authenticate_server(&conn, SECRET).await.unwrap();
            let mut held = Vec::new();
            while let Ok(stream) = conn.accept_bi().await {
                held.push(stream);
            }
        });
        let c = StoreClient::connect(addr, SECRET, CONNECT)
            .await
            .unwrap()
            .with_request_timeout(Duration::from_millis(300));
        let start = Instant::now();
        let err = c.get("k").await.unwrap_err();
        assert!(
            matches!(err, TransportError::ConnectionLost { .. }),
            "expected ConnectionLost, got {err:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(5));
        drop(c);
        mute.abort();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_server_fails_requests_with_connection_lost() {
    bounded(async {
        let server = server().await;
        let c = client(&server).await;
        c.set("a", vec![]).await.unwrap();
        drop(server);
        let err = c.get("a").await.unwrap_err();
        assert!(
            matches!(err, TransportError::ConnectionLost { .. }),
            "expected ConnectionLost, got {err:?}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_loopback_works_when_available() {
    bounded(async {
        let addr: SocketAddr = "[::1]:0".parse().unwrap();
        let server = match RendezvousServer::bind(addr, SECRET).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("skipping: no IPv6 loopback here ({e})");
                return;
            }
        };
        let c = StoreClient::connect(server.local_addr(), SECRET, CONNECT)
            .await
            .unwrap();
        c.set("v6", vec![6]).await.unwrap();
        assert_eq!(c.get("v6").await.unwrap(), Some(vec![6]));
        assert!(c.local_ip().is_ipv6());
    })
    .await;
}

/// Kills the child process if the test fails before it exits.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The standalone server binary: refuses to start without a secret, prints
/// its address, serves clients, and exits cleanly on SIGINT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_binary_serves_until_sigint_and_needs_a_secret() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    bounded(async {
        let bin = env!("CARGO_BIN_EXE_chorus-rendezvous");
        let out = Command::new(bin)
            .args(["--bind", "127.0.0.1:0"])
            .env_remove("CHORUS_SECRET")
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("CHORUS_SECRET"));

        let mut child = Command::new(bin)
            .args(["--bind", "127.0.0.1:0", "--secret-env", "MY_JOB_SECRET"])
            .env("MY_JOB_SECRET", "s3cret")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let pid = child.id().to_string();
        let mut child = KillOnDrop(child);
        let line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufReader::new(stdout)
                .read_line(&mut line)
                .map(|_| line)
        })
        .await
        .unwrap()
        .unwrap();
        let addr: SocketAddr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .parse()
            .unwrap();
        let c = StoreClient::connect(addr, b"s3cret", CONNECT)
            .await
            .unwrap();
        c.set("k", vec![1]).await.unwrap();
        assert_eq!(c.get("k").await.unwrap(), Some(vec![1]));

        assert!(Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success());
        let status = tokio::task::spawn_blocking(move || child.0.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "exit status {status:?}");
    })
    .await;
}
