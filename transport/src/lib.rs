//! Transports for CIERA (skeleton; see the transport issue).
use std::fmt;
#[derive(Debug)]
pub struct TransportError(pub String);
impl fmt::Display for TransportError { fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(&self.0) } }
impl std::error::Error for TransportError {}
