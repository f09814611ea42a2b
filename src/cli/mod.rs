//! The subcommands.

pub mod calibrate;
pub mod common;
pub mod cost;
pub mod lower;
pub mod parse;
pub mod plan;
pub mod run;
pub mod signals;
pub mod stats;
pub mod sweep;
pub mod train;
pub mod transport;
pub mod ui;
