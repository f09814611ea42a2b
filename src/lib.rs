//! shardc
