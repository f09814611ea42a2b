//! The subcommands.

pub mod common;
pub mod parse;
pub mod stats;
