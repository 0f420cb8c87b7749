//! Frame format and caches.
