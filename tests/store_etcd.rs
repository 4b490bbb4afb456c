//! The etcd store (feature `etcd`) against a real etcd server that each
//! test starts on loopback: random free ports, a fresh data directory,
//! killed and removed at the end. Without an `etcd` binary (Debian
//! `etcd-server`, installed by `scripts/install-deps.sh`) every test prints
//! why and returns. Bounded: connects and waits have deadlines, and nextest
//! kills a test after 2 minutes.
#![cfg(feature = "etcd")]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::transport::{CompareSet, EtcdStore, Store, TransportError};
use chorus::{new_comm, CommOptions, Device, Error, ReduceOp, Rendezvous, Tensor};

const T: Duration = Duration::from_secs(30);

/// A running etcd; killed and its data removed on drop.
struct Etcd {
    child: Child,
    dir: PathBuf,
    endpoint: String,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// Start etcd, or `None` (with a message) if there is no etcd binary.
fn etcd() -> Option<Etcd> {
    let bin = std::env::var("CHORUS_TEST_ETCD").unwrap_or_else(|_| "etcd".into());
    if Command::new(&bin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        eprintln!(
            "SKIP: no `{bin}` binary (Debian etcd-server; ./scripts/install-deps.sh installs it)"
        );
        return None;
    }
    let (client, peer) = (free_port(), free_port());
    let dir =
        std::env::temp_dir().join(format!("chorus-etcd-test-{}-{client}", std::process::id()));
    let c = format!("http://127.0.0.1:{client}");
    let p = format!("http://127.0.0.1:{peer}");
    let child = Command::new(&bin)
        .args(["--name", "t", "--data-dir"])
        .arg(&dir)
        .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
        .args([
            "--listen-peer-urls",
            &p,
            "--initial-advertise-peer-urls",
            &p,
        ])
        .args(["--initial-cluster", &format!("t={p}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start etcd");
    Some(Etcd {
        child,
        dir,
        endpoint: c,
    })
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

async fn connect(e: &Etcd, secret: &[u8]) -> EtcdStore {
    EtcdStore::connect(std::slice::from_ref(&e.endpoint), secret, None, T)
        .await
        .expect("connect to etcd")
}

#[test]
fn etcd_store_passes_the_store_suite() {
    let Some(e) = etcd() else { return };
    rt().block_on(async {
        tokio::time::timeout(T * 2, async {
            let s = Arc::new(connect(&e, b"suite-secret").await);
            // set / get / delete
            s.set("a", b"1".to_vec()).await.unwrap();
            assert_eq!(s.get("a").await.unwrap(), Some(b"1".to_vec()));
            assert_eq!(s.get("nope").await.unwrap(), None);
            assert!(s.delete("a").await.unwrap());
            assert!(!s.delete("a").await.unwrap());
            // add: absent is 0; a non-integer is a store error
            assert_eq!(s.add("n", 3).await.unwrap(), 3);
            assert_eq!(s.add("n", -1).await.unwrap(), 2);
            s.set("x", b"not a number".to_vec()).await.unwrap();
            assert!(matches!(s.add("x", 1).await, Err(TransportError::Store(_))));
            // compare_set: absent, matching, stale
            assert_eq!(
                s.compare_set("c", None, b"v1".to_vec()).await.unwrap(),
                CompareSet::Swapped
            );
            assert_eq!(
                s.compare_set("c", None, b"v2".to_vec()).await.unwrap(),
                CompareSet::Current(Some(b"v1".to_vec()))
            );
            assert_eq!(
                s.compare_set("c", Some(b"v1".to_vec()), b"v3".to_vec())
                    .await
                    .unwrap(),
                CompareSet::Swapped
            );
            assert_eq!(s.get("c").await.unwrap(), Some(b"v3".to_vec()));
            // add is atomic under contention (EC-2)
            let tasks: Vec<_> = (0..8)
                .map(|_| {
                    let s = s.clone();
                    tokio::spawn(async move {
                        for _ in 0..10 {
                            s.add("counter", 1).await.unwrap();
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            assert_eq!(s.add("counter", 0).await.unwrap(), 80);
            // wait: returns once every key is set, in order
            let w = {
                let s = s.clone();
                tokio::spawn(async move { s.wait(&["w1".into(), "w2".into()], T).await })
            };
            s.set("w2", b"2".to_vec()).await.unwrap();
            s.set("w1", b"1".to_vec()).await.unwrap();
            assert_eq!(
                w.await.unwrap().unwrap(),
                vec![b"1".to_vec(), b"2".to_vec()]
            );
            // wait: times out naming the missing keys
            match s
                .wait(
                    &["w1".into(), "m1".into(), "m2".into()],
                    Duration::from_millis(200),
                )
                .await
            {
                Err(TransportError::WaitTimeout { keys, after }) => {
                    assert_eq!(keys, vec!["m1".to_string(), "m2".to_string()]);
                    assert_eq!(after, Duration::from_millis(200));
                }
                other => panic!("unexpected {other:?}"),
            }
            // delete_prefix: a subtree only; bad prefixes refused
            for k in ["p/1/a", "p/1/b", "p/10/a"] {
                s.set(k, vec![]).await.unwrap();
            }
            assert_eq!(s.delete_prefix("p/1/").await.unwrap(), 2);
            assert_eq!(s.get("p/10/a").await.unwrap(), Some(vec![]));
            assert!(matches!(
                s.delete_prefix("p/1").await,
                Err(TransportError::Store(_))
            ));
        })
        .await
        .expect("bounded");
    });
}

#[test]
fn values_without_the_secret_are_refused_and_secrets_do_not_share_keys() {
    let Some(e) = etcd() else { return };
    rt().block_on(async {
        tokio::time::timeout(T * 2, async {
            let s = connect(&e, b"job-secret").await;
            s.set("k", b"mine".to_vec()).await.unwrap();
            // Another secret: its own key space, so it sees nothing.
            let other = connect(&e, b"other-secret").await;
            assert_eq!(other.get("k").await.unwrap(), None);
            // A client without the secret writes under this job's key.
            let root = chorus::transport::etcd::root_for(b"job-secret");
            let mut raw = etcd_client::Client::connect([e.endpoint.as_str()], None)
                .await
                .unwrap();
            raw.put(format!("{root}k"), b"forged".to_vec(), None)
                .await
                .unwrap();
            assert!(
                matches!(s.get("k").await, Err(TransportError::AuthFailed { .. })),
                "a forged value must be refused"
            );
            // A genuine value moved to another key is refused too.
            s.set("a", b"1".to_vec()).await.unwrap();
            let v = raw.get(format!("{root}a"), None).await.unwrap();
            let sealed = v.kvs()[0].value().to_vec();
            raw.put(format!("{root}b"), sealed, None).await.unwrap();
            assert!(matches!(
                s.get("b").await,
                Err(TransportError::AuthFailed { .. })
            ));
            assert!(matches!(
                s.wait(&["b".into()], T).await,
                Err(TransportError::AuthFailed { .. })
            ));
        })
        .await
        .expect("bounded");
    });
}

/// Run `size` ranks as threads over one etcd store; `f` gets each comm.
fn ranks_over<T: Send + 'static>(
    store: Arc<dyn Store>,
    size: usize,
    name: &str,
    hb: Option<(Duration, Duration)>,
    f: impl Fn(chorus::Comm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let (store, f, name) = (store.clone(), f.clone(), name.to_string());
            std::thread::spawn(move || {
                let mut o = CommOptions::default()
                    .with_rank(rank, size)
                    .with_rendezvous(Rendezvous::Store(store))
                    .with_secret("job-secret")
                    .with_timeout(T)
                    .with_connect_timeout(T);
                if let Some((i, t)) = hb {
                    o = o.with_heartbeat(i, t);
                }
                let comm = new_comm("cpu", Device::Cpu, &name, o).expect("new_comm over etcd");
                f(comm)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect()
}

#[test]
fn a_job_over_etcd_reduces_and_leaves_no_keys_after_finalize() {
    let Some(e) = etcd() else { return };
    let rt = rt();
    let store: Arc<dyn Store> = Arc::new(rt.block_on(connect(&e, b"job-secret")));
    let sums = ranks_over(store, 3, "etcd-job", None, |comm| {
        let t = comm
            .all_reduce(
                Tensor::from_vec(vec![comm.rank() as i32 + 1]),
                ReduceOp::Sum,
            )
            .unwrap();
        comm.finalize().unwrap();
        t.as_slice::<i32>()[0]
    });
    assert_eq!(sums, vec![6, 6, 6]);
    let root = chorus::transport::etcd::root_for(b"job-secret");
    let left = rt.block_on(async {
        let mut raw = etcd_client::Client::connect([e.endpoint.as_str()], None)
            .await
            .unwrap();
        raw.get(root, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .unwrap()
            .kvs()
            .iter()
            .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
            .collect::<Vec<_>>()
    });
    assert_eq!(left, Vec::<String>::new());
}

#[test]
fn etcd_killed_mid_job_is_reported_as_store_unreachable_on_every_rank() {
    let Some(mut e) = etcd() else { return };
    let rt = rt();
    let store: Arc<dyn Store> = Arc::new(rt.block_on(connect(&e, b"job-secret")));
    let hb = (Duration::from_millis(100), Duration::from_secs(2));
    let all = Arc::new(std::sync::Barrier::new(4));
    let main = all.clone();
    let killer = std::thread::spawn(move || {
        main.wait();
        let _ = e.child.kill();
        let _ = e.child.wait();
        e
    });
    let out = ranks_over(store, 3, "etcd-dies", Some(hb), move |comm| {
        comm.barrier().unwrap();
        all.wait();
        let lost = Instant::now();
        let e = loop {
            if let Err(e) = comm.all_reduce(Tensor::full(1.0f32, 1024), ReduceOp::Sum) {
                break e;
            }
        };
        let took = lost.elapsed();
        let store_lost = match &e {
            Error::StoreUnreachable { .. } => true,
            Error::Aborted {
                reason,
                failed_ranks,
                ..
            } => failed_ranks.is_empty() && reason.contains("lost the rendezvous store"),
            _ => false,
        };
        assert!(store_lost, "rank {}: {e}", comm.rank());
        assert!(took < hb.1 + Duration::from_secs(3), "took {took:?}");
        took
    });
    assert_eq!(out.len(), 3);
    drop(killer.join().expect("killer"));
}
