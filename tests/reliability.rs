//! Reliability of the bootstrap across communicator lifetimes.

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus::{new_comm, CommOptions, Device, ReduceOp, Rendezvous, Tensor};

const DEADLINE: Duration = Duration::from_secs(60);

fn free_port() -> u16 {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind udp");
    s.local_addr().expect("addr").port()
}

/// Rank 0 hosts the QUIC store on a fixed port; dropping its communicator
/// and creating the next one at once, on the same port, must work (the old
/// socket may still be closing).
#[test]
fn new_comm_right_after_dropping_the_previous_one_works_on_rank_0() {
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let (tx, rx) = mpsc::channel();
    for rank in 0..2usize {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut sums = Vec::new();
            for round in 0..3 {
                let opts = CommOptions::default()
                    .with_rank(rank, 2)
                    .with_rendezvous(Rendezvous::Master(addr))
                    .with_secret("recreate")
                    .with_timeout(Duration::from_secs(20))
                    .with_connect_timeout(Duration::from_secs(20));
                let r = new_comm("cpu", Device::Cpu, &format!("recreate{round}"), opts)
                    .and_then(|c| c.all_reduce(Tensor::from_vec(vec![1i32]), ReduceOp::Sum));
                match r {
                    Ok(t) => sums.push(t.as_slice::<i32>()[0]),
                    Err(e) => {
                        let _ = tx.send((rank, Err(format!("round {round}: {e}"))));
                        return;
                    }
                }
            }
            let _ = tx.send((rank, Ok(sums)));
        });
    }
    let deadline = Instant::now() + DEADLINE;
    for _ in 0..2 {
        let left = deadline.saturating_duration_since(Instant::now());
        let (rank, r) = rx.recv_timeout(left).expect("ranks finish in time");
        assert_eq!(r, Ok(vec![2, 2, 2]), "rank {rank}");
    }
}
