//! Data links of the cpu backend: one authenticated TCP connection per pair
//! of ranks that talk, opened when an op first needs it (or all at
//! creation, for small communicators), carrying length-prefixed frames,
//! with shared-memory rings for same-host pairs.
//!
//! | module | owns |
//! |--------|------|
//! | [`admission`] | which unauthenticated connections a listener keeps while they handshake |
//! | [`direct`] | reading a link's socket from a blocked caller's thread, and waiting for it in the kernel |
//! | [`frame`] | the frame header and Abort payload, and the two halves of an established link |
//! | [`handshake`] | the four-message proof of the job secret (and the verdict) that opens every link |
//! | [`pool`] | which links exist, and opening the ones an op needs when it needs them |
//! | [`setup`] | opening one link: bootstrap records, listener, dialing, a same-host pair's rings |
//!
//! Each module lists its own invariants ([LK-1], [LK-2], [LK-10] and [LK-11] in [`setup`],
//! [LK-13]..[LK-15] in [`pool`], [LK-12] in [`admission`], [LK-3], [LK-4],
//! [LK-7], [LK-8] and [LK-9] in [`frame`], [LK-5] and [LK-6] in [`handshake`], DR-1
//! and DR-2 in [`direct`]).
//!
//! [LK-1]: crate::backends::cpu::link::setup#invariants
//! [LK-2]: crate::backends::cpu::link::setup#invariants
//! [LK-10]: crate::backends::cpu::link::setup#invariants
//! [LK-11]: crate::backends::cpu::link::setup#invariants
//! [LK-13]: crate::backends::cpu::link::pool#invariants
//! [LK-15]: crate::backends::cpu::link::pool#invariants
//! [LK-3]: crate::backends::cpu::link::frame#invariants
//! [LK-4]: crate::backends::cpu::link::frame#invariants
//! [LK-5]: crate::backends::cpu::link::handshake#invariants
//! [LK-6]: crate::backends::cpu::link::handshake#invariants
//! [LK-7]: crate::backends::cpu::link::frame#invariants
//! [LK-12]: crate::backends::cpu::link::admission#invariants

pub(crate) mod admission;
pub(crate) mod direct;
pub(crate) mod frame;
pub(crate) mod handshake;
pub(crate) mod pool;
pub(crate) mod setup;

pub(crate) use frame::{
    checks_hint, checksum_from_env, crc_field, encode_abort, fingerprint_mismatch, reserve,
    verify_crc, FrameClass, FrameKind, LinkReader, LinkWriter, Liveness, RecvFrames, RecvInto,
    Recvs, SendFrames, Sends, Tag, FLAG_CRC, MAX_HEADER_FRAME, WORK_UNIT,
};
pub(crate) use pool::Pool;
pub(crate) use setup::listen;
