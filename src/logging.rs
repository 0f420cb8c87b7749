//! `CIERA_DEBUG=ERROR|WARN|INFO|DEBUG|TRACE`: log CIERA's decisions and statistics to stderr
//! through `tracing`. Installs a subscriber only when the variable is set and the application
//! has none of its own.
#![forbid(unsafe_code)]

use std::sync::Once;

/// Install the stderr subscriber once per process if `CIERA_DEBUG` asks for one.
pub fn init_from_env() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let Ok(v) = std::env::var("CIERA_DEBUG") else {
            return;
        };
        let level = match v.trim().to_ascii_uppercase().as_str() {
            "" | "0" | "OFF" | "NONE" => return,
            "ERROR" => tracing::Level::ERROR,
            "WARN" | "WARNING" => tracing::Level::WARN,
            "DEBUG" => tracing::Level::DEBUG,
            "TRACE" => tracing::Level::TRACE,
            _ => tracing::Level::INFO,
        };
        let _ = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_writer(std::io::stderr)
            .with_target(false)
            .try_init();
    });
}
