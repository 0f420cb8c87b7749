//! Tiny argument helpers shared by the subcommands.
