//! `chorus-rendezvous`: a standalone rendezvous store server for Chorus jobs.
//!
//! Serves the key-value store that ranks use to find each other, over QUIC
//! (TLS 1.3), to clients that prove the job secret. The secret is read from
//! an environment variable (never from the command line, where other users
//! could see it in the process list).
//!
//! ```text
//! CHORUS_SECRET=$(head -c 32 /dev/urandom | base64) \
//!     chorus-rendezvous --bind 0.0.0.0:29500
//! listening on 0.0.0.0:29500
//! ```
//!
//! Runs until SIGINT (ctrl-c) or SIGTERM. Logs go to stderr (`RUST_LOG`).

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use chorus::transport::RendezvousServer;
use clap::Parser;

/// Standalone rendezvous store server for Chorus jobs.
#[derive(Debug, Parser)]
#[command(name = "chorus-rendezvous", version)]
struct Args {
    /// Address to listen on (UDP). Use 0.0.0.0:29500 to serve other hosts;
    /// port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:29500")]
    bind: SocketAddr,
    /// Environment variable holding the job secret.
    #[arg(long, default_value = "CHORUS_SECRET")]
    secret_env: String,
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();

    let secret = match std::env::var_os(&args.secret_env) {
        Some(s) if !s.is_empty() => s,
        _ => {
            eprintln!(
                "chorus-rendezvous: no job secret: set the {} environment variable to a random \
                 value shared by every rank of the job (e.g. `export {}=$(head -c 32 /dev/urandom | base64)`)",
                args.secret_env, args.secret_env
            );
            return ExitCode::from(2);
        }
    };
    let secret = secret.as_encoded_bytes().to_vec();

    let server = match RendezvousServer::bind(args.bind, &secret).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("chorus-rendezvous: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening on {}", server.local_addr());
        let _ = out.flush();
    }

    shutdown_signal().await;
    tracing::info!("signal received; shutting down");
    server.shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(5), server.stopped()).await;
    ExitCode::SUCCESS
}
