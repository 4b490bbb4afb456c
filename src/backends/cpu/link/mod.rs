//! Data links of the cpu backend: one authenticated TCP connection per pair
//! of ranks, carrying length-prefixed frames, with shared-memory rings for
//! same-host pairs.
//!
//! | module | owns |
//! |--------|------|
//! | [`admission`] | which unauthenticated connections a listener keeps while they handshake |
//! | [`frame`] | the frame header and Abort payload, and the two halves of an established link |
//! | [`handshake`] | the three-message proof of the job secret that opens every link |
//! | [`mesh`] | the setup of a communicator's full mesh and its shared-memory rings |
//!
//! Each module lists its own invariants ([LK-1] and [LK-2] in [`mesh`], [LK-12] in [`admission`], [LK-3], [LK-4],
//! [LK-7], [LK-8] and [LK-9] in [`frame`], [LK-5] and [LK-6] in [`handshake`]).
//!
//! [LK-1]: crate::backends::cpu::link::mesh#invariants
//! [LK-2]: crate::backends::cpu::link::mesh#invariants
//! [LK-3]: crate::backends::cpu::link::frame#invariants
//! [LK-4]: crate::backends::cpu::link::frame#invariants
//! [LK-5]: crate::backends::cpu::link::handshake#invariants
//! [LK-6]: crate::backends::cpu::link::handshake#invariants
//! [LK-7]: crate::backends::cpu::link::frame#invariants
//! [LK-12]: crate::backends::cpu::link::admission#invariants

pub(crate) mod admission;
pub(crate) mod frame;
pub(crate) mod handshake;
pub(crate) mod mesh;

pub(crate) use frame::{
    checks_hint, checksum_from_env, crc_field, encode_abort, fingerprint_mismatch, split_link,
    verify_crc, FrameClass, FrameKind, LinkReader, LinkWriter, Liveness, RecvInto, Tag, FLAG_CRC,
    MAX_HEADER_FRAME, WORK_UNIT,
};
pub(crate) use mesh::{connect_mesh, listen, setup_shm, Mesh};
