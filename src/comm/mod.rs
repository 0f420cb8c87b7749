//! Bootstrap, communicator and executor.
