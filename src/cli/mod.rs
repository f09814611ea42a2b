//! The subcommands.

pub mod common;
pub mod cost;
pub mod parse;
pub mod plan;
pub mod stats;
pub mod sweep;
