//! The `cpu` backend: Chorus's own data plane, built in and the default.
//!
//! STUB: to be implemented.

use async_trait::async_trait;

use super::{Backend, BackendInit, OpCtx, OpData};
use crate::error::{Error, Result};

pub mod reduce;
pub mod schedule;

/// The cpu backend of one communicator on one rank.
#[derive(Debug)]
pub struct CpuBackend {
    init: BackendInit,
}

impl CpuBackend {
    /// Connect to every peer through the store.
    pub async fn connect(init: BackendInit) -> Result<CpuBackend> {
        Ok(CpuBackend { init })
    }
}

#[async_trait]
impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    async fn exchange_headers(
        &mut self,
        _ctx: &OpCtx,
        _outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        Err(Error::Internal(format!(
            "cpu backend not implemented ({})",
            self.init.comm
        )))
    }
    async fn execute(&mut self, _ctx: &OpCtx, _data: &mut OpData) -> Result<()> {
        Err(Error::Internal("cpu backend not implemented".into()))
    }
    async fn abort(&mut self, _reason: &str, _failed: &[usize]) {}
    async fn finalize(&mut self) {}
}
