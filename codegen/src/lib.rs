//! Code generation (filled in by the codegen milestone).
#![forbid(unsafe_code)]
