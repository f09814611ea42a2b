//! Code generation: a plan becomes one program per device, and the runtime runs them.
//!
//! - [`lower`](lower::lower) turns a graph and a [`Placement`] (per-op strategies on stage
//!   meshes) into a [`Program`]: per device, a graph on local shapes with explicit
//!   communication ops (`AllReduce`, `AllGather`, `ReduceScatter`, `AllToAll`, `Send`/`Recv`,
//!   `HaloExchange`, in the `shardc` domain), printable in the ONNX textual syntax.
//! - [`check`](check::check) proves a program consistent before it runs: shapes, matching
//!   collectives, paired sends, no deadlock.
//! - [`verify`](verify::verify) proves that the devices' programs, composed by their
//!   collectives and transfers, compute the graph they were lowered from.
//! - [`runtime`] runs a program with one thread per simulated device, on the CPU reference
//!   kernels or on WGSL compute shaders through wgpu (one instance per device), with
//!   collectives through host staging buffers.
//!
//! wgpu is used only in `runtime::gpu`.
// One audited exception: the CPU executor's SGEMM call (`runtime::cpu::gemm`).
#![deny(unsafe_code)]
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod check;
pub mod cut;
pub mod layout;
pub mod lower;
pub mod memory;
pub mod program;
pub mod runtime;
pub mod schedule;
pub mod verify;

pub use check::{CheckError, check};
pub use lower::{LowerError, lower};
pub use program::{DeviceProgram, Feed, GlobalValue, Placement, Program, StagePlacement};
pub use runtime::{
    AdapterLimits, Backend, Distributed, Hub, Key, RunOptions, RunReport, RuntimeError, StepHook, Transport, run,
};
pub use schedule::Schedule;
pub use verify::{Proof, Refutation, RefutationKind, verify};
