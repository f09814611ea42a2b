//! The wgpu executor: each simulated accelerator has its own `wgpu::Instance`, adapter,
//! device and queue (so devices run in parallel on a software rasterizer too), and runs every
//! op as WGSL compute shaders generated for it.
//!
//! Generating the shaders is a pure step ([`compile`]): the op, its inputs' shapes and types
//! become a [`compile::Compiled`] program of launches, one file per kernel family
//! ([`elementwise`], [`reduce`], [`norm`], [`gemm`], [`conv`], [`movement`], [`recurrent`],
//! sharing [`wgsl`]). The executor only allocates buffers and launches.
//!
//! Tensors live in storage buffers: floating-point types as `f32`, integers and booleans as
//! `i32` (64-bit integers are narrowed; host copies of small tensors keep their exact values
//! for ops that read shapes and indices). An op without a kernel runs on the host with the
//! reference kernels ([`compile::HOST_ONLY`] lists those that always do), and the run report
//! counts it.

pub mod attention;
pub mod compile;
pub mod conv;
pub mod elementwise;
pub mod experts;
pub mod flash;
pub mod fused;
pub mod gemm;
pub mod loss;
pub mod movement;
pub mod norm;
pub mod optim;
pub mod recurrent;
pub mod reduce;
pub mod wgsl;

#[cfg(feature = "gpu")]
mod executor;
#[cfg(feature = "gpu")]
pub use executor::{GpuExecutor, GpuTensor, device_host_bytes, limits, open};

use ir::DType;

/// How elements are stored on the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Elem {
    /// 32-bit floats.
    F32,
    /// 32-bit signed integers (also booleans, as 0/1).
    I32,
}

impl Elem {
    /// The element storage of a logical type.
    pub fn of(d: DType) -> Elem {
        if d.is_float() { Elem::F32 } else { Elem::I32 }
    }

    /// The WGSL scalar type.
    pub fn wgsl(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::I32 => "i32",
        }
    }
}
