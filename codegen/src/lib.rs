//! Code generation (filled in by the codegen milestone).
#![forbid(unsafe_code)]
#![deny(clippy::print_stdout, clippy::print_stderr)]
