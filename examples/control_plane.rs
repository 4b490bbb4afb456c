//! Control-plane measurements for docs/performance.md: bootstrap time of a
//! communicator (QUIC store hosted by rank 0, TCP mesh, shared-memory rings
//! where enabled, then one barrier) for 2..64 in-process ranks on loopback,
//! and rendezvous-store throughput (set/get/add over QUIC, one client and
//! eight concurrent ones).
//!
//! ```text
//! cargo run --release --example control_plane [max_ranks]
//! ```

use std::net::{SocketAddr, UdpSocket};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use chorus::transport::{RendezvousServer, Store, StoreClient};
use chorus::{new_comm, CommOptions, Device, Rendezvous};

fn free_addr() -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").expect("udp bind");
    s.local_addr().expect("addr")
}

/// Seconds from "all threads start" to "every rank finished its first barrier".
fn bootstrap(n: usize) -> f64 {
    let addr = free_addr();
    let start_line = Arc::new(Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let start_line = start_line.clone();
            std::thread::spawn(move || {
                start_line.wait();
                let t0 = Instant::now();
                let opts = CommOptions::default()
                    .with_rank(rank, n)
                    .with_secret(b"control-plane".to_vec())
                    .with_connect_timeout(Duration::from_secs(120))
                    .with_rendezvous(Rendezvous::Master(addr));
                let comm = new_comm("cpu", Device::Cpu, "boot", opts).expect("new_comm");
                comm.barrier().expect("barrier");
                let dt = t0.elapsed().as_secs_f64();
                comm.finalize().expect("finalize");
                dt
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("rank"))
        .fold(0.0, f64::max)
}

async fn store_ops() -> (f64, f64) {
    let secret = b"store-bench";
    let server = RendezvousServer::bind("127.0.0.1:0".parse().expect("addr"), secret)
        .await
        .expect("server");
    let addr = server.local_addr();
    let client = StoreClient::connect(addr, secret, Duration::from_secs(10))
        .await
        .expect("client");
    let n = 2000;
    let t0 = Instant::now();
    for i in 0..n {
        match i % 3 {
            0 => client
                .set(&format!("k{i}"), vec![1; 32])
                .await
                .expect("set"),
            1 => drop(client.get(&format!("k{}", i - 1)).await.expect("get")),
            _ => drop(client.add("ctr", 1).await.expect("add")),
        }
    }
    let one = n as f64 / t0.elapsed().as_secs_f64();
    let clients: Vec<Arc<StoreClient>> = futures::future::join_all(
        (0..8).map(|_| StoreClient::connect(addr, secret, Duration::from_secs(10))),
    )
    .await
    .into_iter()
    .map(|c| Arc::new(c.expect("client")))
    .collect();
    let t0 = Instant::now();
    futures::future::join_all(clients.iter().enumerate().map(|(c, cl)| async move {
        for i in 0..n / 8 {
            cl.set(&format!("c{c}/{i}"), vec![2; 32])
                .await
                .expect("set");
        }
    }))
    .await;
    let eight = n as f64 / t0.elapsed().as_secs_f64();
    server.shutdown();
    (one, eight)
}

fn main() {
    let max: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(64);
    println!("| ranks | bootstrap + first barrier (ms), median of 3 |");
    println!("|---|---|");
    let mut n = 2;
    while n <= max {
        let mut v: Vec<f64> = (0..3).map(|_| bootstrap(n)).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        println!("| {n} | {:.1} |", v[1] * 1e3);
        n *= 2;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (one, eight) = rt.block_on(store_ops());
    println!("\nstore ops/s over QUIC on loopback: 1 client (set/get/add mix) {one:.0}; 8 concurrent clients (set) {eight:.0}");
}
