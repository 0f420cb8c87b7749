//! Allgather schedules as pure state machines.
